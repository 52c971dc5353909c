"""RabbitMQ's classic queues count no deliveries: a message comes back only marked ``redelivered``,
whether a handler ran it or it merely sat in the buffer of a consumer whose connection dropped. Such a
delivery is not taken as proof that its attempts were used by runs: a message on its last attempt
that was only buffered still runs (found in review). Real broker."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, RetryPolicy, queue
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require


@queue("Review.OneShot", max_attempts=1, retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0))
class OneShot(QueueMessage):
    n: int


async def _settled(rt: Runtime, message_id) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status in (MessageStatus.SUCCEEDED, MessageStatus.DEAD_LETTERED)


def _rabbit(tmp_path, prefix: str, calls: list[tuple[int, int]]):
    from queueing_core.providers.rabbitmq import RabbitMQProvider
    from queueing_core.providers.sql.history import SideStores

    app = QueueingApp("review", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=4)
    async def handle(msg: OneShot, ctx) -> None:
        calls.append((msg.n, ctx.attempt))

    stores = SideStores(f"sqlite:///{tmp_path}/{prefix}side.db")
    provider = RabbitMQProvider(RABBITMQ_URL, stores=stores, idle_timeout=30, reconnect_interval=0.5)
    return app, Runtime(app, provider, control_ttl=0.05)


async def test_rabbitmq_prefetched_message_redelivered_after_a_connection_drop_still_runs(tmp_path):
    """A message only prefetched into the consumer's buffer (never handed to a handler) comes back
    ``redelivered`` when the connection drops; the receive counts that as an attempt, and the new
    attempts guard then dead-letters a max_attempts=1 message that never ran."""
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    calls: list[tuple[int, int]] = []
    app, rt = _rabbit(tmp_path, prefix, calls)
    await rt.open()
    r = await app.enqueue(OneShot(n=1))
    sub = app.subscription("OneShot")
    provider = rt.provider
    await provider.receive(sub, 0)  # the consumer starts; the broker pushes the message into its buffer
    physical = provider.physical(sub.queue)
    await wait_until(lambda: len(provider._consumers[physical].buffer) == 1, what="prefetch")
    # the connection drops (a network blip): the broker requeues the unacked message, redelivered
    await provider._conn.transport.connection.close()
    await wait_until(lambda: provider._conn.connected.is_set(), what="reconnected")
    await asyncio.sleep(0.5)
    async with running(rt):
        await wait_until(lambda: _settled(rt, r.message_id), what="settled")
    rec = await rt.tracker.get(r.message_id)
    await rt.close()
    assert calls, f"never ran: {rec.status} {rec.description}"
    assert rec.status == MessageStatus.SUCCEEDED
