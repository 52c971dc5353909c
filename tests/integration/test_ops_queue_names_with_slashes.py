"""A queue whose name holds '/' (Service Bus and SQL allow it) is reached by the queue routes of the
operations API and the dashboard.

The routes took a queue name as one path segment: '/queues/billing/invoices/pause' matched no route,
and '%2F' is decoded before routing, so such a queue could not be paused, resumed, enqueued to or
updated over HTTP, and the dashboard's buttons posted to paths that did not exist (a review found
it)."""

from __future__ import annotations

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client


@queue("billing/invoices")
class InvoiceDue(QueueMessage):
    invoice: str


async def test_a_queue_name_with_a_slash_is_reached_by_every_queue_route(tmp_path):
    app = QueueingApp("review-slash-names")

    @app.handler()
    async def due(msg: InvoiceDue) -> None: ...

    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    await rt.open()
    try:
        async with ops_client(rt) as client:
            for encoded in ("billing/invoices", "billing%2Finvoices"):
                r = await client.post(f"/queues/{encoded}/pause")
                assert r.status_code == 200, (encoded, r.text)
                assert r.json() == {"kind": "queue", "name": "billing/invoices", "paused": True}
                r = await client.post(f"/queues/{encoded}/resume")
                assert r.json()["paused"] is False
            r = await client.post("/queues/billing/invoices/messages", json={"invoice": "i-1"})
            assert r.status_code == 201, r.text
            r = await client.post(
                "/queues/billing/invoices/status",
                json={"where": {"path": "invoice", "value": "i-1"}, "set": "OnHold"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["updated"] == 1
            assert (await client.post("/queues/billing/nothing/pause")).status_code == 404
    finally:
        await rt.close()
