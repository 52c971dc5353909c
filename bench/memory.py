"""Worker memory on PostgreSQL: RSS after 10,000 and after 100,000 handled no-op messages.

This process is the worker only (10 handlers, prefetch 2, batch 10, poll 0.01-0.1 s). A child process
(this script with --role feeder) enqueues in batches of 1,000 and tops the queue up by 10,000 whenever
fewer than 10,000 are unfinished, so the table never holds more than 20,000 pending and the feeder's
own allocations never count towards the worker's RSS. The handler reads VmRSS from /proc/self/status
at every 10,000th message.

Usage: .venv/bin/python bench/memory.py [--messages 100000]
"""

from __future__ import annotations

import asyncio
import logging
import sys

import common
from psycopg import sql

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

TARGET_RATIO = 1.2  # RSS after 100k / after 10k (issue 3)
TOP_UP = 10_000


@queue("bench_noop")
class Noop(QueueMessage):
    n: int


class Options:
    url: str
    messages: int
    every: int
    role: str
    schema: str


async def feed(args: Options) -> None:
    app = QueueingApp("bench")
    app.message(Noop)
    rt = Runtime(app, SqlProvider(args.url, schema=args.schema, listen=False))
    await rt.open()
    unfinished = sql.SQL(
        "SELECT count(*) FROM {}.queueing_messages WHERE status IN ('Pending', 'Leased')"
    ).format(sql.Identifier(args.schema))
    sent = 0
    while sent < args.messages:
        if sent == 0 or common.scalar(args.url, unfinished) < TOP_UP:
            for _ in range(2 if sent == 0 else 1):  # start with 20k, then 10k at a time
                end = min(sent + TOP_UP, args.messages)
                await common.enqueue_range(app, lambda j: Noop(n=j), end, start=sent)
                sent = end
        else:
            await asyncio.sleep(0.1)
    await rt.close()


async def run_worker(args: Options) -> None:
    with common.throwaway_schema(args.url, "bench_mem") as schema:
        app = QueueingApp("bench")
        samples: list[tuple[str, float]] = [("before the runtime opened", common.rss_mib())]
        done = common.Done(args.messages)

        @app.handler(Noop, max_concurrency=10)
        async def handle(msg: Noop) -> None:
            done.hit()
            if done.count % args.every == 0:
                samples.append((f"{done.count:,}", common.rss_mib()))

        rt = Runtime(app, SqlProvider(args.url, schema=schema))
        await rt.open()
        worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=10)
        await worker.start()
        samples.append(("worker started", common.rss_mib()))
        started = common.now()
        try:
            feeder = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                *("--role", "feeder", "--schema", schema, "--url", args.url),
                *("--messages", str(args.messages)),
            )
            await done.wait(3600)
            await feeder.wait()
        finally:
            await worker.shutdown()
            await rt.close()
        elapsed = common.now() - started
    print()
    common.print_table(["handled", "RSS MiB"], [[n, f"{mib:.1f}"] for n, mib in samples])
    at = dict(samples)
    early, total = min(args.every, args.messages), args.messages
    first, last = at[f"{early:,}"], at[f"{total:,}"]
    ratio = last / first
    verdict = "MET" if ratio <= TARGET_RATIO else f"NOT MET (+{ratio - TARGET_RATIO:.2f})"
    print()
    common.print_table(
        [f"RSS after {early:,} MiB", f"RSS after {total:,} MiB", "ratio", "target", "verdict"],
        [[f"{first:.1f}", f"{last:.1f}", f"{ratio:.3f}", f"<= {TARGET_RATIO}", verdict]],
    )
    rate = args.messages / elapsed
    print(f"({args.messages:,} handled in {elapsed:.0f} s, {rate:,.0f} msg/s with the feeder running)")


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=None)
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--every", type=int, default=10_000, help="sample RSS every N handled")
    p.add_argument("--role", choices=["worker", "feeder"], default="worker", help=argparse_hidden())
    p.add_argument("--schema", default="", help=argparse_hidden())
    args = p.parse_args(namespace=Options())
    logging.basicConfig(level=logging.WARNING)
    if args.role == "feeder":
        await feed(args)
        return
    common.header("worker RSS over 100,000 messages (PostgreSQL, feeder in a separate process)", args)
    await run_worker(args)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    asyncio.run(main())
