"""The SQLite claim and settlement statements alone, one change at a time: µs per message in SQLite.

A template database of ``--messages`` rows is made once by the kit itself (``enqueue_many``, the
kit's schema at its latest migration); each round of each variant works on a fresh copy of it, on
one ``sqlite3`` connection with the kit's PRAGMAs (WAL, ``synchronous=NORMAL``), with no asyncio
and no kit code in the loop: claim ``--batch`` rows (``BEGIN IMMEDIATE`` ... ``COMMIT``), and every
``--settle`` claimed rows settle them as succeeded in one transaction, until the queue is empty.
The clock (this thread's CPU time, which the other sessions on the machine move less than the wall)
runs around the statements and their commits only; printed per variant: the medians over
``--rounds`` rounds (variants interleaved, each round starting at the next variant) of the claim's and
the settlement's µs per message.

Variants change one thing against ``kit`` (the statements the kit compiles for SQLite, on its schema):
an index dropped or narrowed, a filter of the claim left out or rewritten, the claim's shape, the
columns it returns, the settlement's shape and batch size.

Usage: .venv/bin/python bench/sqlite_statements.py [--messages 20000] [--rounds 5] [--only "variant|..."]
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.schema import Tables
from queueing_core.providers.sql.sqlite_driver import SqliteCompiled
from queueing_core.providers.sql.statements import Statements, bind, claim_step, leases_of
from queueing_core.runtime import Runtime

WORKER = "bench-worker"


@queue("bench_stmt")
class Stmt(QueueMessage):
    n: int


async def make_template(path: Path, n: int) -> None:
    app = QueueingApp("bench")

    @app.handler()
    async def handle(msg: Stmt) -> None:
        return None

    provider = SqlProvider(f"sqlite:///{path}", listen=False)
    rt = Runtime(app, provider)
    await rt.open()
    try:
        await common.enqueue_range(app, lambda j: Stmt(n=j), n)
    finally:
        await rt.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@dataclass
class Variant:
    name: str
    ddl: list[str] = field(default_factory=list)  # run on the copy before the clock starts
    claim: str | None = None  # SQL text, else the kit's
    settle: str | None = None  # SQL text taking :b_leases (JSON pairs), else the kit's
    settle_each: str | None = None  # SQL text run once per row (executemany) with :id, :token
    settle_rows: int | None = None
    claim_in_two: Callable[[sqlite3.Connection, dict[str, Any]], list[tuple[int, int]]] | None = None


def kit_sql() -> tuple[str, str, dict[str, Any], dict[str, Any]]:
    """The kit's claim and complete_many as compiled for SQLite, with their constant values."""
    from sqlalchemy.dialects import sqlite

    st = Statements(Tables.build(), WORKER, "sqlite")
    dialect = sqlite.dialect(paramstyle="named")
    claim = SqliteCompiled(st.claim, dialect)
    done = SqliteCompiled(st.complete_many, dialect)
    return claim.sql, done.sql, claim.defaults, done.defaults


def run_round(path: Path, v: Variant, batch: int, settle_rows: int) -> tuple[float, float, int]:
    claim_sql, done_sql, claim_defaults, done_defaults = kit_sql()
    claim_sql = v.claim or claim_sql
    done_sql = v.settle or done_sql
    rows = v.settle_rows or settle_rows
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for ddl in v.ddl:
        conn.execute(ddl)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    now = datetime.now(UTC).replace(tzinfo=None) + timedelta(seconds=1)
    text = now.strftime("%Y-%m-%d %H:%M:%S.%f")
    until = (now + timedelta(seconds=30)).strftime("%Y-%m-%d %H:%M:%S.%f")
    # (times as the text SQLite stores: the kit's claim_params binds datetimes; the step as it draws it)
    values = bind(queue="bench_stmt", now=text, lease_until=until, limit=batch, step=claim_step())
    cp = {**claim_defaults, **values}
    claim_t = settle_t = 0.0
    held: list[tuple[int, int]] = []
    claimed = 0

    def settle() -> float:
        t = time.thread_time()
        conn.execute("BEGIN IMMEDIATE")
        if v.settle_each is not None:
            conn.executemany(v.settle_each, [{"id": r, "token": k, "b_now": text} for r, k in held])
        else:
            dp = {**done_defaults, **bind(now=text), **leases_of("sqlite", *zip(*held, strict=True))}
            got = conn.execute(done_sql, dp).fetchall()
            assert len(got) == len(held), (len(got), len(held))
        conn.execute("COMMIT")
        return time.thread_time() - t

    while True:
        t = time.thread_time()
        conn.execute("BEGIN IMMEDIATE")
        if v.claim_in_two is not None:
            got = v.claim_in_two(conn, cp)
        else:
            cur = conn.execute(claim_sql, cp)
            names = [d[0] for d in cur.description]
            i_id, i_tok = names.index("id"), names.index("lease_token")
            got = [(r[i_id], r[i_tok]) for r in cur.fetchall()]
        conn.execute("COMMIT")
        claim_t += time.thread_time() - t
        if not got:
            break
        claimed += len(got)
        held += got
        if len(held) >= rows:
            settle_t += settle()
            held = []
    if held:
        settle_t += settle()
    left = conn.execute("SELECT count(*) FROM queueing_messages WHERE status <> 'Succeeded'").fetchone()[0]
    conn.close()
    assert left == 0, f"{left} rows not Succeeded"
    return claim_t / claimed * 1e6, settle_t / claimed * 1e6, claimed


