"""enqueue_many throughput on PostgreSQL: 10 calls of 1,000 vs one call of 10,000, interleaved.

Each run gets a fresh schema and an opened runtime (no worker). The message objects are built before
the clock starts; the clock covers the enqueue_many calls only (envelopes, rows, INSERT, NOTIFY, commit).

Usage: .venv/bin/python bench/enqueue_many.py [--messages 10000] [--batch 1000] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import common
from psycopg import sql

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

TARGET = 10_000  # messages/s (issue 3)


@queue("bench_noop")
class Noop(QueueMessage):
    n: int


@dataclass
class Enqueued:
    messages: int
    elapsed: float

    @property
    def rate(self) -> float:
        return self.messages / self.elapsed

    def __str__(self) -> str:
        return f"{self.rate:8,.0f} msg/s  ({self.elapsed * 1000:.0f} ms)"


async def enqueue(url: str, messages: int, batch: int) -> Enqueued:
    with common.throwaway_schema(url, "bench_enq") as schema:
        app = QueueingApp("bench")
        app.message(Noop)
        rt = Runtime(app, SqlProvider(url, schema=schema, listen=False))
        await rt.open()
        try:
            chunks = [
                [Noop(n=j) for j in range(i, min(i + batch, messages))] for i in range(0, messages, batch)
            ]
            started = common.now()
            for chunk in chunks:
                await app.enqueue_many(chunk)
            elapsed = common.now() - started
        finally:
            await rt.close()
        stored = common.scalar(
            url, sql.SQL("SELECT count(*) FROM {}.queueing_messages").format(sql.Identifier(schema))
        )
        assert stored == messages, f"{stored} rows stored, {messages} enqueued"
        return Enqueued(messages, elapsed)


class Options:
    url: str
    rounds: int
    messages: int
    batch: int


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=1_000)
    args = p.parse_args(namespace=Options())
    logging.basicConfig(level=logging.WARNING)
    common.header("enqueue_many on PostgreSQL", args)
    contenders: list[tuple[str, Callable[[], Awaitable[Enqueued]]]] = [
        (f"batches of {args.batch:,}", lambda: enqueue(args.url, args.messages, args.batch)),
        (f"one call of {args.messages:,}", lambda: enqueue(args.url, args.messages, args.messages)),
    ]
    results = await common.interleaved(args.rounds, contenders)
    rows = []
    medians = {}
    for name, rs in results.items():
        medians[name] = m = common.median([r.rate for r in rs])
        verdict = "MET" if m >= TARGET else f"NOT MET ({m / TARGET:.0%} of target)"
        rows.append([name, m, ", ".join(f"{r.rate:,.0f}" for r in rs), f">= {TARGET:,}", verdict])
    print()
    common.print_table(["shape", "median msg/s", "per round", "target", "verdict"], rows)
    a, b = medians.values()
    print(f"ratio batches/single call: {a / b:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
