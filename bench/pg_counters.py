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

Not the server's counters, but read beside them (the server runs on this machine): the CPU time of the
server processes that serve the benchmark's database (backends, whose process title names it, polled
from ``/proc`` every 0.1 s so the ones that exit are counted too), of the server's own background
processes (WAL writer, checkpointer, background writer: the whole server's), and of this process.

A backend reports its counters when it exits, and while it lives when it goes idle, but no more
often than once a second: an idle backend that reported less than a second ago reports again only 10
seconds later. So the first snapshot waits that long after the set-up (its enqueue's connections
stay open, idle), and the second is taken after the connections under test have been closed. The
snapshots' own transactions are subtracted (to within one commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import psycopg
from sqlalchemy.engine import make_url

#: an idle backend reports what it has not reported yet within 10 s (PostgreSQL 15's
#: PGSTAT_IDLE_INTERVAL), and one that exits at once: the waits before the two snapshots
IDLE_REPORT = 11.0
EXIT_REPORT = 1.1

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


#: the server's background processes whose CPU is counted (their process titles)
BACKGROUND = ("walwriter", "checkpointer", "background writer")

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_and_title(pid: int) -> tuple[float, str] | None:
    """CPU seconds (user + system) and process title of ``pid``; None once it has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; utime and stime are 14 and 15
    return (int(fields[11]) + int(fields[12])) / _TICK, title


class ServerCpu:
    """Polls the CPU time of the postmaster's children: those that serve ``dbname``, and the background
    processes. A backend seen first after :meth:`start` counts from zero (its start-up is the
    contender's); one that exits between two polls loses at most a poll's CPU."""

    def __init__(self, postmaster: int, dbname: str) -> None:
        self.postmaster, self.dbname = postmaster, dbname
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[float, bool]] = {}  # pid -> (cpu, serves our database)
        self._task: asyncio.Task[None] | None = None

    def _poll(self, *, initial: bool = False) -> None:
        children = Path(f"/proc/{self.postmaster}/task/{self.postmaster}/children").read_text().split()
        for pid in map(int, children):
            got = _cpu_and_title(pid)
            if got is None:
                continue
            cpu, title = got
            ours = f" {self.dbname} " in title
            if not ours and not any(f": {b}" in title for b in BACKGROUND):
                continue
            self.first.setdefault(pid, cpu if initial else 0.0)
            self.last[pid] = (cpu, ours)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self._poll()

    def start(self) -> None:
        self._poll(initial=True)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> tuple[float, float]:
        """CPU seconds since :meth:`start`: of the database's backends, of the background processes."""
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._poll()
        ours = sum(cpu - self.first[pid] for pid, (cpu, mine) in self.last.items() if mine)
        background = sum(cpu - self.first[pid] for pid, (cpu, mine) in self.last.items() if not mine)
        return ours, background


def postmaster_pid(url: str) -> int:
    """The server's main process (the parent of a backend): when the server is on this machine."""
    with psycopg.connect(common.libpq_conninfo(url), autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        # read while the backend lives (it exits with the connection)
        stat = Path(f"/proc/{row[0]}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


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
    cpu: ServerCpu | None = None
    client: float = 0.0

    async def start(self) -> None:
        await asyncio.sleep(IDLE_REPORT)  # the set-up's connections, idle now, have reported
        self.before = snapshot(self.url, self.schema)
        self.cpu = ServerCpu(postmaster_pid(self.url), str(make_url(self.url).database))
        self.cpu.start()
        self.client = time.process_time()

    async def stop(self) -> None:
        assert self.cpu is not None
        client = time.process_time() - self.client
        backends, background = await self.cpu.stop()
        await asyncio.sleep(EXIT_REPORT)  # the connections under test have exited, and reported
        after = snapshot(self.url, self.schema)
        self.delta = {k: after[k] - self.before[k] for k in FIELDS}
        # the snapshots' own transactions: two each (its connection's start-up and its query), and
        # postmaster_pid's two; the second snapshot's query is not reported yet when it reads (a new
        # backend reports its start-up at once, then no more than once a second): right to within one
        self.delta["commits"] -= 5
        self.delta.update(server_cpu=backends, background_cpu=background, client_cpu=client)

    def per_message(self, messages: int) -> dict[str, float]:
        """Per message: commits, rollbacks, transactions that wrote, WAL records, full-page images,
        bytes, writes and syncs, and the tables' rows inserted, updated, HOT-updated and deleted;
        ``other_commits`` as is."""
        out = {k: v / messages for k, v in self.delta.items() if k != "other_commits"}
        for k in ("server_cpu", "background_cpu", "client_cpu"):
            out[k] *= 1e6  # µs
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
        f"other databases' commits in the window {per['other_commits']:,.0f}; CPU µs: the database's "
        f"backends {per['server_cpu']:.0f}, the server's background {per['background_cpu']:.0f}, "
        f"this process {per['client_cpu']:.0f}"
    )


def wal_syncs(url: str) -> int:
    """The server's WAL syncs so far (``pg_stat_wal.wal_sync``): a rough figure on a shared server."""
    return int(snapshot(url, "")["wal_sync"])
