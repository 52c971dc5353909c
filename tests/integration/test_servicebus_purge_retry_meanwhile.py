"""Service Bus: a whole-queue purge while an operator's retry of a dead letter is sending its copy.

The retry records the message Pending before it sends its copy, and holds the letter locked
meanwhile; a purge listing the queue then finds the id nowhere (the letter is in the dead-letter queue,
the copy not sent), and the drain of the dead letters skips the held one. The purge forgets the
history of a message it found nowhere only where the history shows it waiting as a scheduled message
(a purge that stopped after cancelling one left it so): the retried message keeps its history, whether
its copy lands (a live message) or is refused (the letter stays, listed for another retry)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from azure.servicebus import ServiceBusSubQueue

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.errors import ProviderUnavailable
from queueing_core.fakes.servicebus import FakeServiceBusNamespace
from queueing_core.ops import OpsService
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until

Q = "purge-retry-meanwhile"


@queue(Q, max_attempts=1)
class Job(QueueMessage):
    n: int


async def _dead_lettering(name: str) -> tuple[QueueingApp, Any]:
    """An app whose handler dead-letters every ``Job``, open on an in-memory Service Bus."""
    app = QueueingApp(name)

    @app.handler()
    async def job(msg: Job) -> None:
        raise NonRetryableError("no")

    rt = in_memory_servicebus(app, FakeServiceBusNamespace(), provider_options={"receive_wait": 0.1})
    await rt.open()
    return app, rt


@pytest.mark.parametrize("send_fails", [False, True], ids=["copy-sent", "copy-refused"])
async def test_a_retry_under_way_keeps_its_history_through_a_whole_purge(send_fails: bool) -> None:
    app, rt = await _dead_lettering("purge-retry")
    try:
        mid = (await app.enqueue(Job(n=1))).message_id

        async def dead() -> bool:
            r = await rt.tracker.get(mid)
            return r is not None and r.status == MessageStatus.DEAD_LETTERED

        async with running(rt):
            await wait_until(dead, what="the dead letter")

        prov: Any = rt.provider
        send_copy = prov.send_copy
        go, sending = asyncio.Event(), asyncio.Event()

        async def held_send_copy(queue: str, env: Any, at: Any) -> Any:
            sending.set()
            await go.wait()
            if send_fails:
                raise ProviderUnavailable("service bus unreachable (test)")
            return await send_copy(queue, env, at)

        prov.send_copy = held_send_copy
        ops = OpsService(rt)
        retry = asyncio.create_task(ops.retry(mid))
        await asyncio.wait_for(sending.wait(), 10)
        seen = await rt.tracker.get(mid)
        assert seen is not None
        assert seen.status == MessageStatus.PENDING  # (recorded before the send)
        await ops.purge(MessageQuery(queue=Q), whole=True)
        go.set()
        outcome = await asyncio.gather(retry, return_exceptions=True)
        assert isinstance(outcome[0], Exception) == send_fails, outcome
        props = await prov.admin.get_queue_runtime_properties(prov.physical(Q))
        rec = await rt.tracker.get(mid)
        if send_fails:
            assert props.dead_letter_message_count == 1  # the letter stays where it was
            assert rec is not None, "a dead letter with no history: never listed, never retried"
            listed = await rt.tracker.query(MessageQuery(queue=Q, status=("DeadLettered",)))
            assert [r.message_id for r in listed.items] == [mid]
        else:
            assert props.active_message_count == 1  # the retry's copy waits in the queue
            assert rec is not None, "the live copy's history was deleted by the purge"
    finally:
        await rt.close()


async def test_a_letter_the_purge_leaves_keeps_the_history_that_says_it_waits() -> None:
    """A message Service Bus dead-lettered by itself (its delivery limit) whose history still says it
    waits for its retry: a purge that finds it nowhere in the queue, and leaves its letter (another
    reader holds it), does not take it for one an earlier purge cancelled: the letter stays, so does
    its history."""
    app, rt = await _dead_lettering("purge-letter-left")
    try:
        held = (await app.enqueue(Job(n=1))).message_id
        other = (await app.enqueue(Job(n=2))).message_id

        async def both_dead() -> bool:
            records = [await rt.tracker.get(mid) for mid in (held, other)]
            return all(r is not None and r.status == MessageStatus.DEAD_LETTERED for r in records)

        async with running(rt):
            await wait_until(both_dead, what="two dead letters")
        record = await rt.tracker.get(held)
        assert record is not None
        await rt.tracker.upsert([record.model_copy(update={"status": MessageStatus.FAILED.value})])
        prov: Any = rt.provider
        reader = prov.client.get_queue_receiver(prov.physical(Q), sub_queue=ServiceBusSubQueue.DEAD_LETTER)
        async with reader:
            [letter] = await reader.receive_messages(max_message_count=1, max_wait_time=5)  # (held)
            await OpsService(rt).purge(MessageQuery(queue=Q), whole=True)
            props = await prov.admin.get_queue_runtime_properties(prov.physical(Q))
            assert props.dead_letter_message_count == 1
            assert await rt.tracker.get(other) is None  # (its letter removed: its history went)
            assert await rt.tracker.get(held) is not None, "a letter left with no history: never listed"
            await reader.abandon_message(letter)
    finally:
        await rt.close()
