"""The worker's per-message path outside the database: CPU per message of the handler tasks and of
decoding claimed rows, on messages claimed beforehand.

What it times, on the event loop's thread (``time.thread_time``), for N no-op messages of one type
claimed from a SQLite file before the clock starts:

  handle   one task per message through ``Worker._handle`` (the runtime, the decision pipeline with
           its hooks and slot, the no-op handler, the settlement handed to a settler that only keeps
           it), in groups of 10 as the consumer starts them; no database call is timed
  decode   ``delivery_from_row`` on the rows of those messages (JSON, the envelope's validation)
  floor    the same number of tasks of an empty coroutine, in groups of 10: asyncio's own share

The same deliveries go through every round (each run completes them again), so the rounds are alike.

Usage: .venv/bin/python bench/worker_path.py [--messages 20000] [--rounds 5]
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.rows import delivery_from_row
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from queueing_core.worker import Worker, _SubState


@queue("bench_path")
class Noop(QueueMessage):
    n: int


class Options:
    rounds: int
    messages: int


class _Keep:
    """A settler that keeps what it is given (nothing is settled: the database is not timed)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, settlement: Settlement) -> None:
        self.count += 1


def _row(d: Delivery) -> dict[str, Any]:
    """The claimed row ``delivery_from_row`` gets for ``d`` from the SQLite hot path: its timestamps
    aware in UTC, its UUIDs as the text SQLite keeps (see ``sqlite_driver.SqliteCompiled``; before
    that, naive times and ``uuid.UUID`` objects, which cost the decoding about 2 µs more)."""
    env = d.envelope
    assert env is not None
    return {
        "id": d.handle.row,
        "lease_token": d.handle.token,
        "locked_until": d.lease_until,
        "attempt": env.attempt,
        "type": env.type,
        "queue": env.queue,
        "message_id": env.message_id.hex,
        "tracking_id": env.tracking_id.hex,
        "correlation_id": env.correlation_id,
        "created_at": env.created_at,
        "not_before": None,
        "expires_at": env.expires_at,
        "headers_text": "{}",
        "body_text": d.raw if isinstance(d.raw, str) else '{"n": 0}',
        "raw": None,
    }


async def _empty() -> None:
    return None


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=5, postgres=False)
    p.add_argument("--messages", type=int, default=20_000)
    args = p.parse_args(namespace=Options())
    logging.basicConfig(level=logging.WARNING)
    common.header("The worker's per-message path outside the database (CPU per message)", args)
    n = args.messages
    with tempfile.TemporaryDirectory(prefix="bench_path_") as tmp:
        app = QueueingApp("bench")
        ran = 0

        @app.handler(Noop, max_concurrency=10)
        async def handle(msg: Noop) -> None:
            nonlocal ran
            ran += 1

        rt = Runtime(app, SqlProvider(f"sqlite:///{Path(tmp) / 'queue.db'}"))
        await rt.open()
        try:
            await common.enqueue_range(app, lambda j: Noop(n=j), n)
            sub = app.subscription(Noop.type_name())
            assert sub is not None
            deliveries: list[Delivery] = []
            while len(deliveries) < n:
                deliveries += await rt.provider.receive(sub, 1000)
            rows = [_row(d) for d in deliveries]
            worker = Worker(rt)
            keep = _Keep()
            worker.settler = keep  # type: ignore[assignment]
            state = _SubState()
            results: dict[str, list[float]] = {"handle": [], "decode": [], "floor": []}
            for r in range(args.rounds):
                started = time.thread_time()
                for i in range(0, n, 10):
                    await asyncio.gather(
                        *[asyncio.create_task(worker._handle(sub, state, d)) for d in deliveries[i : i + 10]]
                    )
                results["handle"].append((time.thread_time() - started) / n * 1e6)
                started = time.thread_time()
                for row in rows:
                    delivery_from_row(row)
                results["decode"].append((time.thread_time() - started) / n * 1e6)
                started = time.thread_time()
                for _ in range(0, n, 10):
                    await asyncio.gather(*[asyncio.create_task(_empty()) for _ in range(10)])
                results["floor"].append((time.thread_time() - started) / n * 1e6)
                shown = ", ".join(f"{k} {v[-1]:.1f} µs" for k, v in results.items())
                print(f"  round {r + 1}/{args.rounds}  {shown}  (load {common.load(1)})", flush=True)
            assert ran == keep.count == n * args.rounds
        finally:
            await rt.close()
    print()
    common.print_table(
        ["part", "median µs per message", "per round"],
        [[k, f"{common.median(v):.1f}", ", ".join(f"{x:.1f}" for x in v)] for k, v in results.items()],
    )
    print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    common.run(main)
