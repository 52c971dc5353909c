"""Where the PostgreSQL server's CPU per message goes on the kit's hot path: the durable burn-down of
``sql_burndown.py`` (kit (durable claims)) with one part of the schema taken away at a time.

Each variant gets a fresh schema, the same enqueue, ANALYZE, then the change below (after the enqueue,
so only the burn-down sees it), then one worker of the burn-down's shape; ``pg_counters`` reads the CPU
of the run database's backends (from /proc) and the server's row counters around the burn-down.
Variants are interleaved (rotated each round) and the load average is printed with each round.

A variant is a diagnostic, never a configuration: taking an index or a trigger away breaks what it
serves (listings, counts, waiters). The differences say what each part costs per message.

Usage: .venv/bin/python bench/sql_server_breakdown.py [--messages 10000] [--rounds 3]
           [--only base,no_count_triggers]
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import common
import pg_counters
import psycopg
import sql_burndown
from psycopg import sql
from sqlalchemy.engine import make_url

from queueing_core import QueueingApp
from queueing_core.providers.sql.schema import Tables, _count_function_sql
from queueing_core.runtime import Runtime

#: variant -> statements run on the freshly enqueued schema ({m}: the messages table, {s}: the schema),
#: or what builds them from the schema's tables (SQL the kit itself makes)
VARIANTS: dict[str, list[str] | Callable[[Tables], list[str]]] = {
    "base": [],
    "no_count_triggers": [
        "DROP TRIGGER queueing_count_insert ON {m}",
        "DROP TRIGGER queueing_count_update ON {m}",
        "DROP TRIGGER queueing_count_delete ON {m}",
    ],
    # what a cheaper count trigger could save at most: the UPDATE trigger (claims and settlements) kept
    # but doing nothing (its transition tables still captured, its function still called) ...
    "count_update_noop": [
        "CREATE OR REPLACE FUNCTION {s}.queueing_count_changes_update() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
    ],
    # ... that do-nothing function called without transition tables ...
    "count_update_bare_call": [
        "CREATE OR REPLACE FUNCTION {s}.bench_noop() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
        "DROP TRIGGER queueing_count_update ON {m}",
        "CREATE TRIGGER queueing_count_update AFTER UPDATE ON {m} FOR EACH STATEMENT "
        "EXECUTE FUNCTION {s}.bench_noop()",
    ],
    # ... and the changes appended to a table without an index (folded later) instead of upserted
    "count_update_append": [
        "CREATE TABLE {s}.bench_count_log (queue text, status text, archived boolean, n bigint)",
        "CREATE OR REPLACE FUNCTION {s}.queueing_count_changes_update() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN "
        "INSERT INTO {s}.bench_count_log SELECT queue, status, archived, sum(d) FROM ("
        "SELECT queue, status, archived, 1 AS d FROM new_rows UNION ALL "
        "SELECT queue, status, archived, -1 AS d FROM old_rows) AS changes "
        "GROUP BY queue, status, archived HAVING sum(d) <> 0; RETURN NULL; END $$",
    ],
    # result waiters' NOTIFY taken out of the UPDATE counts trigger (migration 14 put it there)
    "no_done_notice": lambda tables: [_count_function_sql(tables, "UPDATE")],
    "-ix_status+queue_status": [
        "DROP INDEX {s}.ix_queueing_messages_status",
        "DROP INDEX {s}.ix_queueing_messages_queue_status",
    ],
    "-ix_created": ["DROP INDEX {s}.ix_queueing_messages_created"],
    "-ix_tracking": ["DROP INDEX {s}.ix_queueing_messages_tracking"],
    "-uq_message_id": ["ALTER TABLE {m} DROP CONSTRAINT queueing_messages_message_id_key"],
    "-ix_leased": ["DROP INDEX {s}.ix_queueing_messages_leased"],
    "-ix_settled": ["DROP INDEX {s}.ix_queueing_messages_settled"],
}


class Options(sql_burndown.Options):
    variants: str


async def burn(args: Options, variant: str) -> sql_burndown.Burn:
    with common.throwaway_schema(args.url, "bench_brk") as schema:
        # the schema made and filled by a first provider; the change; then the burn-down's own provider
        # (up to date, it migrates nothing) with the counters around its worker
        setup = sql_burndown.kit_provider(args, schema, durable=True)
        rt = Runtime(QueueingApp("bench"), setup)
        await rt.open()
        await rt.close()
        m = sql.Identifier(schema, "queueing_messages")
        with psycopg.connect(common.libpq_conninfo(args.url), autocommit=True) as conn:
            steps = VARIANTS[variant]
            if callable(steps):
                for built in steps(Tables.build(schema)):
                    conn.execute(built)
            else:
                for statement in steps:
                    conn.execute(sql.SQL(statement).format(m=m, s=sql.Identifier(schema)))
        provider = sql_burndown.kit_provider(args, schema, durable=True)
        return await sql_burndown.kit_burn(
            args, provider, args.messages, counters=pg_counters.Window(args.url, schema)
        )


async def run(args: Options) -> None:
    names = [v.strip() for v in args.variants.split(",")] if args.variants else list(VARIANTS)
    contenders: list[tuple[str, Callable[[], Awaitable[sql_burndown.Burn]]]] = [
        (name, (lambda n=name: burn(args, n))) for name in names
    ]
    results = await common.interleaved(args.rounds, contenders)
    base = results.get("base")
    rows = []
    for name, burns in results.items():
        per = [b.server for b in burns if b.server is not None]
        cpu = [p["server_cpu"] for p in per]
        med = common.median(cpu)
        delta = med - common.median([b.server["server_cpu"] for b in base if b.server]) if base else 0.0
        rows.append(
            [
                name,
                f"{common.median([b.rate for b in burns]):,.0f}",
                f"{med:.1f}",
                f"{delta:+.1f}",
                ", ".join(f"{c:.0f}" for c in cpu),
                f"{common.median([p['client_cpu'] for p in per]):.0f}",
                f"{common.median([p['upd'] for p in per]):.2f}",
                f"{common.median([p['hot_upd'] / p['upd'] if p['upd'] else 0 for p in per]):.0%}",
                f"{common.median([p['wal_bytes'] for p in per]):,.0f}",
            ]
        )
    print()
    common.print_table(
        [
            "variant",
            "msg/s",
            "backend µs/msg",
            "vs base",
            "per round",
            "worker µs/msg",
            "upd/msg",
            "HOT",
            "WAL B/msg",
        ],
        rows,
    )


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--variants", default="", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--connections", type=int, default=3)
    args = p.parse_args(namespace=Options())
    # the burn-down's shape (sql_burndown's defaults)
    args.concurrency, args.batch, args.in_hand, args.timeout = 10, 10, 20, 600
    args.cpu, args.server_counters = False, True
    logging.basicConfig(level=logging.WARNING)
    common.header("Server CPU per message of the durable kit, one part taken away at a time", args)
    # backend CPU is read for the run's own database
    with common.throwaway_database(args.url, "bench_brk") as db:
        args.url = make_url(args.url).set(database=db).render_as_string(hide_password=False)
        await run(args)


if __name__ == "__main__":
    asyncio.run(main())
