"""What one tick of the SQL transport's Functions processor does: the timer function the Functions
adapter registers (``queueing_sql_processor``), called as the host calls it, on PostgreSQL.

A timer runs on one instance at a time, so this is the transport's whole capacity on Functions:
messages per tick and per second of a tick, and how long a message sent while idle waits (until the
next tick: the schedule's interval at worst, half of it on average, before any cold start).

    .venv/bin/python bench/functions_sql.py --messages 2000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_PG_URL, now, unique_name


async def run(messages: int, url: str, budget: float) -> dict[str, float]:
    from azure.functions.timer import TimerRequest

    from functions import build_app
    from functions.host import FunctionsHost
    from queueing_core import QueueingApp, QueueMessage, queue
    from queueing_core.settings import QueueingSettings

    @queue("bench-fn-sql")
    class Tick(QueueMessage):
        n: int

    app = QueueingApp("bench-fn-sql")
    done: list[int] = []

    @app.handler()
    async def handle(msg: Tick) -> None:
        done.append(msg.n)

    schema = unique_name("bench_fn_sql")
    cfg = QueueingSettings(
        provider="sql", database_url=url, database_schema=schema, functions_processor_budget=budget
    )
    host = FunctionsHost(app, cfg)
    [tick] = [
        f
        for f in build_app(cfg, app, host=host, env={}).get_functions()
        if f.get_function_name() == "queueing_sql_processor"
    ]
    processor = tick.get_user_function()
    rt = await host.runtime()
    try:
        await app.enqueue_many([Tick(n=i) for i in range(messages)])
        started = now()
        await processor(TimerRequest(past_due=False))
        elapsed = now() - started
    finally:
        import sqlalchemy as sa

        async with rt.provider.engine.begin() as conn:  # type: ignore[attr-defined]
            await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        await host.close()
    interval = 15.0  # the default schedule, */15 seconds
    return {
        "messages": messages,
        "processed_in_one_tick": len(done),
        "tick_seconds": elapsed,
        "msg_per_s": len(done) / elapsed if elapsed else float("nan"),
        "idle_wait_worst_s": interval,
        "idle_wait_mean_s": interval / 2,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=50.0, help="QUEUEING_FUNCTIONS_PROCESSOR_BUDGET")
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", DEFAULT_PG_URL))
    args = parser.parse_args()
    result = asyncio.run(run(args.messages, args.url, args.budget))
    print(
        f"one tick processed {result['processed_in_one_tick']}/{result['messages']} messages in "
        f"{result['tick_seconds']:.2f} s ({result['msg_per_s']:.0f} msg/s, one instance); a message sent "
        f"while idle waits up to {result['idle_wait_worst_s']:.0f} s for the next tick "
        f"({result['idle_wait_mean_s']:.1f} s on average), plus any cold start"
    )


if __name__ == "__main__":
    main()