CLAIMABLE = "status IN ('Pending', 'Failed', 'Sleeping', 'WaitingForHandler', 'Paused') AND NOT archived"


def variants() -> list[Variant]:
    claim_sql, _, _, _ = kit_sql()
    pause_start = claim_sql.index(" AND NOT (EXISTS (SELECT * \nFROM queueing_pauses")
    circuit_start = claim_sql.index(" AND NOT (EXISTS (SELECT * \nFROM queueing_circuits")
    filters_end = claim_sql.index(" ORDER BY queueing_messages.available_at")
    no_filters = claim_sql[:pause_start] + claim_sql[filters_end:]
    no_pause = claim_sql[:pause_start] + claim_sql[circuit_start:]
    no_circuit = claim_sql[:circuit_start] + claim_sql[filters_end:]
    # the same two checks, uncorrelated: each subquery runs once per statement, then a lookup per row
    hoisted = (
        claim_sql[:pause_start]
        + " AND NOT EXISTS (SELECT 1 FROM queueing_pauses WHERE kind = :kind_1 AND name = :b_queue)"
        " AND queueing_messages.type NOT IN (SELECT name FROM queueing_pauses WHERE kind = :kind_2)"
        " AND queueing_messages.type NOT IN (SELECT type FROM queueing_circuits WHERE"
        " state = :state_1 AND (open_until IS NULL OR open_until > :b_now) OR"
        " state = :state_2 AND (probe_until IS NULL OR probe_until > :b_now))" + claim_sql[filters_end:]
    )
    ret = claim_sql.index(" RETURNING ")
    only_id = claim_sql[:ret] + " RETURNING id, lease_token"
    # UPDATE ... WHERE id IN (SELECT ... LIMIT) instead of a CTE joined with UPDATE ... FROM
    cte_body = claim_sql[claim_sql.index("(SELECT queueing_messages.id") + 1 : claim_sql.index(")\n UPDATE")]
    set_part = claim_sql[claim_sql.index(" SET ") : claim_sql.index(" FROM due")]
    in_shape = (
        f"UPDATE queueing_messages{set_part} WHERE queueing_messages.id IN ({cte_body})" + claim_sql[ret:]
    )
    no_offset = claim_sql.replace(" OFFSET :param_1", "")
    not_succeeded_leased = "status NOT IN ('Succeeded', 'Leased')"
    narrow = [
        "DROP INDEX IF EXISTS ix_queueing_messages_status",
        "DROP INDEX IF EXISTS ix_queueing_messages_queue_status",
        f"CREATE INDEX ix_queueing_messages_status ON queueing_messages (status, created_at, id) "
        f"WHERE {not_succeeded_leased}",
        "CREATE INDEX ix_queueing_messages_queue_status ON queueing_messages "
        f"(queue, status, created_at, id) WHERE {not_succeeded_leased}",
    ]
    simple_settle = (
        "UPDATE queueing_messages SET status='Succeeded', attempt=attempt + 1, updated_at=:b_now, "
        "locked_by=NULL, locked_until=NULL, settled_at=:b_now WHERE id = :id AND lease_token = :token "
        f"AND locked_by = '{WORKER}' AND status = 'Leased'"
    )

    def select_then_update(conn: sqlite3.Connection, cp: dict[str, Any]) -> list[tuple[int, int]]:
        ids = [r[0] for r in conn.execute(f"SELECT {cte_body[len('SELECT ') :]}", cp)]
        if not ids:
            return []
        got = conn.execute(
            f"UPDATE queueing_messages{set_part} WHERE queueing_messages.id IN "
            f"(SELECT value FROM json_each(:ids))" + claim_sql[ret:],
            {**cp, "ids": "[" + ",".join(map(str, ids)) + "]"},
        ).fetchall()
        return [(r[0], r[11]) for r in got]

    drop = "DROP INDEX IF EXISTS ix_queueing_messages_"
    return [
        Variant("kit"),
        Variant("no ix_claim", ddl=[drop + "claim"]),
        Variant("no ix_leased", ddl=[drop + "leased"]),
        Variant("no ix_status", ddl=[drop + "status"]),
        Variant("no ix_queue_status", ddl=[drop + "queue_status"]),
        Variant("no ix_status, ix_queue_status", ddl=[drop + "status", drop + "queue_status"]),
        Variant("ix_status/queue_status without Leased", ddl=narrow),
        Variant("no ix_settled", ddl=[drop + "settled"]),
        Variant("no ix_created", ddl=[drop + "created"]),
        Variant("claim: no pause/circuit filters", claim=no_filters),
        Variant("claim: no pause filter", claim=no_pause),
        Variant("claim: no circuit filter", claim=no_circuit),
        Variant("claim: filters uncorrelated", claim=hoisted),
        Variant("claim: RETURNING id only", claim=only_id),
        Variant("claim: WHERE id IN (SELECT ... LIMIT)", claim=in_shape),
        Variant("claim: no OFFSET", claim=no_offset),
        Variant("claim: SELECT, then UPDATE by id", claim_in_two=select_then_update),
        Variant("settle: batches of 10", settle_rows=10),
        Variant("settle: batches of 200", settle_rows=200),
        Variant("settle: one UPDATE per row (executemany)", settle_each=simple_settle),
    ]


