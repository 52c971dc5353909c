"""The kit's SQLite burn-down, round after round in one process, with what each round did.

`sqlite_burndown.py` compares contenders; this one looks at why the kit's own rounds differ (on one
machine they ran from 9,000 to 16,000 msg/s with the same code). Each round is the burn-down's kit
round (a new database file, N pre-enqueued no-op jobs, the defaults' claim shape) and prints, beside
its rate and the CPU of the event loop's thread a message:

  claims       how many claims, and how many of them came back full
  settlements  how many batches the settler handed to the provider, and their median size
  in claim / in settle
               CPU of the event loop's thread a message inside the provider's claim and settlement
               calls (what ran while they waited included)
  turns        the event loop's turns a message, and the seconds it waited in ``select``
  gc           collections of each generation during the round

``--linger`` takes several settler lingers (seconds, comma-separated): the rounds alternate between
them and each gets its median, to see whether larger settlement batches change a round's speed.

Usage: .venv/bin/python bench/sqlite_rounds.py [--rounds 20] [--messages 20000] [--linger 0.002,0.01]
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import common
from sqlite_burndown import Noop

from queueing_core import QueueingApp
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

CONCURRENCY, IN_HAND, BATCH = 10, 20, 10  # the burn-down's defaults' shape


class Watch:
    """Counts around the provider's claim and settlement, the loop's selector and the collector."""

    def __init__(self, provider: SqlProvider) -> None:
        self.claims: Counter[bool] = Counter()  # full or not
        self.settlements: list[int] = []
        self.cpu = {"claim": 0.0, "settle": 0.0}
        self.turns, self.waited = 0, 0.0
        self.gcs = [0, 0, 0]
        receive, settle = provider.receive, provider.settle

        async def timed_receive(sub: Any, max_messages: int) -> Any:
            started = time.thread_time()
            try:
                got = await receive(sub, max_messages)
            finally:
                self.cpu["claim"] += time.thread_time() - started
            self.claims[len(got) >= max_messages] += 1
            return got

        async def timed_settle(settlements: Any) -> None:
            self.settlements.append(len(settlements))
            started = time.thread_time()
            try:
                await settle(settlements)
            finally:
                self.cpu["settle"] += time.thread_time() - started

        provider.receive = timed_receive  # type: ignore[method-assign]
        provider.settle = timed_settle  # type: ignore[method-assign]

    def collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.gcs[info["generation"]] += 1

    def selecting(self, loop: asyncio.AbstractEventLoop) -> Any:
        selector: Any = loop._selector  # type: ignore[attr-defined]
        select = selector.select

        def counted(timeout: float | None = None) -> Any:
            started = time.perf_counter()
            try:
                return select(timeout)
            finally:
                self.turns += 1
                self.waited += time.perf_counter() - started

        selector.select = counted
        return lambda: setattr(selector, "select", select)


async def one_round(messages: int, linger: float) -> tuple[float, str]:
    with tempfile.TemporaryDirectory(prefix="bench_rounds_") as tmp:
        app = QueueingApp("bench")
        done = common.Done(messages)

        @app.handler(Noop, max_concurrency=CONCURRENCY)
        async def handle(msg: Noop) -> None:
            done.hit()

        provider = SqlProvider(f"sqlite:///{Path(tmp) / 'queue.db'}")
        rt = Runtime(app, provider)
        await rt.open()
        try:
            await common.enqueue_range(app, lambda j: Noop(n=j), messages)
            watch = Watch(provider)
            worker = Worker(
                rt,
                poll_min=0.01,
                poll_max=0.1,
                prefetch=IN_HAND // CONCURRENCY,
                batch_size=BATCH,
                settle_linger=linger,
            )
            gc.callbacks.append(watch.collected)
            unselect = watch.selecting(asyncio.get_running_loop())
            cpu = time.thread_time()
            started = common.now()
            await worker.start()
            try:
                await done.wait(600)
            finally:
                await worker.shutdown()
                cpu = time.thread_time() - cpu
                unselect()
                gc.callbacks.remove(watch.collected)
        finally:
            await rt.close()
        assert done.last_at is not None
        rate = messages / (done.last_at - started)
        per = 1e6 / messages
        s = watch.settlements
        line = (
            f"{rate:8,.0f} msg/s  {cpu * per:5.1f} µs  claims {sum(watch.claims.values())} "
            f"({watch.claims[True]} full)  settlements {len(s)} (median {statistics.median(s):.0f})  "
            f"in claim {watch.cpu['claim'] * per:4.1f} µs  in settle {watch.cpu['settle'] * per:4.1f} µs  "
            f"turns {watch.turns / messages:.2f}/msg  select {watch.waited:.2f} s  gc {watch.gcs}"
        )
        return rate, line


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=20, postgres=False)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--linger", default="0.002", help="settler lingers to alternate, comma-separated")
    args = p.parse_args()
    lingers = [float(x) for x in args.linger.split(",")]
    common.header("The kit's SQLite rounds, one process, what each did", args)
    rates: dict[float, list[float]] = {linger: [] for linger in lingers}
    for r in range(args.rounds):
        for linger in lingers:
            rate, line = await one_round(args.messages, linger)
            rates[linger].append(rate)
            print(f"  round {r + 1}/{args.rounds}  linger {linger:g}  {line}", flush=True)
    print()
    for linger, rs in rates.items():
        spread = f"{min(rs):,.0f} to {max(rs):,.0f}"
        print(f"linger {linger:g}: median {common.median(rs):,.0f} msg/s over {len(rs)} rounds ({spread})")
    print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    common.run(main)
