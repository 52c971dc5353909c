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

import pytest
from azure.servicebus import ServiceBusSubQueue

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus


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