def main() -> None:
    p = common.base_parser((__doc__ or "").splitlines()[0], rounds=5, postgres=False)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=10, help="rows a claim takes")
    p.add_argument("--settle", type=int, default=50, help="rows a settlement takes")
    p.add_argument("--only", default="", help="variants separated by | (kit always runs)")
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    common.header("SQLite statements alone: claim and settlement µs per message", args)
    all_variants = variants()
    if args.only:
        wanted = {"kit", *(w.strip() for w in args.only.split("|"))}
        all_variants = [v for v in all_variants if v.name in wanted]
    results: dict[str, list[tuple[float, float]]] = {v.name: [] for v in all_variants}
    with tempfile.TemporaryDirectory(prefix="bench_sqlite_stmt_", dir=args.dir) as tmp:
        template = Path(tmp) / "template.db"
        asyncio.run(make_template(template, args.messages))
        for r in range(args.rounds):
            # rotated: each round starts at another variant (measured: the first of a round ran its
            # claim 2-3 µs a message slower than the same claim later in the round)
            k = r % len(all_variants)
            for v in all_variants[k:] + all_variants[:k]:
                copy = Path(tmp) / "round.db"
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{copy}{suffix}").unlink(missing_ok=True)
                shutil.copy(template, copy)
                c, s, n = run_round(copy, v, args.batch, args.settle)
                assert n == args.messages, (v.name, n)
                results[v.name].append((c, s))
            print(f"  round {r + 1}/{args.rounds} done, load {common.load()}", flush=True)
    base_c, base_s = (statistics.median(x[i] for x in results["kit"]) for i in (0, 1))
    rows = []
    for name, rs in results.items():
        c, s = statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)
        t = statistics.median(x[0] + x[1] for x in rs)
        rows.append([name, f"{c:.1f}", f"{s:.1f}", f"{t:.1f}", f"{t - (base_c + base_s):+.1f}"])
    common.print_table(["variant", "claim µs/msg", "settle µs/msg", "both", "vs kit"], rows)
    print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    main()
