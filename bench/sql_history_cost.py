"""Where history costs time: the kit's own claim and settle statements under EXPLAIN (ANALYZE, BUFFERS,
WAL), on an empty table and on one with 1.1M history rows, in the same run.

For each schema: P pending rows are enqueued, then claimed 10 at a time and settled 10 at a time
(the burn-down's batch), each statement under EXPLAIN ANALYZE in its own transaction that commits, as
the worker's do. Sums per message: server time, shared buffers hit and read, WAL records, full-page
images and bytes. The difference between the two schemas is what the history costs each message.

Usage: .venv/bin/python bench/sql_history_cost.py [--history 1000000] [--messages 2000]
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from datetime import timedelta
from typing import Any

import common
import sqlalchemy as sa
from psycopg import sql
from sql_burndown import Noop
from sql_history import fill_history

from queueing_core import QueueingApp
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.statements import bind, claim_params
from queueing_core.runtime import Runtime

FIELDS = (
    "Shared Hit Blocks",
    "Shared Read Blocks",
    "Shared Dirtied Blocks",
    "WAL Records",
    "WAL FPI",
    "WAL Bytes",
)


def totals(plan: dict[str, Any]) -> Counter[str]:
    top = plan["Plan"]
    out: Counter[str] = Counter({f: top.get(f, 0) for f in FIELDS})
    out["ms"] = plan["Execution Time"] + plan["Planning Time"]
    for trig in plan.get("Triggers", []):
        out["trigger ms"] += trig["Time"]
    return out


async def explain(conn: Any, stmt: sa.Executable, params: dict[str, Any]) -> Counter[str]:
    # the statement as the driver receives it: IN lists expanded, values bound (not inlined)
    state = stmt.compile(dialect=conn.dialect).construct_expanded_state(params)
    text = f"EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) {state.statement}"
    raw = (await conn.exec_driver_sql(text, state.parameters)).scalar_one()
    return totals((json.loads(raw) if isinstance(raw, str) else raw)[0])


async def measure(url: str, schema: str, messages: int) -> dict[str, Counter[str]]:
    prov = SqlProvider(url, schema=schema, listen=False)
    app = QueueingApp("bench")
    app.message(Noop)
    rt = Runtime(app, prov)
    await rt.open()
    try:
        await common.enqueue_range(app, lambda j: Noop(n=j), messages)
        common.analyze(url, sql.Identifier(schema, "queueing_messages"))
        st = prov.statements
        out: dict[str, Counter[str]] = {"claim": Counter(), "settle": Counter()}
        for _ in range(messages // 10):
            now = prov.clock()
            params = claim_params("bench_noop", 10, now, now + timedelta(seconds=60))
            async with prov.engine.begin() as conn:
                out["claim"] += await explain(conn, st.claim, params)
            async with prov.engine.connect() as conn:
                rows = (
                    await conn.execute(
                        sa.text(
                            f'SELECT id, lease_token FROM "{schema}".queueing_messages '
                            "WHERE status = 'Leased'"
                        )
                    )
                ).all()
            async with prov.engine.begin() as conn:
                out["settle"] += await explain(
                    conn,
                    st.complete_many,
                    bind(ids=[r[0] for r in rows], leases=[tuple(r) for r in rows], now=prov.clock()),
                )
        return out
    finally:
        await rt.close()


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=None)
    p.add_argument("--history", type=int, default=1_000_000)
    p.add_argument("--messages", type=int, default=2_000)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    common.header("History's cost per message, from EXPLAIN (ANALYZE, BUFFERS, WAL)", args)
    with (
        common.throwaway_schema(args.url, "cost_empty") as empty,
        common.throwaway_schema(args.url, "cost_hist") as full,
    ):
        for schema in (empty, full):
            prov = SqlProvider(args.url, schema=schema, listen=False)
            await prov.open()
            await prov.close()
        took = fill_history(args.url, full, args.history, args.history // 10)
        print(f"   history filled in {took:.1f} s")
        results = {"empty": await measure(args.url, empty, args.messages)}
        results["history"] = await measure(args.url, full, args.messages)
        results["empty (again)"] = await measure(args.url, empty, args.messages)
    rows = []
    for name, parts in results.items():
        for stmt, c in parts.items():
            n = args.messages
            rows.append(
                [
                    name,
                    stmt,
                    f"{c['ms'] * 1000 / n:.0f}",
                    f"{c['Shared Hit Blocks'] / n:.1f}",
                    f"{c['Shared Read Blocks'] / n:.2f}",
                    f"{c['Shared Dirtied Blocks'] / n:.2f}",
                    f"{c['WAL Records'] / n:.1f}",
                    f"{c['WAL FPI'] / n:.2f}",
                    f"{c['WAL Bytes'] / n:,.0f}",
                    f"{c['trigger ms'] * 1000 / n:.0f}",
                ]
            )
    print()
    common.print_table(
        [
            "table",
            "statement",
            "server µs/msg",
            "buf hit/msg",
            "buf read/msg",
            "dirtied/msg",
            "WAL rec/msg",
            "WAL FPI/msg",
            "WAL bytes/msg",
            "trigger µs/msg",
        ],
        rows,
    )
    print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    asyncio.run(main())
