"""On Service Bus a message cannot outlive its queue's time to live, so the kit refuses one that would.

The service caps a message's time to live at its queue's ``defaultMessageTimeToLive`` without a word
(ServiceBusMessage.TimeToLive: "a message-level TimeToLive value cannot be longer than the entity's
DefaultTimeToLive setting and it is silently adjusted"). The kit gives a queue its type's expiration plus
the grace (infra/modules/servicebus.bicep through `queueing infra params`, and the runtime when it
creates a queue). An ``enqueue(..., ttl=...)`` or ``expires_at=`` beyond the type's expiration was
accepted, and the broker expired and dead-lettered the message long before the expiry the kit recorded,
its history left Pending. It is refused at ``enqueue`` now, before anything is sent. The in-memory
Service Bus applies the cap as the service does.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessageState, ServiceBusSubQueue

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.fakes.servicebus import (
    FakeClock,
    FakeServiceBusAdministrationClient,
    FakeServiceBusNamespace,
)
from queueing_core.testing import in_memory_servicebus, run_until_idle


@queue("sb-ttl-capped", expiration=timedelta(hours=2))
class Ping(QueueMessage):
    n: int


@queue("sb-ttl-forever", expiration=None)
class Forever(QueueMessage):
    n: int


async def _runtime(clock: FakeClock):
    app = QueueingApp("sb-ttl")

    @app.handler()
    async def ping(msg: Ping) -> None:
        pass

    @app.handler()
    async def forever(msg: Forever) -> None:
        pass

    rt = in_memory_servicebus(
        app, FakeServiceBusNamespace(clock=clock), provider_options={"receive_wait": 0.1}
    )
    await rt.open()  # creates the queues as the Bicep does: 2 h + 1 h, and never for Forever
    return app, rt


async def _peek(rt, queue: str, sub_queue: ServiceBusSubQueue | None = None) -> list:
    async with rt.provider.client.get_queue_receiver(rt.provider.physical(queue), sub_queue=sub_queue) as r:
        return list(await r.peek_messages(max_message_count=10))


@pytest.mark.parametrize(
    "options",
    [{"ttl": timedelta(days=1)}, {"ttl": 3 * 3600}, {"expires_at": "in a day"}],
    ids=["ttl", "ttl-seconds", "expires_at"],
)
async def test_an_expiry_past_the_queues_time_to_live_is_refused_before_anything_is_sent(options):
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime(clock)
    try:
        if options.get("expires_at") == "in a day":
            options = {"expires_at": datetime.now(UTC) + timedelta(days=1)}
        with pytest.raises(InvalidArgument, match="outlast") as err:
            await app.enqueue(Ping(n=1), **options)
        says = str(err.value)
        assert "sb-ttl-capped" in says, says  # the queue
        assert "2:00:00" in says, says  # and the type's expiration, the longest ttl it takes
        # nothing was sent and nothing recorded: the caller sees the refusal, nothing is lost
        assert await _peek(rt, "sb-ttl-capped") == []
        assert await rt.tracker.counts() == {}
        # one refused in a batch refuses the batch, before any of it is sent
        with pytest.raises(InvalidArgument, match="outlast"):
            await app.enqueue_many([Ping(n=2), Ping(n=3)], ttl=timedelta(hours=5))
        assert await _peek(rt, "sb-ttl-capped") == []
    finally:
        await rt.close()


async def test_an_expiry_within_the_queues_time_to_live_lives_as_long_as_the_kit_says():
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime(clock)
    try:
        longest = await app.enqueue(Ping(n=1), ttl=timedelta(hours=2))  # the type's expiration: accepted
        assert longest.expires_at is not None
        clock.advance(timedelta(hours=1, minutes=50))  # a backlog, well inside the two hours
        got = await rt.provider.receive(app.subscription("Ping"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [longest.message_id]
        assert await _peek(rt, "sb-ttl-capped", ServiceBusSubQueue.DEAD_LETTER) == []
    finally:
        await rt.close()


async def test_a_type_that_never_expires_takes_any_expiry():
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime(clock)
    try:
        sent = await app.enqueue(Forever(n=1), ttl=timedelta(days=30))  # its queue never expires messages
        clock.advance(timedelta(days=20))
        got = await rt.provider.receive(app.subscription("Forever"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [sent.message_id]
    finally:
        await rt.close()


async def test_a_delayed_message_whose_life_after_its_due_time_fits_is_accepted_and_runs():
    """A scheduled message's time to live runs from its scheduled time: a delay past the type's
    expiration, with a later expiry to match (what the docs ask of such a delay), fits its queue's
    time to live and was refused as if it ran from now (found in review)."""
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime(clock)
    try:
        later = await app.enqueue(Ping(n=1), delay=timedelta(hours=3), ttl=timedelta(hours=4))
        clock.advance(timedelta(hours=3, minutes=30))
        got = await rt.provider.receive(app.subscription("Ping"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [later.message_id]
        # its life after the due time is still capped: 3 hours after it, with the grace, is refused
        with pytest.raises(InvalidArgument, match="outlast"):
            await app.enqueue(Ping(n=2), delay=timedelta(hours=3), ttl=timedelta(hours=6))
    finally:
        await rt.close()


# --- a time to live longer than a message can carry, and one counted from the due time -------------


@queue("sb-ttl-long", expiration=timedelta(days=60))
class Archive(QueueMessage):
    n: int


@queue("sb-ttl-again")
class Renewal(QueueMessage):
    account: str


async def _long_runtime(clock: FakeClock, runs: list[str] | None = None):
    app = QueueingApp("sb-ttl-long")

    @app.handler()
    async def ping(msg: Ping) -> None:
        pass

    @app.handler()
    async def archive(msg: Archive) -> None:
        pass

    @app.handler()
    async def renew(msg: Renewal) -> datetime:
        if runs is not None:
            runs.append(msg.account)
        return clock() + timedelta(days=60)  # run again in 60 days (a handler may return a datetime)

    rt = in_memory_servicebus(
        app, FakeServiceBusNamespace(clock=clock), provider_options={"receive_wait": 0.1}
    )
    await rt.open()
    return app, rt


async def test_a_message_living_longer_than_a_message_can_say_takes_its_queues_time_to_live():
    """A message's time to live travels as an AMQP uint of milliseconds: the SDK refuses more than about
    49.7 days with a bare ValueError. Every message of a type whose expiration is longer failed, and in
    ``enqueue_many`` after the messages before it had gone out with no history (found in review). Such a
    message now carries none and takes its queue's (the type's expiration plus the grace)."""
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _long_runtime(clock)
    try:
        receipts = await app.enqueue_many([Ping(n=1), Archive(n=1)])
        assert await rt.tracker.counts() == {("sb-ttl-capped", "Pending"): 1, ("sb-ttl-long", "Pending"): 1}
        [held] = await _peek(rt, "sb-ttl-long")
        assert held.time_to_live == timedelta(days=60, hours=1)  # the queue's, as the kit created it
        clock.advance(timedelta(days=59))
        got = await rt.provider.receive(app.subscription("Archive"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [receipts[1].message_id]
    finally:
        await rt.close()


async def test_a_delayed_messages_time_to_live_counts_from_its_due_time():
    """Service Bus counts a scheduled message's time to live from its scheduled time (``check_expiry``
    already did): the message was given one counted from the send, so a delay of 50 days with a life of
    an hour after it could not be sent at all, and a shorter delay's message lived its delay too long."""
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _long_runtime(clock)
    try:
        later = await app.enqueue(Ping(n=1), delay=timedelta(days=50), ttl=timedelta(days=50, hours=1))
        [waiting] = await _peek(rt, "sb-ttl-capped")
        # an hour of its own after its due time, and the grace
        assert abs(waiting.time_to_live - timedelta(hours=2)) < timedelta(seconds=1)
        clock.advance(timedelta(days=50, minutes=30))
        got = await rt.provider.receive(app.subscription("Ping"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [later.message_id]
    finally:
        await rt.close()


async def test_a_handler_asking_to_run_again_in_sixty_days_is_settled():
    """A handler's "run again at" 60 days off gave the copy a time to live counted from now, which no
    message can carry: the settlement failed, the message ran again on every delivery and was
    dead-lettered after its attempts (found in review)."""
    clock = FakeClock(datetime.now(UTC))
    runs: list[str] = []
    app, rt = await _long_runtime(clock, runs)
    try:
        receipt = await app.enqueue(Renewal(account="acme"))
        await run_until_idle(rt)
        assert runs == ["acme"]
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.SLEEPING
        [copy] = await _peek(rt, "sb-ttl-again")
        assert copy.state == ServiceBusMessageState.SCHEDULED
        # its expiry starts again from the run again (the type's 4 hours), and so does its time to live
        assert abs(copy.time_to_live - timedelta(hours=5)) < timedelta(seconds=1)
    finally:
        await rt.close()


@queue("sb-ttl-retry-late", expiration=timedelta(minutes=10))
class Late(QueueMessage):
    n: int


async def test_a_retry_due_after_its_expiry_still_reaches_the_kit_which_records_it_expired():
    """A retry copy due past its message's expiry (a handler's long ``Retry(after=)``) was given a time
    to live of 1 s from its due time: the broker dead-lettered it as TTLExpiredException unless a worker
    took it within that second, and its history stayed Failed. The grace follows its activation."""
    from queueing_core import Retry

    clock = FakeClock(datetime.now(UTC))
    app = QueueingApp("sb-ttl-retry-late")
    runs: list[int] = []

    @app.handler()
    async def late(msg: Late) -> None:
        runs.append(msg.n)
        raise Retry(timedelta(hours=2), "come back in two hours")

    rt = in_memory_servicebus(
        app, FakeServiceBusNamespace(clock=clock), clock=clock, provider_options={"receive_wait": 0.1}
    )
    await rt.open()
    try:
        receipt = await app.enqueue(Late(n=1))
        await run_until_idle(rt, raise_errors=False)
        [copy] = await _peek(rt, "sb-ttl-retry-late")
        assert copy.time_to_live >= rt.provider.ttl_grace
        clock.advance(timedelta(hours=2, seconds=3))  # a worker takes it 3 s after it is due
        await run_until_idle(rt, raise_errors=False)
        assert runs == [1]
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.EXPIRED
        [letter] = await _peek(rt, "sb-ttl-retry-late", ServiceBusSubQueue.DEAD_LETTER)
        assert letter.dead_letter_reason != "TTLExpiredException"
    finally:
        await rt.close()


def test_only_a_full_batch_is_taken_for_full():
    """Any ValueError from adding to a batch was taken for "the batch is full": the batch so far was
    sent, and the same error left after it. Only the SDK's ``MessageSizeExceededError`` says full; any
    other is its encoder refusing the message, in the kit's terms and naming it."""
    from types import SimpleNamespace

    from azure.servicebus import ServiceBusMessage, ServiceBusMessageBatch
    from azure.servicebus.exceptions import MessageSizeExceededError

    from queueing_core.errors import ProviderError
    from queueing_core.providers.servicebus import _added

    env: Any = SimpleNamespace(message_id="m-1")
    too_long = ServiceBusMessage("x", time_to_live=timedelta(days=50))  # the SDK's encoder refuses it
    with pytest.raises(ProviderError, match="m-1"):
        _added(ServiceBusMessageBatch(max_size_in_bytes=262144), too_long, env)
    small = ServiceBusMessageBatch(max_size_in_bytes=600)
    assert _added(small, ServiceBusMessage("x" * 300), env)
    assert not _added(small, ServiceBusMessage("y" * 300), env)  # full: another batch takes it
    with pytest.raises(MessageSizeExceededError):  # too large alone: no batch takes it
        _added(ServiceBusMessageBatch(max_size_in_bytes=600), ServiceBusMessage("z" * 900), env)


# --- an existing queue's own time to live ------------------------------------------------------------


async def _runtime_on_existing(clock: FakeClock, **queue_settings: Any):
    app = QueueingApp("sb-ttl-existing")

    @app.handler()
    async def ping(msg: Ping) -> None:
        pass

    ns = FakeServiceBusNamespace(clock=clock)
    rt = in_memory_servicebus(app, ns, provider_options={"receive_wait": 0.1})
    async with FakeServiceBusAdministrationClient(ns) as admin:
        await admin.create_queue(rt.provider.physical("sb-ttl-capped"), **queue_settings)
    await rt.open()
    return app, rt


async def test_an_existing_queue_with_a_shorter_life_is_warned_of_and_holds_the_expiries(caplog):
    """The kit leaves an existing queue as it is (made by hand, by an older deployment, or the emulator's
    and the service's defaults: a 1-hour time to live, expired messages deleted) and read only its lock
    duration: a message the kit promised 2 hours was deleted by the broker after one, its history left
    Pending, and nothing said so (found in review)."""
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime_on_existing(clock, default_message_time_to_live=timedelta(hours=1))
    try:
        said = [r.getMessage() for r in caplog.records if r.name == "queueing.servicebus"]
        ttl = [m for m in said if "time to live of 1:00:00" in m]
        assert len(ttl) == 1, said
        assert "sb-ttl-capped" in ttl[0]
        assert "3:00:00" in ttl[0]  # what the kit needs: the type's expiration and the grace
        assert "provision it again" in ttl[0]
        dead = [m for m in said if "dead-lettering on message expiration off" in m]
        assert len(dead) == 1, said
        assert "sb-ttl-capped" in dead[0]
        # a message the queue would drop before its expiry is refused, nothing sent or recorded
        with pytest.raises(InvalidArgument, match="time to live of 1:00:00"):
            await app.enqueue(Ping(n=1))
        assert await _peek(rt, "sb-ttl-capped") == []
        assert await rt.tracker.counts() == {}
        # one within it is not
        kept = await app.enqueue(Ping(n=2), ttl=timedelta(minutes=50))
        clock.advance(timedelta(minutes=45))
        got = await rt.provider.receive(app.subscription("Ping"), 10)
        assert [d.envelope.message_id for d in got if d.envelope] == [kept.message_id]
    finally:
        await rt.close()


async def test_an_existing_queue_as_the_kit_would_make_it_is_not_warned_of(caplog):
    clock = FakeClock(datetime.now(UTC))
    app, rt = await _runtime_on_existing(
        clock, default_message_time_to_live=timedelta(hours=3), dead_lettering_on_message_expiration=True
    )
    try:
        said = [r.getMessage() for r in caplog.records if r.name == "queueing.servicebus"]
        assert not [m for m in said if "time to live" in m or "dead-lettering" in m], said
        await app.enqueue(Ping(n=1))  # the type's own expiry fits
    finally:
        await rt.close()
