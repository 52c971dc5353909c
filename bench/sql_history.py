"""History does not slow the queue: the kit's burn-down on PostgreSQL with 1.1M history rows vs empty.

1. Two fresh schemas. One stays empty; the other gets 1,000,000 Succeeded and 100,000 DeadLettered
   rows in the benchmark's own queue (the worst case for the claim index: same queue, same key
   prefix), settled over the last 5 days, inserted with one INSERT ... SELECT generate_series, then
   VACUUM ANALYZE (what autovacuum does after a bulk load).
2. Burn-down rounds, interleaved (empty, history, then history, empty, ...): N no-ops enqueued into
   each schema, one worker of bench/sql_burndown.py's shape and connection budget, durable claims.
   Target: rate with history / rate on the empty table >= 0.8.
3. Churn: a simulated day on the history schema: every cycle enqueues and burns K messages, then
   runs the kit's maintenance with retention whose archive cutoff is an hour later than the last
   cycle's (archived rows are deleted at the next cycle), so each cycle archives and deletes 1/120
   of the history (the cutoff moves, not the clock). Per cycle: the rate, rows archived and deleted,
   the upkeep pass's wall time, the table's live and dead rows, the claim index's size, how many
   updates were HOT, and the vacuums that ran. On a server with ``autovacuum = off`` (this machine's
   shared one) a stand-in makes autovacuum's decisions on the kit's tables (``autovacuum.py``: the
   same thresholds, the kit's per-table settings, autovacuum's throttle, beside the workers), unless
   ``--no-vacuum`` asks for the worst case of no vacuum at all. After the last cycle, the claim's plan
   on the churned table is read (``EXPLAIN``): it must still be the claim's partial index.

Usage: .venv/bin/python bench/sql_history.py [--quick] [--history 1000000] [--messages 20000]
           [--rounds 3] [--cycles 24] [--churn-only] [--naptime 15] [--no-vacuum]
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

import autovacuum
import common
import psycopg
from psycopg import sql
from sql_burndown import Options, kit_burn, kit_provider

from queueing_core.providers.sql import RetentionPolicy, SqlProvider

TARGET = 0.8
QUEUE = "bench_noop"  # sql_burndown's Noop queue


class HistoryOptions(Options):
    history: int
    cycles: int
    churn_messages: int
    churn_only: bool
    naptime: float
    no_vacuum: bool


def fill_history(url: str, schema: str, succeeded: int, dead: int) -> float:
    """Succeeded and dead-lettered rows of the benchmark's queue, settled over the last five days."""
    started = common.now()
    with psycopg.connect(common.libpq_conninfo(url), autocommit=True) as conn:
        conn.execute(
            sql.SQL("""
            INSERT INTO {} (message_id, tracking_id, queue, type, status, attempt, created_at,
                updated_at, available_at, settled_at, headers, body, reason, archived)
            SELECT gen_random_uuid(), gen_random_uuid(), %(queue)s, 'Noop',
                   CASE WHEN i <= %(succeeded)s THEN 'Succeeded' ELSE 'DeadLettered' END, 1,
                   now() - (i * 432000.0 / %(total)s) * interval '1 second',
                   now() - (i * 432000.0 / %(total)s) * interval '1 second',
                   now() - (i * 432000.0 / %(total)s) * interval '1 second',
                   now() - (i * 432000.0 / %(total)s) * interval '1 second',
                   '{{}}'::jsonb, jsonb_build_object('n', i),
                   CASE WHEN i > %(succeeded)s THEN 'max-attempts-exceeded' END, false
            FROM generate_series(1, %(total)s) AS i""").format(sql.Identifier(schema, "queueing_messages")),
            {"queue": QUEUE, "succeeded": succeeded, "total": succeeded + dead},
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "queueing_messages")))
    return common.now() - started


