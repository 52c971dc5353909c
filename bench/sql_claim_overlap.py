"""Where a durable claim's time goes with one and with two claims in flight (PostgreSQL).

The kit's burn-down (bench/sql_burndown.py's shape and connection budget, durable claims) with
``receives_in_flight`` 1 and 2 in turn, the provider's ``receive`` timed, and the server's WAL
flushes counted from ``pg_stat_wal`` before and after (the whole server's: other sessions' commits
count too, so read it on a quiet machine or as a rough figure). Per run: the rate, how many claims
started beside another, the claim round trip (p50, p90) and the WAL syncs.

Usage: .venv/bin/python bench/sql_claim_overlap.py [--messages 10000] [--rounds 2] [--connections 3]
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import common
import sql_burndown as sb
from pg_counters import wal_syncs

from queueing_core.providers.sql import SqlProvider


async def run(args: sb.Options, receives: int) -> str:
    seen: dict[str, Any] = {"active": 0, "beside": 0, "claims": [], "taken": []}
    original = SqlProvider.receive

    async def timed(self: SqlProvider, sub: Any, n: int) -> Any:
        seen["active"] += 1
        seen["beside"] += seen["active"] > 1
        started = time.perf_counter()
        try:
            got = await original(self, sub, n)
            seen["taken"].append(len(got))
            return got
        finally:
            seen["claims"].append(time.perf_counter() - started)
            seen["active"] -= 1

    SqlProvider.receive = timed  # type: ignore[method-assign]
    try:
        with common.throwaway_schema(args.url, "bench_kit") as schema:
            provider = sb.kit_provider(args, schema, durable=True)
            before = wal_syncs(args.url)
            burn = await sb.kit_burn(args, provider, args.messages, receives=receives)
            syncs = wal_syncs(args.url) - before
    finally:
        SqlProvider.receive = original  # type: ignore[method-assign]
    claims = sorted(seen["claims"])
    return (
        f"receives_in_flight={receives}  {burn.rate:6,.0f} msg/s  claims {len(claims)}, "
        f"{seen['beside']} beside another; claim ms p50 {claims[len(claims) // 2] * 1000:.2f} "
        f"p90 {claims[int(len(claims) * 0.9)] * 1000:.2f}; mean rows {statistics.mean(seen['taken']):.1f}; "
        f"WAL syncs (whole server, enqueue included) {syncs}; load {common.load(1)}"
    )


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=2)
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--connections", type=int, default=3)
    args = p.parse_args(namespace=sb.Options())
    args.concurrency, args.batch, args.in_hand, args.timeout = 10, 10, 20, 600
    common.header("Durable claims: one or two in flight (PostgreSQL)", args)
    for r in range(args.rounds):
        for receives in (1, 2) if r % 2 == 0 else (2, 1):
            print(f"  round {r + 1}/{args.rounds}  {await run(args, receives)}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
