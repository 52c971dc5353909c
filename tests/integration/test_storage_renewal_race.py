"""Storage Queues: a lease renewal and the settlement of the same message take turns. A renewal
replaces the pop receipt; a delete sent with the receipt it replaces would fail and leave the message
to come back, though its handler succeeded."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.errors import ProviderError
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("race.renewal")
class Job(QueueMessage):
    n: int


async def _runtime(azurite, message: type[QueueMessage] = Job, tag: str | None = None) -> Runtime:
    """A host on Azurite; hosts given one ``tag`` share their queues and tables."""
    from queueing_core import QueueNaming

    tag = tag or uuid.uuid4().hex[:8]
    app = QueueingApp("race", naming=QueueNaming(prefix=f"t{tag}-"))
    app.message(message)
    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"ctl{tag}", tracker_table=f"hist{tag}"
    )
    rt = Runtime(app, provider)
    await rt.open()
    return rt


async def _drop_queues(provider: StorageQueueProvider, queue: str) -> None:
    for name in (provider.physical(queue), provider.poison_name(queue)):
        await provider.client(name).delete_queue()


async def _two_hosts(azurite, message: type[QueueMessage]) -> tuple[Runtime, Runtime]:
    tag = uuid.uuid4().hex[:8]
    return await _runtime(azurite, message, tag), await _runtime(azurite, message, tag)


async def _holder_dead_letters(holder: Runtime, message: type[QueueMessage]) -> None:
    """The message's current holder receives it and dead-letters it (settled and recorded)."""
    from queueing_core.decisions import DeadLetter, DeadLetterReason

    [current] = await holder.provider.receive(holder.app.subscription(message.type_name()), 1)
    held = Settlement(current, DeadLetter(DeadLetterReason.NON_RETRYABLE, "the holder's outcome"))
    await holder.provider.settle([held])
    await holder.record([held])


async def test_a_settlement_during_a_renewal_uses_the_renewed_receipt(azurite):
    rt = await _runtime(azurite)
    provider = rt.provider
    app = rt.app
    try:
        await app.enqueue(Job(n=1))
        sub = app.subscription(Job.type_name())
        assert sub is not None
        [d] = await provider.receive(sub, 1)
        client = d.handle.queue_client
        real_update = client.update_message
        renewed = asyncio.Event()

        async def slow_answer(*args, **kwargs):
            answer = await real_update(*args, **kwargs)
            if not renewed.is_set():  # the service has replaced the receipt; the answer is still on its way
                renewed.set()
                await asyncio.sleep(0.5)
            return answer

        client.update_message = slow_answer
        renewal = asyncio.create_task(provider.renew([d]))
        await renewed.wait()
        await provider.settle([Settlement(d, Complete())])
        assert await renewal == []
        assert not d.refused, "the delete was sent with a receipt the renewal had replaced"
        props = await client.get_queue_properties()
        assert props.approximate_message_count == 0, "the message is still in the queue"
    finally:
        await _drop_queues(provider, "race.renewal")
        await rt.close()


async def test_a_delete_whose_answer_was_lost_is_not_taken_for_a_lost_lease(azurite):
    """The delete reaches the service, the answer does not come back; the next try finds the message
    gone (404). That is this run's own delete: the outcome stands and its history is written."""
    from azure.core.exceptions import ServiceResponseError

    from queueing_core import MessageStatus

    rt = await _runtime(azurite)
    provider = rt.provider
    app = rt.app
    try:
        receipt = await app.enqueue(Job(n=1))
        sub = app.subscription(Job.type_name())
        assert sub is not None
        [d] = await provider.receive(sub, 1)
        client = d.handle.queue_client
        real_delete = client.delete_message
        lost: list[bool] = []

        async def answer_lost(*args, **kwargs):
            answer = await real_delete(*args, **kwargs)
            if not lost:
                lost.append(True)
                raise ServiceResponseError("Connection reset by peer")
            return answer

        client.delete_message = answer_lost
        s = Settlement(d, Complete())
        for _ in range(5):  # the worker's settler tries a failed settlement again
            try:
                await provider.settle([s])
                break
            except Exception:
                continue
        await rt.record([s])
        assert lost
        assert not d.refused, "the run's own delete was taken for a lost lease"
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.SUCCEEDED
    finally:
        await _drop_queues(provider, "race.renewal")
        await rt.close()


async def test_a_settlement_that_failed_leaves_the_lease_renewed_until_it_is_tried_again(azurite):
    """The lease is renewed until the settlement is committed: a delete that failed (the service did
    not answer) left the handle marked settled, so the renewals while the worker tried again were
    skipped and the message could come back and run again (found in review)."""
    from azure.core.exceptions import ServiceRequestError

    rt = await _runtime(azurite)
    provider = rt.provider
    app = rt.app
    try:
        await app.enqueue(Job(n=3))
        sub = app.subscription(Job.type_name())
        assert sub is not None
        [d] = await provider.receive(sub, 1)
        client = d.handle.queue_client
        real_delete = client.delete_message

        async def unreachable(*args, **kwargs):
            raise ServiceRequestError("connection refused")  # never sent

        client.delete_message = unreachable
        with pytest.raises(ProviderError):  # the worker's settler tries it again
            await provider.settle([Settlement(d, Complete())])
        before = d.lease_until
        await asyncio.sleep(0.01)
        assert await provider.renew([d]) == []
        assert d.lease_until > before, "the lease was not renewed while the settlement waits to be tried"
        client.delete_message = real_delete
        await provider.settle([Settlement(d, Complete())])
        assert not d.refused
        props = await client.get_queue_properties()
        assert props.approximate_message_count == 0
    finally:
        await _drop_queues(provider, "race.renewal")
        await rt.close()


