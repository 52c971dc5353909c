"""Storage Queues: a delete that reached the service but whose answer was lost, then an outage through
the provider's further tries. The settler tries again in a new ``settle`` call (or, in a batch where
another message settled, the failure counts as refused); that call finds the message gone (404). It is
this run's own delete while the message was still hidden under its receipt: the outcome stands and its
history is written (before, the run was refused as a lost lease and the history stayed Pending for
good, the message run and deleted, or its letter in -poison). Past the run's hold the 404 may be a
later run's, so the outcome is recorded only unless a later run recorded its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from azure.core.exceptions import ServiceRequestError, ServiceResponseError

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.decisions import Complete
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from tests.contract.harness import running, wait_until


@queue("lost.delete")
class Job(QueueMessage):
    n: int
    fail: bool = False


@queue("lost.short", lease_duration=timedelta(seconds=1))
class Short(QueueMessage):
    n: int


async def _runtime(azurite: Any, ran: list[int] | None = None, tag: str | None = None) -> Runtime:
    tag = tag or uuid.uuid4().hex[:8]
    app = QueueingApp("lost", naming=QueueNaming(prefix=f"l{tag}-"))
    app.message(Short)

    @app.handler()
    async def handle(msg: Job) -> None:
        if ran is not None:
            ran.append(msg.n)
        if msg.fail:
            raise NonRetryableError("refused for good")

    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"lc{tag}", tracker_table=f"lh{tag}"
    )
    rt = Runtime(app, provider)
    await rt.open()
    return rt


async def _drop(rt: Runtime, *queues: str) -> None:
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    for q in queues:
        for name in (p.physical(q), p.poison_name(q)):
            await p.client(name).delete_queue()
    await rt.close()


def _lands_then_outage(
    client: Any, unanswered: int, only: Callable[[str], bool] = lambda _: True
) -> list[str]:
    """The first delete (of a message ``only`` picks) lands and its answer is lost; the next
    ``unanswered`` are not sent (the outage goes on); then the service answers again."""
    real = client.delete_message
    calls: list[str] = []

    async def delete_message(message_id: str, *args: Any, **kwargs: Any) -> Any:
        if not only(message_id):
            return await real(message_id, *args, **kwargs)
        if not calls:
            await real(message_id, *args, **kwargs)
            calls.append("landed, answer lost")
            raise ServiceResponseError("connection reset after the request was sent")
        if len(calls) <= unanswered:
            calls.append("not sent")
            raise ServiceRequestError("connection refused")
        calls.append("answered")
        return await real(message_id, *args, **kwargs)

    client.delete_message = delete_message
    return calls


async def _runs_and_is_recorded_succeeded(
    azurite: Any, unanswered: int, settled: Callable[..., bool]
) -> None:
    """A message runs; its first delete lands unanswered, the next ``unanswered`` are not sent: once
    ``settled(worker, calls)`` holds, its history says Succeeded, and it is gone from its queue."""
    ran: list[int] = []
    rt = await _runtime(azurite, ran)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        calls = _lands_then_outage(p.client(p.physical("lost.delete")), unanswered=unanswered)
        receipt = await rt.app.enqueue(Job(n=1))
        async with running(rt) as worker:
            await wait_until(lambda: settled(worker, calls), timeout=90, what="the settler's tries")
            await wait_until(
                lambda: _status(rt, receipt.message_id, MessageStatus.SUCCEEDED), timeout=10, what="Succeeded"
            )
        assert ran == [1]
        assert await p.depth("lost.delete") == 0
    finally:
        await _drop(rt, "lost.delete", "lost.short")


async def test_a_success_whose_delete_landed_unanswered_is_recorded_by_the_settlers_next_try(azurite):
    await _runs_and_is_recorded_succeeded(azurite, 3, lambda worker, calls: len(calls) >= 5)


async def test_a_success_whose_delete_landed_before_an_outage_longer_than_every_try_is_recorded(azurite):
    """The outage outlasts the settler's five tries (four deletes each): it gives the settlement up.
    The message ran and is gone from its queue, so no later run records it: the settlement is recorded
    by compare-and-set (the history stayed Pending for good; found in review)."""
    await _runs_and_is_recorded_succeeded(
        azurite, 10**6, lambda worker, calls: worker.settler.unsettled == 0 and len(calls) >= 20
    )


async def test_a_dead_letter_whose_delete_landed_unanswered_is_recorded_dead_lettered(azurite):
    """The letter is in -poison; the settler's next try renewed the lease first (gone: 404) and was
    refused, so no listing said DeadLettered."""
    ran: list[int] = []
    rt = await _runtime(azurite, ran)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        calls = _lands_then_outage(p.client(p.physical("lost.delete")), unanswered=3)
        receipt = await rt.app.enqueue(Job(n=2, fail=True))
        async with running(rt):
            await wait_until(lambda: len(calls) >= 4, timeout=60, what="the provider's tries")
            await wait_until(
                lambda: _status(rt, receipt.message_id, MessageStatus.DEAD_LETTERED),
                timeout=20,
                what="DeadLettered",
            )
        assert ran == [2]
        assert await p.depth("lost.delete") == 0
        assert await p.depth("lost.delete", poison=True) == 1
    finally:
        await _drop(rt, "lost.delete", "lost.short")


async def test_a_batch_member_whose_delete_landed_unanswered_is_recorded(azurite):
    """Another message of the batch settles, so the call succeeds and the failed one counts as
    refused: it may be gone (its delete landed), and then no later run records it."""
    rt = await _runtime(azurite)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        await rt.app.enqueue_many([Job(n=1), Job(n=2)])
        sub = rt.app.subscription(Job.type_name())
        assert sub is not None
        ds = await p.receive(sub, 2)
        assert len(ds) == 2
        victim = ds[0].handle.id
        calls = _lands_then_outage(p.client(p.physical("lost.delete")), unanswered=10, only=victim.__eq__)
        settlements = [await rt.process(d) for d in ds]
        ahead = rt.history_ahead(settlements)
        await p.settle(settlements)  # (as the worker's settler: the batch in one call)
        rt.history_applied(settlements, ahead)
        await rt.record(settlements, ahead)
        assert calls[0] == "landed, answer lost"
        assert await p.depth("lost.delete") == 0
        assert ds[0].envelope is not None
        assert await _status(rt, ds[0].envelope.message_id, MessageStatus.SUCCEEDED)
    finally:
        await _drop(rt, "lost.delete", "lost.short")


async def test_past_the_hold_a_gone_message_is_recorded_unless_a_later_run_recorded_its_own(azurite):
    """The settler's next try comes after the run's hold ended: the 404 may be a later run's removal,
    so the settlement is refused and marked unconfirmed; with no later run's record, this run's
    outcome is recorded (the message is gone: nobody else would record it)."""
    rt = await _runtime(azurite)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        receipt = await rt.app.enqueue(Short(n=1))
        sub = rt.app.subscription(Short.type_name())
        assert sub is not None
        [d] = await p.receive(sub, 1)
        _lands_then_outage(d.handle.queue_client, unanswered=3)
        s = Settlement(d, Complete())
        with pytest.raises(ProviderUnavailable):  # every try of this call went unanswered
            await p.settle([s])
        await asyncio.sleep(max(0.0, (d.handle.hidden_until - utcnow()).total_seconds()) + 0.5)
        await p.settle([s])  # the settler's next try, past the hold
        assert d.refused
        assert d.unconfirmed
        await rt.record([s])
        assert await _status(rt, receipt.message_id, MessageStatus.SUCCEEDED)
    finally:
        await _drop(rt, "lost.delete", "lost.short")


async def _status(rt: Runtime, message_id: uuid.UUID, want: MessageStatus) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == want
