"""The PostgreSQL server's own counters around a benchmark's timed part: what it committed, how much WAL
it wrote and flushed, and how the rows of the tables under test were written.

- ``pg_stat_database`` of the benchmark's database: commits and rollbacks. Counted per database, so a
  benchmark that wants its own figures runs in a database of its own (other sessions use the shared
  one); the commits of every other database in the same window are kept too, as the noise figure.
- transaction ids assigned (the next one's number, read without taking one): the transactions that
  wrote something, whose commit is a WAL record to flush (a read-only commit has none). Server-wide.
- ``pg_stat_wal``: records, full-page images, bytes, writes and syncs (``fdatasync`` here). Counted for
  the whole server: other sessions' WAL is in it, which ``other_commits`` lets the reader judge.
- ``pg_stat_user_tables`` of one schema, summed: rows inserted, updated (and of those HOT, i.e.
  without touching an index), deleted.

A backend reports its counters when it goes idle, at most once a second, and when it exits, so a
snapshot is taken only after the connections under test have been idle (``settle``) or closed for
longer than that. The snapshot's own transaction counts as one commit: it is subtracted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import common
import psycopg

#: a backend flushes its pending counters when idle, no more often than once a second (PostgreSQL 15)
REPORT_INTERVAL = 1.1

_SNAPSHOT = """
SELECT
    (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
    (SELECT xact_rollback FROM pg_stat_database WHERE datname = current_database()),
    (SELECT sum(xact_commit) FROM pg_stat_database WHERE datname IS DISTINCT FROM current_database()),
    pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
    wal_records, wal_fpi, wal_bytes, wal_write, wal_sync,
    (SELECT coalesce(sum(n_tup_ins), 0) FROM pg_stat_user_tables WHERE schemaname = %(schema)s),
    (SELECT coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables WHERE schemaname = %(schema)s),
    (SELECT coalesce(sum(n_tup_hot_upd), 0) FROM pg_stat_user_tables WHERE schemaname = %(schema)s),
    (SELECT coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables WHERE schemaname = %(schema)s)
FROM pg_stat_wal
"""

#: the snapshot's columns, in order
FIELDS = (
    "commits",
    "rollbacks",
    "other_commits",
    "xids",
    "wal_records",
    "wal_fpi",
    "wal_bytes",
    "wal_write",
    "wal_sync",
    "ins",
    "upd",
    "hot_upd",
    "del",
)


def snapshot(url: str, schema: str) -> dict[str, float]:
    """The counters now, as the server has them (one short autocommit connection)."""
    with psycopg.connect(common.libpq_conninfo(url), autocommit=True) as conn:
        row = conn.execute(_SNAPSHOT, {"schema": schema}).fetchone()
    assert row is not None
    return {name: float(value or 0) for name, value in zip(FIELDS, row, strict=True)}


@dataclass
class Window:
    """The counters' change between :meth:`start` and :meth:`stop`, for the tables of ``schema``."""

    url: str
    schema: str
    before: dict[str, float] = field(default_factory=dict)
    delta: dict[str, float] = field(default_factory=dict)

    async def start(self) -> None:
        await asyncio.sleep(REPORT_INTERVAL)  # the set-up's connections have reported
        self.before = snapshot(self.url, self.schema)

    async def stop(self) -> None:
        await asyncio.sleep(REPORT_INTERVAL)  # the connections under test have exited or reported
        after = snapshot(self.url, self.schema)
        self.delta = {k: after[k] - self.before[k] for k in FIELDS}
        self.delta["commits"] -= 2  # the two snapshots' own transactions (each counted once)

    def per_message(self, messages: int) -> dict[str, float]:
        """Per message: commits, rollbacks, transactions that wrote, WAL records, full-page images,
        bytes, writes and syncs, and the tables' rows inserted, updated, HOT-updated and deleted;
        ``other_commits`` as is."""
        out = {k: v / messages for k, v in self.delta.items() if k != "other_commits"}
        out["other_commits"] = self.delta["other_commits"]
        return out


def describe(per: dict[str, float]) -> str:
    """One line of the per-message figures."""
    hot = per["hot_upd"] / per["upd"] if per["upd"] else 0.0
    return (
        f"per message: commits {per['commits']:.3f} (writing {per['xids']:.3f}), "
        f"rollbacks {per['rollbacks']:.3f}; "
        f"WAL records {per['wal_records']:.1f}, FPI {per['wal_fpi']:.2f}, bytes {per['wal_bytes']:,.0f}, "
        f"writes {per['wal_write']:.3f}, syncs {per['wal_sync']:.3f}; rows ins {per['ins']:.2f}, "
        f"upd {per['upd']:.2f} (HOT {hot:.0%}), del {per['del']:.2f}; "
        f"other databases' commits in the window {per['other_commits']:,.0f}"
    )


def wal_syncs(url: str) -> int:
    """The server's WAL syncs so far (``pg_stat_wal.wal_sync``): a rough figure on a shared server."""
    return int(snapshot(url, "")["wal_sync"])
