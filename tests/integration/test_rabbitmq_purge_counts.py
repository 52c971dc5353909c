"""A whole-queue purge on RabbitMQ answers for every message it matched: deleted, or left (a worker's
consumer had received it: AMQP's purge cannot take it, and it runs). With delayed-store rows among
them, the rows' count was taken off twice, and the messages a worker held vanished from the answer;
a cancel request's message, still waiting in the queue, was counted as finished, so one a worker held
was reported deleted (found in review)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

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


@queue("Purge.HeldCancel")
class HeldCancel(QueueMessage):
    n: int


@queue("Purge.HeldPlain")
class HeldPlain(QueueMessage):
    n: int


async def _delete(names):
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        for n in names:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(n)


@contextlib.asynccontextmanager
async def _held(
    tmp_path: Any, message: type[QueueMessage]
) -> AsyncIterator[tuple[QueueingApp, Runtime, Any]]:
    """A runtime whose type handles two at once (a prefetch of two: two delivered to the consumer, the
    rest wait in the queue); yields the app, the runtime and the provider; the queues deleted after."""
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    app = QueueingApp("purge-counts", naming=QueueNaming(prefix=prefix))

    async def handle(msg: Any, ctx: Any) -> None:
        return None

    app.handler(message, max_concurrency=2)(handle)
    stores = SideStores(f"sqlite:///{tmp_path}/side.db")
    provider = RabbitMQProvider(RABBITMQ_URL, stores=stores, idle_timeout=60)
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = provider.physical(app.subscription(message.type_name()).queue)
    try:
        await rt.open()
        yield app, rt, provider
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])


async def _two_in_the_buffer(app: QueueingApp, provider: Any, message: type[QueueMessage]) -> Any:
    c = await provider._consumer(app.subscription(message.type_name()))
    await wait_until(lambda: len(c.buffer) == 2, what="two messages in the consumer's buffer")
    return c


async def test_a_whole_queue_purge_counts_what_a_worker_had_received_as_left(tmp_path):
    """The purge of a whole queue counted every message it matched as deleted, the two a worker's
    consumer had received among them, and those two then ran (found in review). AMQP cannot take
    them, nor say which they are: the purge now counts them as left (``left_waiting``), from the
    broker's own count of what it removed."""
    async with _held(tmp_path, HeldPlain) as (app, rt, provider):
        await app.enqueue_many([HeldPlain(n=i) for i in range(5)], wait=True)
        c = await _two_in_the_buffer(app, provider, HeldPlain)
        done = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldPlain"), whole=True)
        assert (done.deleted, done.left_waiting) == (3, 2), done
        await provider._stop_consumer(c)  # handed back (as a stopped worker's are): a purge takes them
        again = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldPlain"), whole=True)
        assert (again.deleted, again.left_waiting) == (0, 0), again
        assert await provider.depth(provider.physical("Purge.HeldPlain")) == 0


async def test_whole_queue_purge_with_delayed_rows_and_held_messages(tmp_path):
    async with _held(tmp_path, HeldDelayed) as (app, rt, provider):
        # one message waiting as a row of the delayed store (Sleeping)
        await app.enqueue(HeldDelayed(n=99), delay=timedelta(hours=1))
        await app.enqueue_many([HeldDelayed(n=i) for i in range(5)], wait=True)
        await _two_in_the_buffer(app, provider, HeldDelayed)
        done = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldDelayed"), whole=True)
        # 6 matched: 1 delayed row + 3 waiting are deleted; the 2 the consumer holds are left
        assert (done.deleted, done.left_waiting) == (4, 2), done


async def test_whole_queue_purge_with_a_cancel_request_waiting(tmp_path):
    async with _held(tmp_path, HeldCancel) as (app, rt, provider):
        receipts = await app.enqueue_many([HeldCancel(n=i) for i in range(5)], wait=True)
        await app.cancel(receipts[4].tracking_id)  # the last one waits in the queue, cancel requested
        await _two_in_the_buffer(app, provider, HeldCancel)
        done = await OpsService(rt).purge(MessageQuery(queue="Purge.HeldCancel"), whole=True)
        # 5 matched: the 2 the consumer holds are left (they run); 3 are gone
        assert done.left_waiting == 2, done
