"""The Service Bus provider on the in-memory Service Bus: entity settings,
dead-letter reasons, attempts that pauses do not burn, locks, size limits, ops on the native DLQ."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue

from queueing_core import (
    MessageStatus,
    MessageTooLarge,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    RetryPolicy,
    queue,
)
from queueing_core.connections import ServiceBusConnection
from queueing_core.errors import ConfigurationError
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking import MessageQuery
from tests.contract.harness import all_have, ops_client, running, wait_until


@queue(
    "Payments/Capture",
    max_attempts=3,
    lease_duration=timedelta(seconds=20),
    expiration=timedelta(hours=2),
    retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0),
)
class Capture(QueueMessage):
    amount: int
    mode: str = "ok"  # ok | fail | fatal | slow


#: the card processor's state: tests "fix" it to show a retried dead letter succeeding
processor = {"declines": True}


def make(ns=None, **kw):
    app = QueueingApp("sb")
    calls: list[tuple[int, int]] = []
    processor["declines"] = True

    @app.handler()
    async def handle(msg: Capture, ctx) -> None:
        calls.append((msg.amount, ctx.attempt))
        if msg.mode == "fail":
            raise ConnectionError("gateway down")
        if msg.mode == "fatal" and processor["declines"]:
            raise NonRetryableError("card declined")
        if msg.mode == "slow":
            await asyncio.sleep(2.5)

    ns = ns or FakeServiceBusNamespace()
    rt = in_memory_servicebus(app, ns, provider_options={"receive_wait": 0.1}, **kw)
    return app, rt, ns, calls


async def dead_letters(ns, rt, queue="Payments/Capture"):
    async with rt.provider.client.get_queue_receiver(
        rt.provider.physical(queue), sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as r:
        return await r.peek_messages(max_message_count=50)


async def test_queues_are_created_with_the_types_settings():
    _app, rt, _ns, _ = make()
    await rt.open()
    props = await rt.provider.admin.get_queue("Payments/Capture")
    assert props.max_delivery_count == 4  # its 3 attempts, and a delivery for the kit's dead letter
    assert props.lock_duration == timedelta(seconds=20)
    assert props.dead_lettering_on_message_expiration is True
    assert props.default_message_time_to_live == timedelta(hours=3)  # expiration + grace
    assert props.requires_duplicate_detection is False  # only idempotent types turn it on
    await rt.close()


async def test_the_queue_of_an_idempotent_type_detects_duplicate_message_ids():
    @queue("sb-versions", idempotent=True, identity="key")
    class Version(QueueMessage):
        key: str
        n: int

    app = QueueingApp("sb-dedup")
    app.message(Version)
    rt = in_memory_servicebus(app, FakeServiceBusNamespace())
    await rt.open()
    props = await rt.provider.admin.get_queue(rt.provider.physical("sb-versions"))
    assert props.requires_duplicate_detection is True
    await rt.close()


@pytest.mark.parametrize("idempotent", [True, False])
async def test_the_sdk_asks_the_service_for_duplicate_detection_on_an_idempotent_types_queue(idempotent):
    """Held against the real azure-servicebus administration client: the settings the provider passes
    to ``create_queue`` become the SDK's ``QueueDescription``, serialized as the service receives it
    (only the HTTP call is replaced, to keep the request)."""
    from xml.etree import ElementTree

    from azure.core.exceptions import ResourceExistsError
    from azure.servicebus.aio.management import ServiceBusAdministrationClient

    @queue("sb-versions-sdk", idempotent=idempotent, identity="key" if idempotent else None)
    class Versioned(QueueMessage):
        key: str

    app = QueueingApp("sb-dedup-sdk")
    app.message(Versioned)
    rt = in_memory_servicebus(app, FakeServiceBusNamespace())
    sdk = ServiceBusAdministrationClient.from_connection_string(
        "Endpoint=sb://example.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=a2V5"
    )
    requests: list[tuple[str, ElementTree.Element]] = []

    async def put(name, body, **kwargs):
        requests.append((name, body))
        raise ResourceExistsError("the queue exists")  # what an existing queue answers: tolerated

    sdk._impl.entity.put = put
    rt.provider.admin = sdk
    sub = app.subscription("Versioned")
    assert sub is not None
    await rt.provider._create_queue(sub)
    ((name, body),) = requests
    assert name == rt.provider.physical("sb-versions-sdk")
    found = [e.text for e in body.iter() if e.tag.endswith("}RequiresDuplicateDetection")]
    assert found == (["true"] if idempotent else [])  # left out: the service's default, off
    await sdk.close()


async def test_dead_letter_reasons_in_the_native_sub_queue():
    app, rt, ns, calls = make()
    await rt.open()
    failing = await app.enqueue(Capture(amount=1, mode="fail"))
    fatal = await app.enqueue(Capture(amount=2, mode="fatal"))
    expired = await app.enqueue(Capture(amount=3), ttl=timedelta(milliseconds=300))
    async with rt.provider.client.get_queue_sender(rt.provider.physical("Payments/Capture")) as s:
        await s.send_messages(ServiceBusMessage("definitely not an envelope"))
    await asyncio.sleep(0.4)
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [failing.message_id, fatal.message_id], MessageStatus.DEAD_LETTERED)
        )
        await wait_until(lambda: all_have(rt, [expired.message_id], MessageStatus.EXPIRED))
        await wait_until(lambda: _dlq_count(ns, rt, 4), what="four dead letters")
    reasons = {str(m): m.dead_letter_reason for m in await dead_letters(ns, rt)}
    by_reason = sorted(reasons.values())
    assert by_reason == ["Expired", "MalformedEnvelope", "MaxDeliveryAttemptsExceeded", "NonRetryable"]
    assert [a for amount, a in calls if amount == 1] == [1, 2, 3]  # backoff copies, counted attempts
    malformed = [
        r
        for r in (await rt.tracker.query(MessageQuery(status=("DeadLettered",)))).items
        if r.reason == "malformed-envelope"
    ]
    assert malformed[0].raw == "definitely not an envelope"
    await rt.close()


async def _dlq_count(ns, rt, n):
    return len(await dead_letters(ns, rt)) >= n


async def test_pausing_never_burns_the_entitys_delivery_count():
    """Abandon would raise delivery_count and, at max delivery count, dead-letter a paused message.
    The kit re-schedules a copy instead: after many pause rechecks the message still runs at attempt 1."""
    app, rt, ns, calls = make(pause_recheck=timedelta(milliseconds=50), control_ttl=0.01)
    await rt.open()
    r = await app.enqueue(Capture(amount=7))
    await rt.control.set_paused("type", "Capture", True)
    async with running(rt, pause_poll=0.02):
        # the worker holds off a paused type; force deliveries anyway (a race with another host)
        for _ in range(8):
            [d] = await rt.provider.receive(app.subscription("Capture"), 1) or [None]
            if d is not None:
                await rt.process_and_settle(d)
            await asyncio.sleep(0.06)
        assert calls == []
        await rt.control.set_paused("type", "Capture", False)
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="resume")
    assert calls == [(7, 1)]
    assert len(await dead_letters(ns, rt)) == 0
    await rt.close()


async def test_long_handlers_keep_their_lock_by_renewal():
    # the renewer looks every lease/3 (2 s) and renews what has less than 2 x that left: a renewal
    # comes with 2-4 s of the lease left (a 3 s lease left 1-2 s, and a stalled event loop on a
    # loaded machine lost it)
    @queue("long-jobs", lease_duration=timedelta(seconds=6))
    class Long(QueueMessage):
        pass

    app = QueueingApp("sb-long")
    ran: list[int] = []

    @app.handler()
    async def h(msg: Long, ctx) -> None:
        ran.append(ctx.attempt)
        await asyncio.sleep(7.5)  # past the 6 s lock: only renewal keeps it

    rt = in_memory_servicebus(app, provider_options={"receive_wait": 0.1})
    r = await app.enqueue(Long())
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), timeout=60)
    assert ran == [1]
    await rt.close()


async def test_lock_loss_is_logged_and_not_settled_twice(caplog):
    clock = FakeClock()
    ns = FakeServiceBusNamespace(clock=clock)
    app, rt, ns, _calls = make(ns)
    await rt.open()
    await app.enqueue(Capture(amount=9))
    [d] = await rt.provider.receive(app.subscription("Capture"), 1)
    clock.advance(timedelta(seconds=30))  # the 20 s lock expired while the handler ran
    [again] = await rt.provider.receive(app.subscription("Capture"), 1)  # another consumer takes it
    with caplog.at_level(logging.WARNING, logger="queueing.settle"):
        await rt.process_and_settle(d)
    assert "lease lost on" in caplog.text
    assert d.refused
    assert not d.unconfirmed  # the message is still in its queue, locked by the other consumer
    await rt.process_and_settle(again)  # the new owner settles normally
    runtime = await rt.provider.admin.get_queue_runtime_properties("Payments/Capture")
    assert runtime.active_message_count == 0
    assert runtime.dead_letter_message_count == 0
    await rt.close()


async def _received_twice() -> tuple[Any, Any, Any, Any, Any]:
    """A message that the first run (whose card is declined: it dead-letters) received, whose 20 s
    lock then lapsed, and that a second run (the card goes through) received after it."""
    clock = FakeClock()
    app, rt, ns, _calls = make(FakeServiceBusNamespace(clock=clock))
    await rt.open()
    receipt = await app.enqueue(Capture(amount=9, mode="fatal"))
    sub = app.subscription("Capture")
    [first] = await rt.provider.receive(sub, 1)
    clock.advance(timedelta(seconds=30))  # the lock expired while the first run went on
    [second] = await rt.provider.receive(sub, 1)
    processor["declines"] = False
    return ns, rt, receipt.message_id, first, second


async def test_a_stale_runs_settlement_after_the_message_left_the_queue_never_replaces_the_later_record():
    """A refused settlement whose message is no longer in its queue may be this run's own, applied by
    an earlier try whose answer was lost; so its outcome is recorded, but never over the record of a
    later run: here the lock lapsed, another consumer ran the message and completed it, and only then
    does the first run (which would dead-letter it) settle."""
    ns, rt, message_id, first, second = await _received_twice()
    await rt.process_and_settle(second)  # the second run succeeds and completes the message
    assert await rt.history.settle(10)
    processor["declines"] = True
    # the first run's dead-lettering: the lock is gone, and so is the message
    await rt.process_and_settle(first)
    assert first.refused
    assert first.unconfirmed
    assert await rt.history.settle(10)
    rec = await rt.tracker.get(message_id)
    assert rec is not None
    assert (rec.status, rec.attempt) == ("Succeeded", 2)
    assert await dead_letters(ns, rt) == []
    await rt.close()


async def test_a_stale_runs_record_written_first_gives_way_to_the_later_runs_late_record():
    """The other order: the later run's record lands after the first run's (its history write was
    late, and such a record is written by the late write's rule, newest by time). The first run's
    record is dated when it received the message, before its lock lapsed and the later run received
    it, so the later run's record replaces it."""
    from queueing_core.runtime import history_record

    _ns, rt, message_id, first, second = await _received_twice()
    later = await rt.process(second)
    await rt.provider.settle([later])  # the message is completed; its record not yet written
    late_record = history_record(later, rt.clock())
    processor["declines"] = True
    await rt.process_and_settle(first)
    assert first.unconfirmed
    assert await rt.history.settle(10)
    stale = await rt.tracker.get(message_id)
    assert stale is not None
    assert (stale.status, stale.updated_at) == ("DeadLettered", first.received_at)
    await rt.tracker.upsert_newer([late_record])  # as the history backlog writes a late record
    rec = await rt.tracker.get(message_id)
    assert rec is not None
    assert (rec.status, rec.attempt) == ("Succeeded", 2)
    await rt.close()


async def _settle_as_a_worker(rt, *settlements) -> None:
    """Settle and record as the worker's settler does: history journaled ahead, then the transport."""
    ahead = rt.history_ahead(list(settlements))
    await rt.provider.settle(list(settlements))
    rt.history_applied(list(settlements), ahead)
    await rt.record(list(settlements), ahead)
    assert await rt.history.settle(10)


async def test_a_stale_success_never_replaces_a_later_runs_pause_of_the_same_attempt():
    """A later run that uses no attempt (a paused type's wait by copy) records the first run's attempt
    number: the first run's success, refused with the message gone (the original completed by the
    pause's copy), must not replace that record while the paused copy waits in the queue. (Found by
    review: the attempt alone let it.)"""
    clock = FakeClock()
    app, rt, _ns, _calls = make(FakeServiceBusNamespace(clock=clock), control_ttl=0.0)
    await rt.open()
    receipt = await app.enqueue(Capture(amount=1))
    sub = app.subscription("Capture")
    [first] = await rt.provider.receive(sub, 1)
    success = await rt.process(first)  # the handler ran: Complete, not settled yet
    clock.advance(timedelta(seconds=30))  # the first run's lock lapses
    await rt.control.set_paused("type", "Capture", True)
    [second] = await rt.provider.receive(sub, 1)
    await rt.process_and_settle(second)  # paused: a copy waits in the queue, the original completed
    assert await rt.history.settle(10)
    await _settle_as_a_worker(rt, success)
    assert first.unconfirmed  # the original is gone
    rec = await rt.tracker.get(receipt.message_id)
    assert rec is not None
    assert rec.status == "Paused"
    props = await rt.provider.admin.get_queue_runtime_properties("Payments/Capture")
    assert props.scheduled_message_count + props.active_message_count == 1
    await rt.close()


async def test_a_stale_success_never_replaces_the_progress_of_a_copy_running_now():
    """The run of a paused wait's copy reports progress with the first run's attempt number: the first
    run's success, refused with the original gone, must not replace that report while the copy runs.
    (Found by review: a progress report was taken for the first run's own.)"""
    clock = FakeClock(datetime.now(UTC))  # (the copy is scheduled by the host's clock)
    app, rt, _ns, _calls = make(FakeServiceBusNamespace(clock=clock), control_ttl=0.0)
    await rt.open()
    receipt = await app.enqueue(Capture(amount=1))
    sub = app.subscription("Capture")
    [first] = await rt.provider.receive(sub, 1)
    success = await rt.process(first)
    clock.advance(timedelta(seconds=30))  # the first run's lock lapses
    await rt.control.set_paused("type", "Capture", True)
    [second] = await rt.provider.receive(sub, 1)
    await rt.process_and_settle(second)  # paused: a copy waits, the original completed
    await rt.control.set_paused("type", "Capture", False)
    clock.advance(timedelta(minutes=5))
    [copy] = await rt.provider.receive(sub, 1)  # the copy, running now
    await rt.store_progress(copy, {"step": 1, "total": 10})
    assert await rt.history.settle(10)
    await _settle_as_a_worker(rt, success)
    assert first.unconfirmed
    rec = await rt.tracker.get(receipt.message_id)
    assert rec is not None
    assert rec.status == "Leased"
    assert rec.progress is not None
    await rt.close()


async def _batch_with_a_lost_answer(*, peek_fails: bool = False) -> tuple[Any, list[Any], list[Any]]:
    """Two messages received and run; settled as a worker does, in one batch, where Service Bus applies
    the first one's completion but its answer is lost (and, with ``peek_fails``, the look into the queue
    that follows fails too). Returns the runtime, the receipts and the deliveries."""
    from azure.servicebus.exceptions import OperationTimeoutError, ServiceBusConnectionError

    app, rt, _ns, _calls = make()
    await rt.open()
    receipts = [await app.enqueue(Capture(amount=n)) for n in (3, 4)]
    deliveries = await rt.provider.receive(app.subscription("Capture"), 2)
    assert len(deliveries) == 2
    settlements = [await rt.process(d) for d in deliveries]
    receiver = deliveries[0].handle.receiver
    complete = receiver.complete_message
    lost = deliveries[0].handle.message.sequence_number

    async def answer_lost(m):
        await complete(m)
        if m.sequence_number == lost:
            raise OperationTimeoutError(message="injected: the answer did not come back")

    async def unreachable(*args, **kwargs):
        raise ServiceBusConnectionError(message="injected: the AMQP link was detached")

    receiver.complete_message = answer_lost
    if peek_fails:
        receiver.peek_messages = unreachable
    await _settle_as_a_worker(rt, *settlements)
    return rt, receipts, deliveries


async def test_a_completion_whose_answer_was_lost_in_a_batch_that_partly_settled_is_recorded():
    """A batch of which some settled is not tried again: a completion among the rest that Service Bus
    applied but whose answer was lost is found gone from the queue and recorded. (Found by review: the
    history stayed Pending for good.)"""
    rt, receipts, deliveries = await _batch_with_a_lost_answer()
    assert [d.refused for d in deliveries] == [True, False]
    assert deliveries[0].unconfirmed
    assert [(await rt.tracker.get(r.message_id)).status for r in receipts] == ["Succeeded", "Succeeded"]
    await rt.close()


async def test_a_look_into_the_queue_that_fails_leaves_the_refusal_as_it_was():
    """The check's own step failing (the peek: Service Bus unreachable again) settles nothing else
    differently and raises nothing: the refusal stands, unconfirmed, and the batch's other
    settlement is recorded; the lost one's history stays at its last record, as documented."""
    rt, receipts, deliveries = await _batch_with_a_lost_answer(peek_fails=True)
    assert [d.refused for d in deliveries] == [True, False]
    assert not deliveries[0].unconfirmed
    statuses = [(await rt.tracker.get(r.message_id)).status for r in receipts]
    assert statuses == ["Pending", "Succeeded"]
    await rt.close()


async def test_an_oversize_message_is_refused_before_any_send():
    app, rt, _ns, _ = make()
    await rt.open()
    with pytest.raises(MessageTooLarge, match="servicebus accepts at most"):
        await app.enqueue_many([Capture(amount=1), Capture(amount=2, mode="x" * 300_000)])
    props = await rt.provider.admin.get_queue_runtime_properties("Payments/Capture")
    assert props.total_message_count == 0
    await rt.close()


async def test_ops_native_counts_and_the_dead_letter_queue():
    app, rt, ns, calls = make()
    async with ops_client(rt) as client:
        dead = await app.enqueue(Capture(amount=5, mode="fatal"))
        await app.enqueue(Capture(amount=6), delay=timedelta(hours=1))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [dead.message_id], MessageStatus.DEAD_LETTERED))
        [q] = (await client.get("/stats")).json()["queues"]
        assert q["transport_counts"] == {"active": 0, "scheduled": 1, "dead_lettered": 1}
        assert (await client.post(f"/messages/{dead.message_id}/lease/release")).status_code == 409
        # the processor is fixed: retry takes it out of the DLQ and runs it with fresh attempts
        processor["declines"] = False
        calls.clear()
        assert (await client.post(f"/messages/{dead.message_id}/retry")).status_code == 200
        assert len(await dead_letters(ns, rt)) == 0
        async with running(rt):
            await wait_until(lambda: all_have(rt, [dead.message_id], MessageStatus.SUCCEEDED))
        assert calls == [(5, 1)]
        # purge dead letters
        processor["declines"] = True
        again = await app.enqueue(Capture(amount=8, mode="fatal"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [again.message_id], MessageStatus.DEAD_LETTERED))
        purged = (await client.request("DELETE", "/messages", params={"status": "DeadLettered"})).json()
        assert purged["deleted"] == 1
        assert len(await dead_letters(ns, rt)) == 0
    await rt.close()


def test_connection_settings_are_read_like_the_functions_host_does():
    with pytest.raises(ConfigurationError) as info:
        ServiceBusConnection.from_environment(env={})
    assert str(info.value).startswith("QueueingServiceBus: not set")
    identity = ServiceBusConnection.from_environment(
        env={
            "QueueingServiceBus__fullyQualifiedNamespace": "ns.servicebus.windows.net",
            "QueueingServiceBus__clientId": "abc",
        }
    )
    assert identity.connection_string is None
    assert identity.fully_qualified_namespace == "ns.servicebus.windows.net"
    emulator = ServiceBusConnection.from_environment(
        env={
            "QueueingServiceBus": "Endpoint=sb://localhost;SharedAccessKeyName=x;SharedAccessKey=y;"
            "UseDevelopmentEmulator=true;"
        }
    )
    assert emulator.connection_string.endswith("UseDevelopmentEmulator=true;")
