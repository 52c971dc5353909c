"""A dead letter moved back to its queue with RabbitMQ's own tools (the management UI's "Move
messages", a shovel: body and properties as they were) runs again, as after an operator's retry. It
kept the attempts its message had used and the kit's dead-letter reason, and the worker dead-lettered
it again unrun, "the last deliveries ended without a settlement" (found in review). Real broker."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import aio_pika
import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, RetryPolicy, queue
from queueing_core.envelope import DESCRIPTION, REASON
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require

#: the downstream the handler calls: down until the test says it is back
downstream = {"down": True}


@queue(
    "Moved.Job",
    max_attempts=2,
    retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0),
    expiration=timedelta(minutes=10),
)
class Job(QueueMessage):
    n: int


@pytest.fixture(autouse=True)
def _broker() -> None:
    require("RabbitMQ", "127.0.0.1", 5672)


@pytest.fixture
async def kit(tmp_path):
    """(app, runtime, provider, the attempts each run saw); the queues deleted afterwards."""
    downstream["down"] = True
    app = QueueingApp("moved", naming=QueueNaming(prefix=fresh_prefix()))
    calls: list[int] = []

    @app.handler()
    async def handle(msg: Job, ctx: Any) -> None:
        calls.append(ctx.attempt)
        if downstream["down"]:
            raise RuntimeError("downstream is down")

    provider = RabbitMQProvider(
        RABBITMQ_URL,
        stores=SideStores(f"sqlite:///{tmp_path}/side.db"),
        idle_timeout=0.5,
        reconnect_interval=0.5,
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    try:
        yield app, rt, provider, calls
    finally:
        await rt.close()
        physical = provider.physical("Moved.Job")
        async with await aio_pika.connect(RABBITMQ_URL) as conn:
            channel = await conn.channel()
            for name in (physical, provider.dead_letter_name(physical)):
                await channel.queue_delete(name)


async def move(src: str, dst: str) -> int:
    """What a shovel or the management UI's "Move messages" does: each message published again with its
    body and properties as they were (a shovel's forward headers added)."""
    n = 0
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        q = await channel.declare_queue(src, passive=True)
        while (m := await q.get(no_ack=False, fail=False)) is not None:
            headers = {**(m.headers or {}), "x-shovelled": [{"src-queue": src, "dest-queue": dst}]}
            await channel.default_exchange.publish(
                aio_pika.Message(
                    m.body,
                    headers=headers,
                    message_id=m.message_id,
                    content_type=m.content_type,
                    delivery_mode=m.delivery_mode,
                    timestamp=m.timestamp,
                ),
                routing_key=dst,
            )
            await m.ack()
            n += 1
    return n


async def _status(rt: Runtime, message_id: Any, want: str) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == want


async def _settled(rt: Runtime, message_id: Any) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status in (MessageStatus.SUCCEEDED, MessageStatus.DEAD_LETTERED)


async def test_a_dead_letter_moved_back_with_the_brokers_tools_runs_again_with_fresh_attempts(kit):
    app, rt, provider, calls = kit
    r = await app.enqueue(Job(n=1))
    async with running(rt):
        await wait_until(lambda: _status(rt, r.message_id, MessageStatus.DEAD_LETTERED), what="dead-lettered")
    assert calls == [1, 2]
    physical = provider.physical("Moved.Job")
    assert await move(provider.dead_letter_name(physical), physical) == 1
    # moved back while the downstream is still down: it has both its attempts again, and is
    # dead-lettered (again) only when they are used, for the handler's reason
    async with running(rt):
        await wait_until(lambda: len(calls) == 4, what="two more runs")
        await wait_until(lambda: _status(rt, r.message_id, MessageStatus.DEAD_LETTERED), what="dead-lettered")
    rec = await rt.tracker.get(r.message_id)
    assert rec is not None
    assert calls == [1, 2, 1, 2], rec.description
    assert "downstream is down" in (rec.description or "")
    # moved back once the downstream is up: it runs and succeeds
    downstream["down"] = False
    assert await move(provider.dead_letter_name(physical), physical) == 1
    async with running(rt):
        await wait_until(lambda: len(calls) == 5, what="the run")
        await wait_until(lambda: _settled(rt, r.message_id), what="an outcome")
    rec = await rt.tracker.get(r.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED, rec.description
    assert calls == [1, 2, 1, 2, 1]
    assert await provider.depth(physical, dead=True) == 0


async def test_an_expired_letter_moved_back_runs_within_its_types_expiration_from_its_return(kit):
    """Its letter has no expiry (the dead-letter queue keeps it for good), and its message's had passed:
    back in its queue it has its type's expiration again, counted from its return, as a retry has."""
    app, rt, provider, calls = kit
    downstream["down"] = False
    r = await app.enqueue(Job(n=1), ttl=timedelta(milliseconds=300))
    await asyncio.sleep(0.5)
    async with running(rt):
        await wait_until(lambda: _status(rt, r.message_id, MessageStatus.EXPIRED), what="expired")
    assert calls == []
    physical = provider.physical("Moved.Job")
    assert await move(provider.dead_letter_name(physical), physical) == 1
    async with running(rt):
        await wait_until(lambda: len(calls) == 1, what="the run")
        await wait_until(lambda: _settled(rt, r.message_id), what="an outcome")
    rec = await rt.tracker.get(r.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED, rec.description
    assert calls == [1]
    assert rec.expires_at is not None
    assert rec.expires_at > rec.created_at + timedelta(minutes=9)


async def test_a_moved_back_letter_handed_back_unrun_keeps_its_fresh_start(kit):
    """A consumer handed a moved-back letter that nobody asks for work (a stopped worker) hands it back
    as a copy of its envelope: the copy must not carry the used attempts without the letter's marks,
    or it is dead-lettered unrun at its next delivery."""
    app, rt, provider, calls = kit
    r = await app.enqueue(Job(n=1))
    async with running(rt):
        await wait_until(lambda: _status(rt, r.message_id, MessageStatus.DEAD_LETTERED), what="dead-lettered")
    downstream["down"] = False
    physical = provider.physical("Moved.Job")
    assert await move(provider.dead_letter_name(physical), physical) == 1
    sub = app.subscription("Job")
    assert sub is not None
    await provider.receive(sub, 0)  # the consumer starts; the broker pushes the letter into its buffer
    await wait_until(lambda: len(provider._consumers[physical].buffer) == 1, what="prefetch")
    # nobody asks for work: the consumer is cancelled and its buffer handed back
    await wait_until(lambda: provider._consumers[physical].tag is None, what="the hand-back")
    await wait_until(lambda: _ready(provider, physical), what="the letter back in its queue")
    async with running(rt):
        await wait_until(lambda: len(calls) == 3, what="the run")
        await wait_until(lambda: _settled(rt, r.message_id), what="an outcome")
    rec = await rt.tracker.get(r.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED, rec.description
    assert calls == [1, 2, 1]


async def _ready(provider: RabbitMQProvider, physical: str) -> bool:
    return await provider.depth(physical) == 1


async def test_a_letter_moved_back_keeps_no_dead_letter_marks_in_what_it_runs_with(kit):
    app, rt, provider, _ = kit
    r = await app.enqueue(Job(n=1))
    async with running(rt):
        await wait_until(lambda: _status(rt, r.message_id, MessageStatus.DEAD_LETTERED), what="dead-lettered")
    physical = provider.physical("Moved.Job")
    assert await move(provider.dead_letter_name(physical), physical) == 1
    sub = app.subscription("Job")
    assert sub is not None
    deliveries = []
    await wait_until(lambda: _receive_into(provider, sub, deliveries), what="the moved letter")
    [d] = deliveries
    assert d.envelope is not None
    assert REASON not in d.envelope.headers
    assert DESCRIPTION not in d.envelope.headers
    assert d.envelope.attempt == 0
    assert d.attempt == 1
    # (left unsettled: closing the runtime's connection gives it back)


async def _receive_into(provider: RabbitMQProvider, sub: Any, out: list[Any]) -> bool:
    out.extend(await provider.receive(sub, 10))
    return bool(out)
