"""Hosts whose clocks differ do not bounce a delayed message between them.

Host A's clock runs ahead of host B's. A's delayed-store dispatcher forwards a message when A's clock
says it is due; B's worker, whose clock says it is not, sent it back to wait, and A, finding it due,
forwarded it again at once: one message bounced between them until the clocks agreed (a review found
178 forwards for 3 s of skew). A delivery at most a few seconds early is now held until it is due.
Real RabbitMQ (127.0.0.1:5672) and PostgreSQL for the side stores."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from tests.contract.harness import running, wait_until
from tests.services import POSTGRES_URL, RABBITMQ_URL, drop_schema, fresh_prefix, require

SKEW = timedelta(seconds=3)


@queue("skew.jobs")
class SkewJob(QueueMessage):
    n: int


async def test_a_dispatcher_whose_clock_is_ahead_forwards_a_delayed_message_once() -> None:
    require("RabbitMQ", "127.0.0.1", 5672)
    require("PostgreSQL", "127.0.0.1", 5432)
    from queueing_core.providers.rabbitmq import RabbitMQProvider
    from queueing_core.providers.sql.history import SideStores
    from queueing_core.runtime import Runtime

    schema = f"t_skew_{uuid.uuid4().hex[:8]}"
    app = QueueingApp("skew", naming=QueueNaming(prefix=fresh_prefix()))
    runs: list[int] = []

    @app.handler()
    async def handle(msg: SkewJob) -> None:
        runs.append(msg.n)

    def ahead():
        return utcnow() + SKEW

    worker_host = RabbitMQProvider(RABBITMQ_URL, stores=SideStores(POSTGRES_URL, schema=schema))
    dispatching_host = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(POSTGRES_URL, schema=schema, clock=ahead), clock=ahead
    )
    rt = Runtime(app, worker_host)
    await rt.open()
    await dispatching_host.open(app)
    dispatching = asyncio.create_task(dispatching_host.dispatcher.run())
    try:
        async with running(rt):
            receipt = await app.enqueue(SkewJob(n=1), delay=SKEW + timedelta(seconds=2))
            await wait_until(lambda: runs, timeout=60, what="the run")
            await wait_until(lambda: succeeded(rt, receipt.message_id), what="its success recorded")
        forwards = dispatching_host.dispatcher.forwarded + worker_host.dispatcher.forwarded
        assert runs == [1]
        # bounced, it was forwarded a hundred and more times before the worker's clock caught up
        assert forwards <= 2, forwards
    finally:
        dispatching.cancel()
        await asyncio.gather(dispatching, return_exceptions=True)
        await dispatching_host.close()
        await rt.close()
        await drop_schema(schema)


async def succeeded(rt, message_id) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == MessageStatus.SUCCEEDED.value
