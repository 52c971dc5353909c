"""What it costs that SQLite never gives a message's row id twice (AUTOINCREMENT, schema migration 12).

1. Enqueue: rows inserted per second into the kit's messages table with and without AUTOINCREMENT,
   same DDL otherwise, interleaved rounds, CPU and wall time per row (batches of 100 rows a
   transaction, WAL, synchronous=NORMAL: the kit's settings).
2. Upgrade: how long migration 12 takes to make an older table (no AUTOINCREMENT) again, rows and ids
   kept, on ``--rows`` rows of history.

    .venv/bin/python bench/sqlite_row_ids.py --rounds 3 --rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.schema import CreateIndex, CreateTable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from queueing_core import QueueingApp
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.schema import MIGRATIONS, SQLITE_UNUSED_INDEXES, build_metadata, migrate

COLUMNS = (
    "message_id, tracking_id, queue, type, status, attempt, created_at, updated_at, available_at, "
    "headers, body, lease_token, archived, awaited"
)


def ddl(autoincrement: bool) -> list[str]:
    m = build_metadata().tables["queueing_messages"]
    m.dialect_options["sqlite"]["autoincrement"] = autoincrement
    dialect = sa.dialects.sqlite.dialect()  # type: ignore[attr-defined]
    out = [str(CreateTable(m).compile(dialect=dialect))]
    out += [
        str(CreateIndex(i).compile(dialect=dialect)) for i in m.indexes if i.name not in SQLITE_UNUSED_INDEXES
    ]
    return out


def inserts(autoincrement: bool, rows: int, batch: int = 100) -> tuple[float, float]:
    """CPU and wall microseconds per row."""
    with tempfile.TemporaryDirectory() as d:
        c = sqlite3.connect(f"{d}/x.db", isolation_level=None)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=NORMAL")
        for s in ddl(autoincrement):
            c.execute(s)
        sql = f"INSERT INTO queueing_messages ({COLUMNS}) VALUES ({', '.join('?' * 14)})"
        at = "2026-11-28 12:00:00.000000"
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(0, rows, batch):
            values = [
                (
                    uuid.uuid4().hex,
                    uuid.uuid4().hex,
                    "q",
                    "Job",
                    "Pending",
                    0,
                    at,
                    at,
                    at,
                    "{}",
                    '{"n": 1}',
                    0,
                    0,
                    0,
                )
                for _ in range(batch)
            ]
            c.execute("BEGIN IMMEDIATE")
            c.executemany(sql, values)
            c.execute("COMMIT")
        out = (time.process_time() - cpu) / rows * 1e6, (time.perf_counter() - wall) / rows * 1e6
        c.close()
    return out


async def upgrade(rows: int) -> tuple[float, float]:
    """Seconds (wall, CPU) migration 12 takes on ``rows`` rows of an older table."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tests.integration.history_rows as history
    from tests.integration.older_schema import without_autoincrement

    history.ROWS = rows
    version = next(n for n, text, _ in MIGRATIONS if "AUTOINCREMENT" in text)
    with tempfile.TemporaryDirectory() as d:
        prov = SqlProvider(f"sqlite:///{d}/big.db", listen=False)
        await prov.open(QueueingApp("bench"))
        await history.fill(prov, ("a", "b", "c"))
        m = prov.tables.messages

        def make_old(sync: Any) -> None:
            without_autoincrement(sync, m.name)
            sync.exec_driver_sql(f"DELETE FROM queueing_schema WHERE version = {version}")

        async with prov.engine.begin() as conn:
            await conn.run_sync(make_old)
        wall, cpu = time.perf_counter(), time.process_time()
        assert await migrate(prov.engine, prov.tables, now=prov.clock) == [version]
        out = time.perf_counter() - wall, time.process_time() - cpu
        await prov.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inserts", type=int, default=100_000, help="rows inserted per contender and round")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of history for the upgrade (0: skip)")
    args = p.parse_args()
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for r in range(args.rounds):
        for auto in (False, True):
            cpu, wall = inserts(auto, args.inserts)
            results[auto].append((cpu, wall))
            print(
                f"round {r + 1}, load {os.getloadavg()[0]:.1f}: AUTOINCREMENT={auto}: "
                f"{cpu:.1f} us CPU, {wall:.1f} us wall per row",
                flush=True,
            )
    med = {a: sorted(c for c, _ in v)[len(v) // 2] for a, v in results.items()}
    print(
        f"median CPU per row: without {med[False]:.1f} us, with {med[True]:.1f} us: "
        f"ratio {med[True] / med[False]:.2f}"
    )
    if args.rows:
        wall, cpu = asyncio.run(upgrade(args.rows))
        print(
            f"migration 12 on {args.rows:,} rows: {wall:.1f} s wall, {cpu:.1f} s CPU "
            f"(load {os.getloadavg()[0]:.1f})"
        )


if __name__ == "__main__":
    main()
