"""Dashboard overview render time on a large PostgreSQL table.

    .venv/bin/python bench/dashboard.py [--rows 1000000] [--recent 0.001] [--requests 50]

Fills a fresh schema with N messages (85% Succeeded, 10% DeadLettered, 3% Failed, 2% Pending over 5
queues), created over 30 days and settled a few seconds after creation, except the ``--recent``
fraction, created and settled within the last hour (what the throughput and latency charts read).
Then times the overview page and its polled fragment through the real app (in-process ASGI
transport, API key checked): counts, pause and circuit state, health and the hour's charts. The
first request after start reads the whole hour; later ones read the five-minute slot in progress
(finished slots are kept). Target: the overview renders within 300 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import httpx
import sqlalchemy as sa
from ops_api import KEY, URL, make_app, pct

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime


async def main(rows: int, recent: float, requests: int) -> None:
    schema = f"bench_ui_{uuid.uuid4().hex[:6]}"
    provider = SqlProvider(URL, schema=schema)
    rt = Runtime(make_app(), provider)
    await rt.open()
    m = provider.tables.messages
    every = max(int(1 / recent), 1) if recent > 0 else rows + 1  # every Nth row is from the last hour
    t0 = time.perf_counter()
    async with provider.engine.begin() as conn:
        await conn.execute(
            sa.text(f"""
            WITH r AS (
                SELECT i, CASE WHEN i % 100 < 85 THEN 'Succeeded' WHEN i % 100 < 95 THEN 'DeadLettered'
                               WHEN i % 100 < 98 THEN 'Failed' ELSE 'Pending' END AS status,
                       CASE WHEN i % :every = 0 THEN now() - (i % 3500) * interval '1 second'
                            ELSE now() - interval '1 hour' - (i % 2592000) * interval '1 second' END AS at
                FROM generate_series(1, :rows) AS i)
            INSERT INTO {m.fullname} (message_id, tracking_id, queue, type, status, attempt, created_at,
                updated_at, available_at, settled_at, headers, body, reason, archived)
            SELECT gen_random_uuid(), gen_random_uuid(), 'q' || (i % 5), 'Job' || (i % 5), status, 1, at,
                   at, at,
                   CASE WHEN status IN ('Succeeded', 'DeadLettered')
                        THEN at + (i % 60) * interval '1 second' END,
                   '{{}}'::jsonb, jsonb_build_object('n', i),
                   CASE WHEN status = 'DeadLettered' THEN 'max-attempts-exceeded' END, false
            FROM r"""),
            {"rows": rows, "every": every},
        )
        await conn.execute(sa.text(f"ANALYZE {m.fullname}"))
    hour = rows // every
    print(
        f"filled {rows:,} rows ({hour:,} in the last hour) in {time.perf_counter() - t0:.1f}s",
        f"(schema {schema})",
    )

    api = create_app(OpsService(rt), api_key=KEY)
    results: dict[str, list[float]] = {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://bench" + PREFIX, headers={"X-API-Key": KEY}
    ) as client:
        for label, path in {
            "GET ui/ (the overview page)": "/ui/",
            "GET ui/overview (polled)": "/ui/overview",
        }.items():
            t = time.perf_counter()
            first = await client.get(path)  # warm: templates compiled, plans cached, pool connected
            cold = (time.perf_counter() - t) * 1000
            assert first.status_code == 200, first.text
            print(f"{label}: first request {cold:.1f} ms")
            assert "Throughput, last hour" in first.text
            timings = []
            for _ in range(requests):
                t = time.perf_counter()
                r = await client.get(path)
                timings.append((time.perf_counter() - t) * 1000)
                assert r.status_code == 200
            results[label] = timings
    print(f"\n{'request':<40} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for label, t in results.items():
        print(f"{label:<40} {pct(t, 50):8.1f} {pct(t, 90):8.1f} {pct(t, 99):8.1f} {max(t):8.1f}")
    worst = max(pct(t, 50) for t in results.values())
    print(
        f"\n{requests} requests each; target: the overview within 300 ms (p50 {worst:.1f} ms): "
        + ("MET" if worst <= 300 else "NOT MET")
    )
    async with provider.engine.begin() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    await rt.close()


if __name__ == "__main__":
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--recent", type=float, default=0.001, help="fraction of rows from the last hour")
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.rows, args.recent, args.requests))
