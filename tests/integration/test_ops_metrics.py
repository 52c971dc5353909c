"""``GET metrics`` on SQLite and PostgreSQL: Prometheus text that its own parser reads, whose counts are
those of ``GET stats``, behind the same key as every other route."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from queueing_core.testing import run_until_idle

from .test_ops_api import KEY, Email, Report


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_metrics_parse_and_their_counts_equal_stats(api):
    client, rt, _sent = api
    app = rt.app
    for i in range(5):
        await app.enqueue(Email(to=f"{i}@x.io", subject="s", fail=i == 4))
    await app.enqueue_many([Report(name="r1"), Report(name="r2")])
    await run_until_idle(rt, raise_errors=False)
    await client.post("/queues/reports/pause")
    await app.enqueue(Email(to="later@x.io", subject="s", fail=False), delay=3600)

    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    found = families(r.text)
    stats = (await client.get("/stats")).json()
    expected = {(q["queue"], status): n for q in stats["queues"] for status, n in q["counts"].items() if n}
    got = {(s.labels["queue"], s.labels["status"]): s.value for s in found["queueing_messages"].samples}
    assert got == expected
    assert expected == {
        ("emails", "Succeeded"): 4,
        ("emails", "DeadLettered"): 1,
        ("emails", "Sleeping"): 1,
        ("reports", "Pending"): 2,  # no handler here, and run_until_idle only runs handled types
    }
    handled = {(s.labels["queue"], s.labels["outcome"]): s.value for s in found["queueing_handled"].samples}
    assert handled == {("emails", "succeeded"): 4, ("emails", "dead_lettered"): 1}
    lag = {s.name: s.value for s in found["queueing_lag_seconds"].samples if s.labels["queue"] == "emails"}
    assert lag["queueing_lag_seconds_count"] == 5
    assert lag["queueing_lag_seconds_sum"] >= 0
    paused = {s.labels["queue"]: s.value for s in found["queueing_queue_paused"].samples}
    assert paused == {"emails": 0, "reports": 1}


async def test_metrics_need_the_key(api):
    client, _rt, _sent = api
    bare = httpx.AsyncClient(transport=client._transport, base_url=str(client.base_url))
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = await bare.get("/metrics", headers=headers)
        assert r.status_code == 401
    assert (await bare.get("/metrics", headers={"X-API-Key": KEY})).status_code == 200
    await bare.aclose()
