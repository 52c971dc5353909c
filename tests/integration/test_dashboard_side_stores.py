"""The dashboard on a broker whose history is in the side database (RabbitMQ here; SQS is the same):
the history table has no settlement or due times, so its overview shows counts without the charts,
instead of failing on a column it does not have (the landing page and the pause buttons answered 500)."""

from __future__ import annotations

import re

import httpx

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from queueing_core.tracking import ActivitySource
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require

KEY = "side-dashboard-key-not-a-secret"
UI = PREFIX + "/ui"


@queue("side-dash-orders")
class SideDashOrder(QueueMessage):
    n: int


async def test_the_overview_and_its_buttons_answer_on_a_broker_with_side_store_history(tmp_path) -> None:
    require("RabbitMQ", "127.0.0.1", 5672)
    app = QueueingApp("side-dash", naming=QueueNaming(prefix=fresh_prefix()))
    done: list[int] = []

    @app.handler()
    async def handle(msg: SideDashOrder) -> None:
        done.append(msg.n)

    rt = Runtime(app, RabbitMQProvider(RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db")))
    await rt.open()
    try:
        assert not isinstance(rt.tracker, ActivitySource)  # no settlement times to chart
        await app.enqueue(SideDashOrder(n=1))
        async with running(rt):
            await wait_until(lambda: done == [1], what="the message's run")
        api = create_app(OpsService(rt), api_key=KEY)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test") as c:
            form = {"Content-Type": "application/x-www-form-urlencoded"}
            assert (await c.post(f"{UI}/sign-in", content=f"key={KEY}", headers=form)).status_code == 303
            page = await c.get(f"{UI}/")
            assert page.status_code == 200, page.text[:300]
            assert "side-dash-orders" in page.text
            assert (await c.get(f"{UI}/overview")).status_code == 200
            csrf = {"X-CSRF-Token": re.search(r'"X-CSRF-Token": "([^"]+)"', page.text).group(1)}
            paused = await c.post(f"{UI}/queues/side-dash-orders/pause", headers=csrf)
            assert paused.status_code == 200, paused.text[:300]
            assert "Queue side-dash-orders paused" in paused.text
            resumed = await c.post(f"{UI}/types/SideDashOrder/resume", headers=csrf)
            assert resumed.status_code == 200, resumed.text[:300]
        assert (await rt.tracker.counts()).get(("side-dash-orders", "Succeeded")) == 1
    finally:
        await rt.close()
