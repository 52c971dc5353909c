"""The `status` filter of `GET messages`, `DELETE messages` and the dashboard's list: each status
becomes a term of the store's query, and SQLite refuses an expression about 1,000 terms deep. Before,
about a thousand repeats of one valid status (15 KB of query string) answered 500. A status given
twice is the same filter (counted once); more than 32 different ones is a 422 naming the limit, as
`POST queues/{q}/status` already caps its list."""

from __future__ import annotations

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops.models import MAX_STATUSES
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

PROBLEM = "application/problem+json"


@queue("status-cap")
class Ping(QueueMessage):
    n: int


async def _runtime(tmp_path) -> Runtime:
    app = QueueingApp("status-cap")
    app.message(Ping)
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    await app.enqueue(Ping(n=1))
    return rt


async def test_a_status_repeated_a_thousand_times_is_one_filter(tmp_path):
    rt = await _runtime(tmp_path)
    try:
        repeated = [("queue", "status-cap"), *[("status", "Pending")] * 1001]
        async with ops_client(rt) as client:
            listed = await client.get("/messages", params=repeated)
            page = await client.get("/ui/messages", params=repeated)
            purged = await client.delete("/messages", params=repeated)
            left = (await client.get("/messages", params={"queue": "status-cap"})).json()["items"]
        assert listed.status_code == 200, listed.text[:300]
        assert [m["status"] for m in listed.json()["items"]] == ["Pending"]
        assert page.status_code == 200, page.text[:300]
        assert page.text.count('href="/api/_system/queueing/ui/messages/') == 1
        assert purged.status_code == 200, purged.text[:300]
        assert purged.json()["deleted"] == 1
        assert left == []
    finally:
        await rt.close()


async def test_more_different_statuses_than_the_cap_are_refused_by_name(tmp_path):
    rt = await _runtime(tmp_path)
    try:
        at_cap = [("status", f"Custom{i}") for i in range(MAX_STATUSES - 1)] + [("status", "Pending")]
        over = [*at_cap, ("status", "OneTooMany")]
        async with ops_client(rt) as client:
            fits = await client.get("/messages", params=at_cap)
            listed = await client.get("/messages", params=over)
            purged = await client.delete("/messages", params=over)
            page = await client.get("/ui/messages", params=over)
            still = (await client.get("/messages", params={"queue": "status-cap"})).json()["items"]
        assert fits.status_code == 200, fits.text[:300]
        assert len(fits.json()["items"]) == 1
        for refused in (listed, purged):
            assert refused.status_code == 422, refused.text[:300]
            assert refused.headers["content-type"].startswith(PROBLEM)
            detail = refused.json()["detail"]
            assert detail.startswith("query.status:"), detail
            assert f"at most {MAX_STATUSES} different statuses" in detail
        assert len(still) == 1  # the refused purge deleted nothing
        assert page.status_code == 422
        assert f"at most {MAX_STATUSES} different statuses" in page.text
    finally:
        await rt.close()