def table_state(url: str, schema: str) -> dict[str, Any]:
    with psycopg.connect(common.libpq_conninfo(url), autocommit=True) as conn:
        row = conn.execute(
            """SELECT s.n_live_tup, s.n_dead_tup, s.n_tup_upd, s.n_tup_hot_upd, s.autovacuum_count,
                 pg_relation_size(format('%%I.%%I', %(s)s::text, 'ix_queueing_messages_claim')::regclass),
                 pg_relation_size(format('%%I.%%I', %(s)s::text, 'queueing_messages')::regclass)
               FROM pg_stat_user_tables s WHERE s.schemaname = %(s)s AND s.relname = 'queueing_messages'""",
            {"s": schema},
        ).fetchone()
    assert row is not None
    keys = ("live", "dead", "updates", "hot_updates", "autovacuums", "claim_index_bytes", "table_bytes")
    return dict(zip(keys, row, strict=True))


async def migrate(url: str, schema: str) -> None:
    prov = SqlProvider(url, schema=schema, listen=False)
    await prov.open()
    await prov.close()


async def churn(args: HistoryOptions, schema: str) -> list[float]:
    # A simulated hour per cycle, on the real clock (a shifted clock would age the messages' own
    # expiry too): retention's archive cutoff moves an hour closer each cycle instead, and archived
    # rows are deleted at the next cycle's maintenance, seconds of real time later.
    def provider(cycle: int) -> SqlProvider:
        prov = kit_provider(args, schema, durable=True)
        prov.retention = RetentionPolicy(
            archive_after=timedelta(days=5) - timedelta(hours=cycle),
            delete_archived_after=timedelta(seconds=1),
        )
        return prov

    def burning(cycle: int) -> SqlProvider:
        # the worker's own upkeep (a few seconds after its start) is left to the cycle's timed pass:
        # run during the burn, or cut short by its end, it would move the counts to the next cycle
        prov = provider(cycle)
        prov.maintenance_interval = 3600.0
        return prov

    rates: list[float] = []
    print(
        f"\nchurn: {args.cycles} cycles of one simulated hour, {args.churn_messages:,} messages each "
        "(rate; retention's work; the table afterwards)"
    )
    vacuum = autovacuum.AutovacuumStandIn(
        common.libpq_conninfo(args.url), schema, ("queueing_messages", "queueing_counts"), args.naptime
    )
    standing_in = not args.no_vacuum and vacuum.start()
    if standing_in:
        print(
            f"   the server's autovacuum is off: a stand-in decides as autovacuum would "
            f"(naptime {args.naptime:g} s, and after every cycle)"
        )
    elif args.no_vacuum:
        print("   no vacuum at all (--no-vacuum): the worst case")
    rows = []
    for cycle in range(1, args.cycles + 1):
        burn = await kit_burn(args, burning(cycle), args.churn_messages)
        maint = provider(cycle)
        await maint.open()
        started = common.now()
        done = await maint.maintain()
        upkeep = (common.now() - started) * 1000
        await maint.close()
        if standing_in:
            vacuum.nudge()  # (it vacuums beside the next cycle's burn, as autovacuum would)
        state = table_state(args.url, schema)
        rates.append(burn.rate)
        hot = state["hot_updates"] / state["updates"] if state["updates"] else 0.0
        rows.append(
            [
                cycle,
                burn.rate,
                done["archived"],
                done["deleted_archived"],
                upkeep,
                f"{state['live']:,}",
                f"{state['dead']:,}",
                f"{state['claim_index_bytes'] / 1024:,.0f}",
                f"{hot:.0%}",
                state["autovacuums"] + (vacuum.ran["queueing_messages"].vacuums if standing_in else 0),
                common.load(1),
            ]
        )
        print(f"  cycle {cycle:>2}: {burn.rate:8,.0f} msg/s  (load {common.load(1)})", flush=True)
    common.print_table(
        [
            "cycle",
            "msg/s",
            "archived",
            "deleted",
            "upkeep ms",
            "live rows",
            "dead rows",
            "claim index KiB",
            "HOT updates",
            "vacuums",
            "load",
        ],
        rows,
    )
    if standing_in:
        vacuum.stop()
        for table, ran in vacuum.ran.items():
            print(
                f"   stand-in on {table}: {ran.vacuums} vacuums, {ran.analyzes} analyzes, "
                f"{ran.seconds:.1f} s in all"
            )
    print(f"   the claim's plan after the churn: {await claim_plan(args, schema)}")
    return rates


