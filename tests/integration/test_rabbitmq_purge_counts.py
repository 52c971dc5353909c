"""A whole-queue purge on RabbitMQ answers for every message it matched: deleted, or left (a worker's
consumer had received it: AMQP's purge cannot take it, and it runs). With delayed-store rows among
them, the rows' count was taken off twice, and the messages a worker held vanished from the answer;
a cancel request's message, still waiting in the queue, was counted as finished, so one a worker held
was reported deleted (found in review)."""

from __future__ import annotations

import contextlib
from datetime import timedelta

import aio_pika

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.ops.service import OpsService
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require


@queue("Purge.HeldDelayed")
class HeldDelayed(QueueMessage):
    n: int


async def _delete(names):
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        for n in names:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(n)


async def test_whole_queue_purge_with_delayed_rows_and_held_messages(tmp_path):
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    app = QueueingApp("review", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=2)  # prefetch 2: two delivered to the consumer, the rest wait
    async def handle(msg: HeldDelayed, ctx) -> None:
        return None

    provider = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), idle_timeout=60
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Purge.HeldDelayed"
    try:
        await rt.open()
        # one message waiting as a row of the delayed store (Sleeping)
        await app.enqueue(HeldDelayed(n=99), delay=timedelta(hours=1))
        await app.enqueue_many([HeldDelayed(n=i) for i in range(5)], wait=True)
        c = await provider._consumer(app.subscription("HeldDelayed"))
        await wait_until(lambda: len(c.buffer) == 2, what="two messages in the consumer's buffer")
        done = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldDelayed"))
        # 6 matched: 1 delayed row + 3 waiting are deleted; the 2 the consumer holds are left
        assert (done.deleted, done.left_waiting) == (4, 2), done
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])


@queue("Purge.HeldCancel")
class HeldCancel(QueueMessage):
    n: int


async def test_whole_queue_purge_with_a_cancel_request_waiting(tmp_path):
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    app = QueueingApp("review", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=2)  # prefetch 2
    async def handle(msg: HeldCancel, ctx) -> None:
        return None

    provider = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), idle_timeout=60
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Purge.HeldCancel"
    try:
        await rt.open()
        receipts = await app.enqueue_many([HeldCancel(n=i) for i in range(5)], wait=True)
        await app.cancel(receipts[4].tracking_id)  # the last one waits in the queue, cancel requested
        c = await provider._consumer(app.subscription("HeldCancel"))
        await wait_until(lambda: len(c.buffer) == 2, what="two messages in the consumer's buffer")
        done = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldCancel"))
        # 5 matched: the 2 the consumer holds are left (they run); 3 are gone
        assert done.left_waiting == 2, done
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])
