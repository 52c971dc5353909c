"""Ops API latency on a large PostgreSQL table: GET stats and the first page of dead letters.

    .venv/bin/python bench/ops_api.py [--rows 1000000] [--requests 200]

Fills a fresh schema with N messages (85% Succeeded, 10% DeadLettered, 3% Failed, 2% Pending over
5 queues and 30 days) by INSERT ... SELECT generate_series, then times requests through the real
FastAPI app (in-process ASGI transport, so no network in the figures). Target: p50 <= 50 ms each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import httpx
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

URL = "postgresql://postgres@127.0.0.1:5432/test"
KEY = "bench-key"


def make_app() -> QueueingApp:
    app = QueueingApp("bench-ops")
    for i in range(5):
        mtype = type(f"Job{i}", (QueueMessage,), {"__annotations__": {"n": int}})
        app.message(queue(f"q{i}")(mtype))
    return app


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def main(rows: int, requests: int) -> None:
    schema = f"bench_ops_{uuid.uuid4().hex[:6]}"
    app = make_app()
    provider = SqlProvider(URL, schema=schema)
    rt = Runtime(app, provider)
    await rt.open()
    m = provider.tables.messages
    t0 = time.perf_counter()
    async with provider.engine.begin() as conn:
        await conn.execute(
            sa.text(f"""
            INSERT INTO {m.fullname} (message_id, tracking_id, queue, type, status, attempt, created_at,
                updated_at, available_at, settled_at, headers, body, reason, archived)
            SELECT gen_random_uuid(), gen_random_uuid(), 'q' || (i % 5), 'Job' || (i % 5),
                   CASE WHEN i % 100 < 85 THEN 'Succeeded' WHEN i % 100 < 95 THEN 'DeadLettered'
                        WHEN i % 100 < 98 THEN 'Failed' ELSE 'Pending' END,
                   1, now() - (i % 2592000) * interval '1 second', now(), now(), now(),
                   '{{}}'::jsonb, jsonb_build_object('n', i),
                   CASE WHEN i % 100 BETWEEN 85 AND 94 THEN 'max-attempts-exceeded' END, false
            FROM generate_series(1, :rows) AS i"""),
            {"rows": rows},
        )
        await conn.execute(sa.text(f"ANALYZE {m.fullname}"))
    print(f"filled {rows:,} rows in {time.perf_counter() - t0:.1f}s (schema {schema})")

    api = create_app(OpsService(rt), api_key=KEY)
    results: dict[str, list[float]] = {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://bench" + PREFIX, headers={"X-API-Key": KEY}
    ) as client:
        targets = {
            "GET stats": ("/stats", {}),
            "GET messages?status=DeadLettered (first page, 50)": ("/messages", {"status": "DeadLettered"}),
            "GET messages (first page, all statuses)": ("/messages", {}),
            "GET messages/stats": ("/messages/stats", {}),
        }
        for label, (path, params) in targets.items():
            first = await client.get(path, params=params)  # warm: plans cached, pool connected
            assert first.status_code == 200, first.text
            timings = []
            for _ in range(requests):
                t = time.perf_counter()
                r = await client.get(path, params=params)
                timings.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200
            results[label] = timings
        stats = (await client.get("/stats")).json()
    total = sum(q["total"] for q in stats["queues"])
    assert total == rows, f"stats counted {total}, expected {rows}"
    print(f"\n{'request':<55} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for label, t in results.items():
        print(f"{label:<55} {pct(t, 50):8.1f} {pct(t, 90):8.1f} {pct(t, 99):8.1f} {statistics.mean(t):8.1f}")
    print(f"\n{requests} requests each; stats total = {total:,} (exact, from the trigger-kept counters)")
    async with provider.engine.begin() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    await rt.close()


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.rows, args.requests))
