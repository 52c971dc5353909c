"""Enqueue -> handler-start latency on PostgreSQL at a steady rate, producer in a separate process.

This process runs the worker; a child process (this script with --role producer) enqueues one message
per tick on a fixed schedule (100/s for 20 s by default), stamping each with the wall clock just before
its ``enqueue`` call. The handler subtracts that stamp from the wall clock at its start, so a latency
covers the producer's INSERT + NOTIFY + commit, the wake-up, the claim and the dispatch. Separate
processes keep the producer's work off the worker's event loop and make NOTIFY the only wake-up path
(the in-process shortcut of the provider cannot fire). The worker uses its default polling
(poll_min 0.05 s, poll_max 2 s) unless told otherwise, so an idle worker waits on LISTEN/NOTIFY.

The worker claims durably (the default) unless --relaxed-claims. Targets: p50 <= 5 ms, p99 <= 25 ms.

Usage: .venv/bin/python bench/latency.py [--quick] [--relaxed-claims] [--rate 100] [--seconds 20] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

TARGET_P50_MS = 5.0
TARGET_P99_MS = 25.0


@queue("bench_latency")
class Stamp(QueueMessage):
    i: int
    sent: float  # time.time() just before enqueue: wall clock, comparable across processes


class Options:
    url: str
    rounds: int
    rate: float
    seconds: float
    concurrency: int
    poll_min: float
    poll_max: float
    quick: bool
    relaxed_claims: bool
    role: str
    schema: str


async def produce(args: Options) -> None:
    app = QueueingApp("bench")
    app.message(Stamp)
    rt = Runtime(app, SqlProvider(args.url, schema=args.schema, listen=False))
    await rt.open()
    await app.enqueue_many([])  # warm the pool and the statement path before the clock starts
    count = int(args.rate * args.seconds)
    calls: list[float] = []
    committed: list[float] = []  # wall clock when each enqueue call returned
    late: list[float] = []
    start = common.now() + 0.2
    for i in range(count):
        due = start + i / args.rate
        delay = due - common.now()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            late.append(-delay)
        t0 = common.now()
        await app.enqueue(Stamp(i=i, sent=time.time()))
        committed.append(time.time())
        calls.append(common.now() - t0)
    span = common.now() - start
    await rt.close()
    calls.sort()
    print(
        json.dumps(
            {
                "sent": count,
                "rate": count / span,
                "enqueue_p50_ms": common.percentile(calls, 50) * 1000,
                "enqueue_p99_ms": common.percentile(calls, 99) * 1000,
                "behind_schedule": len(late),
                "committed": committed,
            }
        )
    )


async def one_round(args: Options) -> dict[str, float]:
    with common.throwaway_schema(args.url, "bench_lat") as schema:
        app = QueueingApp("bench")
        count = int(args.rate * args.seconds)
        latencies: list[float] = []
        started: dict[int, float] = {}
        done = asyncio.Event()

        @app.handler(Stamp, max_concurrency=args.concurrency)
        async def handle(msg: Stamp) -> None:
            started[msg.i] = at = time.time()
            latencies.append(at - msg.sent)
            if len(latencies) == count:
                done.set()

        rt = Runtime(app, SqlProvider(args.url, schema=schema, durable_claims=not args.relaxed_claims))
        await rt.open()
        worker = Worker(rt, poll_min=args.poll_min, poll_max=args.poll_max)
        await worker.start()
        try:
            producer = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                *("--role", "producer", "--schema", schema, "--url", args.url),
                *("--rate", str(args.rate), "--seconds", str(args.seconds)),
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await producer.communicate()
            if producer.returncode != 0:
                raise RuntimeError(f"producer failed with exit code {producer.returncode}")
            await asyncio.wait_for(done.wait(), 30)
        finally:
            await worker.shutdown()
            await rt.close()
        produced = json.loads(out.decode().strip().splitlines()[-1])
        ms = sorted(x * 1000 for x in latencies)
        # the share after the producer's commit returned: wake-up, claim, dispatch
        after = sorted((started[i] - c) * 1000 for i, c in enumerate(produced["committed"]))
        result = {
            "p50": common.percentile(ms, 50),
            "p90": common.percentile(ms, 90),
            "p99": common.percentile(ms, 99),
            "max": ms[-1],
            "rate": produced["rate"],
            "enqueue_p50": produced["enqueue_p50_ms"],
            "enqueue_p99": produced["enqueue_p99_ms"],
            "behind": produced["behind_schedule"],
            "after_commit_p50": common.percentile(after, 50),
            "after_commit_p99": common.percentile(after, 99),
        }
        print(
            f"  round: p50 {result['p50']:.1f} ms, p90 {result['p90']:.1f}, p99 {result['p99']:.1f}, "
            f"max {result['max']:.1f}; producer {result['rate']:.1f}/s, enqueue call p50 "
            f"{result['enqueue_p50']:.1f} ms, p99 {result['enqueue_p99']:.1f} ms; after the commit returned "
            f"p50 {result['after_commit_p50']:.1f} ms, p99 {result['after_commit_p99']:.1f} ms",
            flush=True,
        )
        return result


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=3)
    p.add_argument("--rate", type=float, default=100.0, help="messages per second")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--poll-min", type=float, default=0.05, help="the Worker's default")
    p.add_argument("--poll-max", type=float, default=2.0, help="the Worker's default")
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 s, 1 round")
    p.add_argument(
        "--relaxed-claims", action="store_true", help="the worker claims with synchronous_commit=off"
    )
    p.add_argument("--role", choices=["worker", "producer"], default="worker", help=argparse_hidden())
    p.add_argument("--schema", default="", help=argparse_hidden())
    args = p.parse_args(namespace=Options())
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.seconds, args.rounds = 5.0, 1
    if args.role == "producer":
        await produce(args)
        return
    common.header("enqueue -> handler-start latency on PostgreSQL (separate producer process)", args)
    rounds = []
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds}: load average {common.load()}", flush=True)
        rounds.append(await one_round(args))
    med = {k: common.median([r[k] for r in rounds]) for k in rounds[0]}
    print()
    rows = [
        ["p50", med["p50"], f"<= {TARGET_P50_MS:.0f}", verdict(med["p50"], TARGET_P50_MS)],
        ["p90", med["p90"], "", ""],
        ["p99", med["p99"], f"<= {TARGET_P99_MS:.0f}", verdict(med["p99"], TARGET_P99_MS)],
        ["max", med["max"], "", ""],
    ]
    common.print_table(["latency (median of rounds)", "ms", "target ms", "verdict"], rows)
    print(
        f"producer: {med['rate']:.1f} msg/s achieved; its enqueue call took p50 {med['enqueue_p50']:.1f} ms, "
        f"p99 {med['enqueue_p99']:.1f} ms (included in the latencies above)"
    )
    print(
        f"from the producer's commit returning to handler start: p50 {med['after_commit_p50']:.1f} ms, "
        f"p99 {med['after_commit_p99']:.1f} ms (wake-up + claim + dispatch)"
    )


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def verdict(value: float, target: float) -> str:
    return "MET" if value <= target else f"NOT MET (+{value - target:.1f} ms)"


if __name__ == "__main__":
    common.run(main)