@queue("race.stale", lease_duration=timedelta(seconds=1))
class Short(QueueMessage):
    n: int


async def test_a_stale_runs_delete_does_not_take_the_current_holders_removal_for_its_own(azurite):
    """A run whose lease lapsed settles Complete; its first delete never reaches the service, and
    meanwhile the message's current holder dead-letters it. The next try finds the message gone (404):
    that is not this run's delete, so its outcome is refused and the holder's stands (before, the
    stale run's Succeeded was written over the dead letter, which then stood in no listing)."""
    from azure.core.exceptions import ServiceRequestError

    from queueing_core import MessageStatus

    a, b = await _two_hosts(azurite, Short)
    try:
        receipt = await a.app.enqueue(Short(n=1))
        [stale] = await a.provider.receive(a.app.subscription(Short.type_name()), 1)
        await asyncio.sleep(2.2)  # its lease (1 s) lapses, unrenewed
        client = stale.handle.queue_client
        real_delete = client.delete_message
        tries: list[int] = []

        async def never_sent_while_the_holder_settles(*args, **kwargs):
            tries.append(1)
            if len(tries) == 1:
                await _holder_dead_letters(b, Short)
                raise ServiceRequestError("connection refused")
            return await real_delete(*args, **kwargs)

        client.delete_message = never_sent_while_the_holder_settles
        s = Settlement(stale, Complete())
        await a.provider.settle([s])
        await a.record([s])
        assert len(tries) == 2
        assert stale.refused, "the stale run's delete took the holder's removal for its own"
        rec = await a.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
        assert await a.provider.depth("race.stale", poison=True) == 1
    finally:
        await _drop_queues(a.provider, "race.stale")
        await a.close()
        await b.close()


@pytest.mark.parametrize("decision", ["defer", "dead-letter"])
async def test_a_settlement_tried_again_after_a_failed_delete_sends_its_copy_once(azurite, decision):
    """A deferral (a fresh copy) or a dead letter is sent, then the original's delete fails (the
    service unreachable for all its tries); the worker's settler tries the settlement again. Each try
    sent another copy (a review found it: up to five live copies, each of which ran), or another dead
    letter. The next try goes on from the delete."""
    from azure.core.exceptions import ServiceRequestError

    from queueing_core.clock import utcnow
    from queueing_core.decisions import DeadLetter, DeadLetterReason, Defer
    from queueing_core.messages import MessageStatus

    rt = await _runtime(azurite)
    provider = rt.provider
    app = rt.app
    try:
        await app.enqueue(Job(n=4))
        sub = app.subscription(Job.type_name())
        assert sub is not None
        [d] = await provider.receive(sub, 1)
        client = d.handle.queue_client
        real_delete = client.delete_message

        async def unreachable(*args, **kwargs):
            raise ServiceRequestError("connection refused")

        if decision == "defer":
            outcome = Defer(utcnow() + timedelta(hours=1), MessageStatus.PAUSED, "queue paused")
        else:
            outcome = DeadLetter(DeadLetterReason.NON_RETRYABLE, "refused")
        s = Settlement(d, outcome)
        client.delete_message = unreachable
        for _ in range(2):  # the settler's first two tries fail at the delete
            with pytest.raises(ProviderError):
                await provider.settle([s])
        client.delete_message = real_delete
        await provider.settle([s])
        assert not d.refused
        # the original is gone; exactly one copy (hidden for the hour) or one dead letter
        live = await client.get_queue_properties()
        poison = await provider.client(provider.poison_name("race.renewal")).get_queue_properties()
        copies = (live.approximate_message_count, poison.approximate_message_count)
        assert copies == ((1, 0) if decision == "defer" else (0, 1)), copies
    finally:
        await _drop_queues(provider, "race.renewal")
        await rt.close()


@queue("race.slow", lease_duration=timedelta(seconds=3))
class Slow(QueueMessage):
    n: int


async def test_a_delete_retry_that_reaches_the_service_after_the_lease_is_not_taken_for_its_own(azurite):
    """The first delete never reaches the service; the retry leaves well within the lease but takes
    seconds to arrive (a new connection's handshake), by when the lease has ended and the next holder
    has dead-lettered the message. Its 404 was taken for the run's own delete while the retry had
    left 2 s before the lease's end (a review found it); what counts is when the answer came."""
    from azure.core.exceptions import ServiceRequestError

    from queueing_core import MessageStatus

    a, b = await _two_hosts(azurite, Slow)
    try:
        receipt = await a.app.enqueue(Slow(n=1))
        [first] = await a.provider.receive(a.app.subscription(Slow.type_name()), 1)
        client = first.handle.queue_client
        real_delete = client.delete_message
        tries: list[int] = []

        async def unsent_then_slow_to_arrive(*args, **kwargs):
            tries.append(1)
            if len(tries) == 1:
                raise ServiceRequestError("connection refused")  # never sent
            await asyncio.sleep(3.5)  # on its way while the lease ends
            await _holder_dead_letters(b, Slow)
            return await real_delete(*args, **kwargs)

        client.delete_message = unsent_then_slow_to_arrive
        s = Settlement(first, Complete())
        await a.provider.settle([s])
        await a.record([s])
        assert len(tries) == 2
        assert first.refused, "a 404 answered after the lease ended was taken for the run's own delete"
        rec = await a.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
    finally:
        await _drop_queues(a.provider, "race.slow")
        await a.close()
        await b.close()
