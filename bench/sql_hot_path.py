"""The SQL hot path alone: the worker process's CPU per message for claim + settle cycles.

A throughput figure on a shared 2-core machine mostly measures the other sessions; the CPU time this
process spends per message does not depend on them much. One provider claims batches of ``--batch``
rows and settles each batch as succeeded (plus, with ``--mixed``, every tenth as a retry), with no
handler in between, until ``--messages`` rows are done. With ``--combined`` each batch is settled
together with the claim of the next (``settle_and_receive``: one round trip, one commit), as the worker
does with durable claims. Printed per round: process CPU µs per message, wall µs per message, and the
load average. PostgreSQL by default; ``--sqlite`` runs the same on a SQLite file (a new one per
round, in the temp directory), where the process CPU includes aiosqlite's thread.

Usage: .venv/bin/python bench/sql_hot_path.py [--messages 10000] [--batch 10] [--rounds 3] [--mixed]
           [--combined] [--sqlite]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("bench_hot")
class Hot(QueueMessage):
    n: int


async def one_round(args: argparse.Namespace, schema: str | None, url: str) -> tuple[float, float]:
    a = QueueingApp("bench")

    @a.handler()
    async def handle(msg: Hot) -> None:
        return None

    prov = SqlProvider(
        url, schema=schema, listen=False, pool_size=2, max_overflow=0, settle_with_claims=args.combined
    )
    rt = Runtime(a, prov)
    await rt.open()
    try:
        n = args.messages
        await common.enqueue_range(a, lambda j: Hot(n=j), n)
        sub = a.subscription("Hot")
        done = 0
        cpu, wall = time.process_time(), time.perf_counter()
        got = await prov.receive(sub, args.batch)
        while done < n:
            if not got:
                break
            out = []
            for i, d in enumerate(got):
                retry = args.mixed and i == 0 and d.attempt == 1
                out.append(Settlement(d, RetryAfter(timedelta(0), "again") if retry else Complete()))
            if args.combined:
                got = await prov.settle_and_receive(out, sub, args.batch)
            else:
                await prov.settle(out)
                got = await prov.receive(sub, args.batch)
            done += sum(1 for s in out if isinstance(s.decision, Complete))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await rt.close()
    return cpu / n * 1e6, wall / n * 1e6


async def main() -> None:
    p = common.base_parser((__doc__ or "").splitlines()[0], rounds=3)
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--mixed", action="store_true", help="every batch also has one retry (pipeline)")
    p.add_argument("--combined", action="store_true", help="settle each batch with the next claim")
    p.add_argument("--sqlite", action="store_true", help="a SQLite file instead of PostgreSQL")
    args = p.parse_args()
    database = "SQLite" if args.sqlite else "PostgreSQL"
    common.header(f"SQL hot path: CPU per message, claim + settle ({database})", args)
    cpus, walls = [], []
    for r in range(args.rounds):
        if args.sqlite:
            with tempfile.TemporaryDirectory(prefix="bench_hot_") as tmp:
                cpu, wall = await one_round(args, None, f"sqlite:///{Path(tmp) / 'queue.db'}")
        else:
            with common.throwaway_schema(args.url, "bench_hot") as schema:
                cpu, wall = await one_round(args, schema, args.url)
        cpus.append(cpu)
        walls.append(wall)
        shown = f"cpu {cpu:7.1f} µs/msg  wall {wall:7.1f} µs/msg"
        print(f"  round {r + 1}/{args.rounds}  {shown}  (load {common.load()})", flush=True)
    print(f"median: cpu {common.median(cpus):.1f} µs/msg, wall {common.median(walls):.1f} µs/msg")


if __name__ == "__main__":
    common.run(main)
