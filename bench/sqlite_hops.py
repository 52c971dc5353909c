"""Where a SQLite hot-path call's time goes, between the event loop and aiosqlite's thread.

One kit round of the SQLite burn-down (``bench/sqlite_burndown.py``'s ``kit_round``: 10 handlers,
claims of 10, 20 in hand), with every hot-path call (``SqliteDriverPath.run``) timed at its steps:

  pool wait      from the call to the pooled connection in hand (another call holds it)
  to the thread  from the function queued for aiosqlite's thread to its start there: the thread
                 is idle (the pool gives the connection to one call at a time), so this is the
                 wait for the GIL, which the event loop holds while it runs handlers
  in the thread  the function itself: BEGIN IMMEDIATE, the statements, their rows, COMMIT (and,
                 beside it, the thread's CPU time in it: the rest is waiting, for the disk or for
                 the GIL again after each step of ``sqlite3``, which runs without it)
  back          from its end to the awaiting call running again on the event loop
  return        the connection back to the pool

Medians per call and totals per message, by kind of call (claims, settlements). A diagnostic: it
replaces ``SqliteDriverPath.run`` with a copy that takes the times, so it follows that method's steps
and must change with them.

Usage: .venv/bin/python bench/sqlite_hops.py [--messages 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import common
import sqlite_burndown
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from queueing_core.providers.sql import sqlite_driver
from queueing_core.providers.sql.driver import Compiled, Result
from queueing_core.providers.sql.engine import RETURNED_CLEAN

STEPS = [
    ("pool wait", "called", "pooled"),
    ("to the thread", "pooled", "started"),
    ("in the thread", "started", "ended"),
    ("back", "ended", "resumed"),
    ("return", "resumed", "returned"),
]

calls: list[dict[str, Any]] = []


def _timed_round_trip(db: Any, bound: list[tuple[Compiled, dict[str, Any]]], marks: dict[str, Any]) -> Any:
    marks["started"], cpu = time.perf_counter(), time.thread_time()
    try:
        return sqlite_driver._round_trip(db, bound)
    finally:
        marks["ended"], marks["cpu"] = time.perf_counter(), time.thread_time() - cpu


async def timed_run(
    self: Any, engine: AsyncEngine, action: str, work: Sequence[tuple[Compiled, Mapping[str, Any]]]
) -> list[Result]:
    marks: dict[str, Any] = {"action": action, "called": time.perf_counter()}
    bound = [(stmt, stmt.params(values)) for stmt, values in work]
    pooled = await greenlet_spawn(engine.sync_engine.pool.connect)
    marks["pooled"] = time.perf_counter()
    try:
        aio = pooled.driver_connection
        results: list[Result] = await aio._execute(_timed_round_trip, aio._conn, bound, marks)
        marks["resumed"] = time.perf_counter()
        return results
    finally:
        pooled.info[RETURNED_CLEAN] = True
        await greenlet_spawn(pooled.close)
        marks["returned"] = time.perf_counter()
        calls.append(marks)


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=10_000)
    args = p.parse_args()
    opts = sqlite_burndown.Options()
    opts.messages, opts.concurrency, opts.batch, opts.in_hand = args.messages, 10, 10, 20
    opts.timeout, opts.dir, opts.cpu = 600.0, "", True  # (no --dir: the temp dir)
    logging.basicConfig(level=logging.WARNING)
    print(f"load average at start: {common.load()}")
    sqlite_driver.SqliteDriverPath.run = timed_run  # type: ignore[method-assign]
    burn_down = common.kit_burn_down

    async def timed(*a: Any, **kw: Any) -> float:
        calls.clear()  # the enqueue before the clock starts is not counted
        return await burn_down(*a, **kw)

    common.kit_burn_down = timed
    rate = await sqlite_burndown.kit_round(opts)
    print(f"kit {rate:,.0f} msg/s  (load {common.load(1)})")
    for action in sorted({c["action"] for c in calls}):
        mine = [c for c in calls if c["action"] == action]
        print(f"{action}: {len(mine)} calls")
        for name, start, end in STEPS:
            spans = [(c[end] - c[start]) * 1e6 for c in mine]
            print(
                f"  {name:<14} median {statistics.median(spans):7.0f} µs a call, "
                f"{sum(spans) / args.messages:6.1f} µs a message in all"
            )
        cpu = [c["cpu"] * 1e6 for c in mine]
        print(
            f"  {'(its CPU)':<14} median {statistics.median(cpu):7.0f} µs a call, "
            f"{sum(cpu) / args.messages:6.1f} µs a message in all"
        )


if __name__ == "__main__":
    asyncio.run(main())
