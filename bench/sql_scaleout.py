"""Scale-out on one PostgreSQL: the kit's burn-down with 1, 2 and 4 worker processes.

Each run enqueues N no-ops into a fresh schema, starts P worker processes (each one worker of
bench/sql_burndown.py's shape: 10 handlers, claims of 10, 20 in hand, durable claims, 3 connections
with LISTEN), waits until all of them are connected, then tells them to start together. The clock runs
from that moment until the trigger-kept counters say N rows are Succeeded (polled every 10 ms).
Runs are interleaved (1, 2, 4, then rotated) and medians reported, with the load average. With
``--receives 1,2,auto`` each process count runs once with one claim in flight per worker, once with two
and once deciding as it runs (``QUEUEING_RECEIVES_IN_FLIGHT``: 1, 2, auto), interleaved too.

Usage: .venv/bin/python bench/sql_scaleout.py [--quick] [--messages 20000] [--rounds 3] [--procs 1,2,4]
           [--receives 1,2,auto]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

import common
import psycopg
from psycopg import sql
from sql_burndown import Noop, Options, kit_provider

from queueing_core import QueueingApp
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker


class ScaleOptions(Options):
    procs: str
    receives: str
    role: str
    schema: str


async def worker_process(args: ScaleOptions) -> None:
    """One worker: connect, say ready, start on the first line of stdin, stop when stdin closes."""
    app = QueueingApp("bench")

    @app.handler(Noop, max_concurrency=args.concurrency)
    async def handle(msg: Noop) -> None:
        return None

    rt = Runtime(app, kit_provider(args, args.schema, durable=True))
    await rt.open()
    worker = Worker(
        rt,
        poll_min=0.01,
        poll_max=0.1,
        prefetch=args.in_hand // args.concurrency,
        batch_size=args.batch,
        receives_in_flight="auto" if args.receives == "auto" else int(args.receives),
    )
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    await worker.start()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await worker.shutdown()
    await rt.close()


def succeeded(conn: psycopg.Connection[tuple[object, ...]], schema: str) -> int:
    row = conn.execute(
        sql.SQL("SELECT coalesce(sum(n), 0) FROM {} WHERE status = 'Succeeded'").format(
            sql.Identifier(schema, "queueing_counts")
        )
    ).fetchone()
    return int(row[0]) if row else 0


async def run(args: ScaleOptions, procs: int, receives: str = "auto") -> float:
    with common.throwaway_schema(args.url, "bench_scale") as schema:
        app = QueueingApp("bench")
        app.message(Noop)
        rt = Runtime(app, kit_provider(args, schema, durable=True))
        await rt.open()
        await common.enqueue_range(app, lambda j: Noop(n=j), args.messages)
        await rt.close()
        common.analyze(args.url, sql.Identifier(schema, "queueing_messages"))
        cmd = [sys.executable, __file__, "--role", "worker", "--schema", schema, "--url", args.url]
        cmd += ["--connections", str(args.connections), "--batch", str(args.batch)]
        cmd += ["--concurrency", str(args.concurrency), "--in-hand", str(args.in_hand)]
        cmd += ["--receives", receives, "--loop", args.loop]
        children = [
            await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            for _ in range(procs)
        ]
        try:
            for c in children:
                assert c.stdout is not None
                line = await asyncio.wait_for(c.stdout.readline(), 120)
                assert line.strip() == b"ready", line
            with psycopg.connect(common.libpq_conninfo(args.url), autocommit=True) as conn:
                started = common.now()
                for c in children:
                    assert c.stdin is not None
                    c.stdin.write(b"go\n")
                    await c.stdin.drain()
                deadline = time.monotonic() + args.timeout
                while succeeded(conn, schema) < args.messages:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{succeeded(conn, schema)} of {args.messages} after {args.timeout}s"
                        )
                    await asyncio.sleep(0.01)
                elapsed = common.now() - started
        finally:
            for c in children:
                assert c.stdin is not None
                c.stdin.close()
            for c in children:
                await asyncio.wait_for(c.wait(), 60)
        return args.messages / elapsed


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2,000 messages, 1 round")
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--connections", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--in-hand", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--schema", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--receives", default="auto", help="claims in flight per worker, comma-separated (1, 2 or auto)"
    )
    args = p.parse_args(namespace=ScaleOptions())
    logging.basicConfig(level=logging.WARNING)
    if args.role == "worker":
        await worker_process(args)
        return
    if args.quick:
        args.messages, args.rounds = 2_000, 1
    common.header("SQL scale-out: 1, 2, 4 worker processes on one PostgreSQL (kit, durable claims)", args)
    counts = [int(x) for x in args.procs.split(",")]
    receives = [x.strip() for x in args.receives.split(",")]

    def name(n: int, r: str) -> str:
        procs = f"{n} process{'es' if n > 1 else ''}"
        return procs if len(receives) == 1 else f"{procs}, {r} claim{'' if r == '1' else 's'} in flight"

    results = await common.interleaved(
        args.rounds,
        [(name(n, r), lambda n=n, r=r: run(args, n, r)) for r in receives for n in counts],
    )
    base = common.median(next(iter(results.values())))
    print()
    common.print_table(
        ["workers", "median msg/s", "per round", "vs first"],
        [
            [name, common.median(rs), ", ".join(f"{r:,.0f}" for r in rs), f"{common.median(rs) / base:.2f}x"]
            for name, rs in results.items()
        ],
    )
    print(f"load average at the end: {common.load()} on {os.cpu_count()} cores")


if __name__ == "__main__":
    common.run(main)