async def claim_plan(args: HistoryOptions, schema: str) -> str:
    """The index (or scan) the claim's row source uses on ``schema``'s table, as the server plans it now."""
    prov = SqlProvider(args.url, schema=schema, listen=False)
    await prov.open()
    try:
        now = prov.clock()
        text, params = prov.claim_sql(QUEUE, args.batch, now, now + timedelta(seconds=30))
        async with prov.engine.connect() as conn:
            raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {text}", params)).scalar_one()
            await conn.rollback()
    finally:
        await prov.close()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    found: list[str] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "queueing_messages" and node["Node Type"] != "ModifyTable":
            found.append(f"{node['Node Type']} on {node.get('Index Name', 'the table')}")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan)
    return "; ".join(found)


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--quick", action="store_true", help="a smoke run: 110k history rows, 2,000 messages")
    p.add_argument(
        "--history", type=int, default=1_000_000, help="Succeeded rows (a tenth more dead letters)"
    )
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--cycles", type=int, default=24)
    p.add_argument("--churn-messages", type=int, default=2_000)
    p.add_argument("--connections", type=int, default=3)
    p.add_argument("--churn-only", action="store_true", help="skip the empty-vs-history rounds")
    p.add_argument(
        "--naptime", type=float, default=15.0, help="the autovacuum stand-in's naptime (the one recommended)"
    )
    p.add_argument("--no-vacuum", action="store_true", help="no vacuum during the churn (the worst case)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--in-hand", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(namespace=HistoryOptions())
    if args.quick:
        args.history, args.messages, args.rounds, args.cycles, args.churn_messages = (
            100_000,
            2_000,
            1,
            3,
            1_000,
        )
    logging.basicConfig(level=logging.WARNING)
    common.header("SQL burn-down with history vs an empty table (PostgreSQL, kit, durable claims)", args)
    with (
        common.throwaway_schema(args.url, "bench_empty") as empty,
        common.throwaway_schema(args.url, "bench_hist") as full,
    ):
        await migrate(args.url, empty)
        await migrate(args.url, full)
        dead = args.history // 10
        took = fill_history(args.url, full, args.history, dead)
        print(
            f"   history: {args.history:,} Succeeded + {dead:,} DeadLettered rows in {took:.1f} s "
            "(VACUUM ANALYZE included)"
        )
        print(f"   table after the fill: {table_state(args.url, full)}")

        if not args.churn_only:

            async def burn(schema: str) -> float:
                return (await kit_burn(args, kit_provider(args, schema, durable=True), args.messages)).rate

            results = await common.interleaved(
                args.rounds, [("empty table", lambda: burn(empty)), ("with history", lambda: burn(full))]
            )
            e, h = common.median(results["empty table"]), common.median(results["with history"])
            print()
            common.print_table(
                ["table", "median msg/s", "per round"],
                [[n, common.median(rs), ", ".join(f"{r:,.0f}" for r in rs)] for n, rs in results.items()],
            )
            ratio = h / e
            verdict = "MET" if ratio >= TARGET else f"NOT MET (gap {TARGET - ratio:.2f})"
            print(
                f"ratio with history / empty: {ratio:.2f} (target >= {TARGET}: {verdict}); "
                f"load {common.load()}"
            )

        rates = await churn(args, full)
        print(
            f"churn: first cycle {rates[0]:,.0f} msg/s, last {rates[-1]:,.0f}, "
            f"median {common.median(rates):,.0f}; "
            f"last / first {rates[-1] / rates[0]:.2f}; load {common.load()}"
        )


if __name__ == "__main__":
    common.run(main)
