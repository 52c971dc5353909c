"""Burn-down of pre-enqueued no-op messages on SQLite (a fresh temp file per round).

Same worker shape as bench/sql_burndown.py: 10 handlers at once, up to 20 claimed, claims of up to
10 rows (max_concurrency=10, prefetch=2, batch_size=10, poll_min 0.01 s, poll_max 0.1 s). The clock
runs from the worker's start to the moment the N-th handler has run; enqueue time is excluded.

Usage: .venv/bin/python bench/sqlite_burndown.py [--messages 20000] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import tempfile
from pathlib import Path

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

TARGET = 2_000  # messages/s (issue 3)


@queue("bench_noop")
class Noop(QueueMessage):
    n: int


class Options:
    rounds: int
    messages: int
    concurrency: int
    batch: int
    in_hand: int
    timeout: float


async def one_round(args: Options) -> float:
    with tempfile.TemporaryDirectory(prefix="bench_sqlite_") as tmp:
        path = Path(tmp) / "queue.db"
        app = QueueingApp("bench")
        done = common.Done(args.messages)

        @app.handler(Noop, max_concurrency=args.concurrency)
        async def handle(msg: Noop) -> None:
            done.hit()

        rt = Runtime(app, SqlProvider(f"sqlite:///{path}"))
        await rt.open()
        try:
            for i in range(0, args.messages, 1000):
                await app.enqueue_many([Noop(n=j) for j in range(i, min(i + 1000, args.messages))])
            worker = Worker(
                rt,
                poll_min=0.01,
                poll_max=0.1,
                prefetch=args.in_hand // args.concurrency,
                batch_size=args.batch,
            )
            started = common.now()
            await worker.start()
            await done.wait(args.timeout)
            assert done.last_at is not None
            elapsed = done.last_at - started
            await worker.shutdown()
        finally:
            await rt.close()
        with sqlite3.connect(path) as conn:
            (kept,) = conn.execute(
                "SELECT count(*) FROM queueing_messages WHERE status = 'Succeeded'"
            ).fetchone()
        assert kept == args.messages, f"{kept} of {args.messages} rows Succeeded after shutdown"
        rate = args.messages / elapsed
        print(f"  round: {rate:8,.0f} msg/s  ({elapsed:.2f} s)", flush=True)
        return rate


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3, postgres=False)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--in-hand", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(namespace=Options())
    logging.basicConfig(level=logging.WARNING)
    common.header("SQLite burn-down (kit)", args)
    rates = [await one_round(args) for _ in range(args.rounds)]
    m = common.median(rates)
    verdict = "MET" if m >= TARGET else f"NOT MET ({m / TARGET:.0%} of target, {TARGET - m:,.0f} msg/s short)"
    print()
    common.print_table(
        ["backend", "median msg/s", "per round", "target", "verdict"],
        [["SQLite file", m, ", ".join(f"{r:,.0f}" for r in rates), f">= {TARGET:,}", verdict]],
    )


if __name__ == "__main__":
    asyncio.run(main())
