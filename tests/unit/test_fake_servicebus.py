"""The in-memory Service Bus fake keeps the broker's documented behaviour and the Python SDK's shapes.

Each test names the behaviour it holds the fake to. Sources: Microsoft Learn's Service Bus pages (titles
quoted) and the ``azure-servicebus`` 7.x package itself (its docstrings, and its live tests in the
azure-sdk-for-python repository, ``sdk/servicebus/azure-servicebus/tests``).
"""

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceNotFoundError
from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusMessageBatch,
    ServiceBusMessageState,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusError,
)
from azure.servicebus.management import QueueProperties

from queueing_core.fakes.servicebus import (
    STANDARD_MAX_MESSAGE_BYTES,
    FakeClock,
    FakeReceivedMessage,
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
)

START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
DLQ = ServiceBusSubQueue.DEAD_LETTER


@pytest.fixture
def clock():
    return FakeClock(START)


@pytest.fixture
def namespace(clock):
    return FakeServiceBusNamespace(clock=clock)


@pytest.fixture
def admin(namespace):
    return FakeServiceBusAdministrationClient(namespace)


@pytest.fixture
async def client(namespace):
    async with FakeServiceBusClient(namespace) as sb:
        yield sb


async def send(client, queue, *messages):
    async with client.get_queue_sender(queue) as sender:
        await sender.send_messages(list(messages))


async def receive_one(receiver, wait=0.01):
    messages = await receiver.receive_messages(max_wait_time=wait)
    assert len(messages) == 1, messages
    return messages[0]


# --- shapes -------------------------------------------------------------------------------------


async def test_received_message_has_the_python_sdks_attribute_shapes(admin, client):
    """azure-servicebus ``ServiceBusReceivedMessage``: the data body iterates over ``bytes`` sections and
    ``str()`` decodes it; "when a message is received, the keys and any string values in this dictionary
    are returned as bytes" (``application_properties`` docstring); ``expires_at_utc`` is
    ``enqueued_time_utc + time_to_live``. The SDK's live test ``test_async_queue_send_multiple_messages``
    asserts exactly these, including ``delivery_count == 0`` on a first receive."""
    await admin.create_queue("q")
    await send(
        client,
        "q",
        ServiceBusMessage(
            "héllo",
            message_id="m-1",
            correlation_id="c-1",
            subject="greeting",
            content_type="text/plain",
            application_properties={"tenant": "acme", "n": 3, "at": START},
            time_to_live=timedelta(minutes=5),
        ),
    )
    async with client.get_queue_receiver("q") as receiver:
        msg = await receive_one(receiver)

    assert isinstance(msg, FakeReceivedMessage)
    assert b"".join(msg.body) == "héllo".encode()
    assert str(msg) == "héllo"
    assert (msg.message_id, msg.correlation_id, msg.subject, msg.content_type) == (
        "m-1",
        "c-1",
        "greeting",
        "text/plain",
    )
    assert msg.application_properties == {
        b"tenant": b"acme",
        b"n": 3,
        b"at": int(START.timestamp() * 1000),
    }
    assert msg.delivery_count == 0
    assert msg.sequence_number == 1
    assert msg.enqueued_time_utc == START
    assert msg.time_to_live == timedelta(minutes=5)
    assert msg.expires_at_utc == START + timedelta(minutes=5)
    assert msg.locked_until_utc == START + timedelta(seconds=60)  # the default lock duration
    assert isinstance(msg.lock_token, uuid.UUID)
    assert msg.state is ServiceBusMessageState.ACTIVE
    assert msg.scheduled_enqueue_time_utc is None
    assert msg.dead_letter_reason is None
    assert msg.dead_letter_error_description is None
    assert msg.dead_letter_source is None


async def test_sender_accepts_a_message_a_list_and_a_batch(admin, client):
    """azure-servicebus ``ServiceBusSender.send_messages``: "The ServiceBus message to be sent", a list
    ("attempts to send them as a single batch") or a ``ServiceBusMessageBatch``. Messages without
    application properties come back with ``application_properties`` ``None`` (its docstring)."""
    await admin.create_queue("q")
    async with client.get_queue_sender("q") as sender:
        await sender.send_messages(ServiceBusMessage("one"))
        await sender.send_messages([ServiceBusMessage("two"), ServiceBusMessage(b"three")])
        batch = await sender.create_message_batch()
        batch.add_message(ServiceBusMessage("four"))
        assert isinstance(batch, ServiceBusMessageBatch)
        await sender.send_messages(batch)
        await sender.send_messages([])  # an empty list is a no-op, as in the SDK
    async with client.get_queue_receiver("q") as receiver:
        messages = await receiver.receive_messages(max_message_count=10, max_wait_time=0.01)
    assert [str(m) for m in messages] == ["one", "two", "three", "four"]
    assert [m.sequence_number for m in messages] == [1, 2, 3, 4]
    assert all(m.application_properties is None for m in messages)


async def test_sending_to_a_missing_queue_raises_entity_not_found(client):
    """azure-servicebus ``exceptions.MessagingEntityNotFoundError``: "A Service Bus resource cannot be
    found by the Service Bus service. Entity associated with the operation doesn't exist"."""
    sender = client.get_queue_sender("nope")
    with pytest.raises(MessagingEntityNotFoundError):
        await sender.send_messages(ServiceBusMessage("x"))
    with pytest.raises(MessagingEntityNotFoundError):
        async with client.get_queue_receiver("nope"):
            pass


# --- 1. peek-lock -------------------------------------------------------------------------------


async def test_peek_lock_hides_a_message_until_it_is_settled(admin, client):
    """Service Bus docs, "Message transfers, locks, and settlement" (PeekLock): the broker locks the
    message so "other competing receivers" can't receive it while the lock is held; completing
    removes it, abandoning makes it available again at once."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("a"))
    first = client.get_queue_receiver("q")
    second = client.get_queue_receiver("q")

    msg = await receive_one(first)
    assert await second.receive_messages(max_wait_time=0.01) == []

    await first.abandon_message(msg)
    again = await receive_one(second)
    assert again.sequence_number == msg.sequence_number

    await second.complete_message(again)
    assert await first.receive_messages(max_wait_time=0.01) == []
    assert (await admin.get_queue_runtime_properties("q")).total_message_count == 0


async def test_lock_expiry_releases_the_message_and_counts_a_delivery(admin, client, clock):
    """Service Bus docs, "Message transfers, locks, and settlement": if the receiver doesn't settle
    before the lock expires, the message becomes available again; ``ServiceBusReceivedMessage``
    docstring: "When the lock expires, delivery count of the message is incremented and the message is
    again available for retrieval"."""
    await admin.create_queue("q", lock_duration=timedelta(seconds=30))
    await send(client, "q", ServiceBusMessage("a"))
    receiver = client.get_queue_receiver("q")

    msg = await receive_one(receiver)
    assert msg.locked_until_utc == START + timedelta(seconds=30)
    clock.advance(29)
    assert await receiver.receive_messages(max_wait_time=0.01) == []
    clock.advance(1)
    again = await receive_one(receiver)
    assert again.sequence_number == msg.sequence_number
    assert again.delivery_count == msg.delivery_count + 1


async def test_renewing_the_lock_keeps_the_message_hidden(admin, client, clock):
    """azure-servicebus ``ServiceBusReceiver.renew_message_lock``: "This will maintain the lock on the
    message to ensure it is not returned to the queue to be reprocessed"; returns the new expiry."""
    await admin.create_queue("q", lock_duration=timedelta(seconds=30))
    await send(client, "q", ServiceBusMessage("a"))
    receiver = client.get_queue_receiver("q")
    msg = await receive_one(receiver)

    clock.advance(20)
    until = await receiver.renew_message_lock(msg)
    assert until == START + timedelta(seconds=50) == msg.locked_until_utc
    clock.advance(20)  # past the first lock, inside the renewed one
    assert await receiver.receive_messages(max_wait_time=0.01) == []
    await receiver.complete_message(msg)


async def test_a_lock_expiring_in_real_time_wakes_a_waiting_receiver():
    """The same lock expiry ("Message transfers, locks, and settlement") with the default real clock:
    a receiver already waiting gets the message once the lock runs out, without polling."""
    namespace = FakeServiceBusNamespace()
    await FakeServiceBusAdministrationClient(namespace).create_queue(
        "q", lock_duration=timedelta(milliseconds=150)
    )
    client = FakeServiceBusClient(namespace)
    await send(client, "q", ServiceBusMessage("a"))
    first = await receive_one(client.get_queue_receiver("q"))

    started = time.monotonic()
    again = await receive_one(client.get_queue_receiver("q"), wait=60)
    # woken when the lock ran out, not at the end of its 60 s wait (wide bounds for a loaded machine)
    assert 0.1 < time.monotonic() - started < 30
    assert again.sequence_number == first.sequence_number
    assert again.delivery_count == 1


# --- 2. delivery count --------------------------------------------------------------------------


async def test_delivery_count_starts_at_zero_and_abandon_increments_it(admin, client):
    """Delivery count: "The count is incremented when a message lock expires, or the message is
    explicitly abandoned" (.NET ``ServiceBusReceivedMessage.DeliveryCount``). The Python SDK returns the
    AMQP header value, the number of *earlier* attempts: the SDK's live tests assert
    ``message.delivery_count == 0`` on a first receive (.NET adds one and says "starts at 1")."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("a"))
    receiver = client.get_queue_receiver("q")

    counts = []
    for _ in range(3):
        msg = await receive_one(receiver)
        counts.append(msg.delivery_count)
        await receiver.abandon_message(msg)
    assert counts == [0, 1, 2]


# --- 3. max delivery count ----------------------------------------------------------------------


async def test_abandoning_past_max_delivery_count_dead_letters_the_message(admin, client):
    """Service Bus docs, "Overview of Service Bus dead-letter queues" (Maximum delivery count): once a
    message has been delivered MaxDeliveryCount times it moves to the DLQ with reason
    ``MaxDeliveryCountExceeded``; the service's description reads "Message could not be consumed after
    N delivery attempts."."""
    await admin.create_queue("q", max_delivery_count=3)
    await send(client, "q", ServiceBusMessage("poison", application_properties={"k": "v"}))
    receiver = client.get_queue_receiver("q")

    for _ in range(3):
        await receiver.abandon_message(await receive_one(receiver))
    assert await receiver.receive_messages(max_wait_time=0.01) == []

    dead = await receive_one(client.get_queue_receiver("q", sub_queue=DLQ))
    assert str(dead) == "poison"
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert dead.dead_letter_error_description == "Message could not be consumed after 3 delivery attempts."
    # the reason travels as application properties, as the SDK reads it
    assert dead.application_properties[b"DeadLetterReason"] == b"MaxDeliveryCountExceeded"
    assert dead.application_properties[b"k"] == b"v"


async def test_lock_expiry_also_counts_towards_max_delivery_count(admin, client, clock):
    """ "Overview of Service Bus dead-letter queues": the delivery count rises "whenever a message has
    been delivered under a peek-lock, but has been either explicitly abandoned or the lock has
    expired"; the limit applies to both."""
    await admin.create_queue("q", max_delivery_count=2, lock_duration=timedelta(seconds=10))
    await send(client, "q", ServiceBusMessage("slow"))
    receiver = client.get_queue_receiver("q")

    await receive_one(receiver)
    clock.advance(10)
    await receive_one(receiver)
    clock.advance(10)
    assert await receiver.receive_messages(max_wait_time=0.01) == []
    dead = await receive_one(client.get_queue_receiver("q", sub_queue="deadletter"))
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"


# --- 4. settling late or twice ------------------------------------------------------------------


async def test_settling_after_the_lock_expired_raises_lock_lost(admin, client, clock):
    """azure-servicebus ``MessageLockLostError``: "The lock on the message is lost. Callers should call
    attempt to receive and process the message again." Renewing an expired lock fails the same way
    (``renew_message_lock``: "an expired lock cannot be renewed")."""
    await admin.create_queue("q", lock_duration=timedelta(seconds=30))
    await send(client, "q", ServiceBusMessage("a"))
    receiver = client.get_queue_receiver("q")
    msg = await receive_one(receiver)

    clock.advance(31)
    for settle in (receiver.complete_message, receiver.abandon_message, receiver.defer_message):
        with pytest.raises(MessageLockLostError):
            await settle(msg)
    with pytest.raises(MessageLockLostError):
        await receiver.dead_letter_message(msg, reason="r")
    with pytest.raises(MessageLockLostError):
        await receiver.renew_message_lock(msg)


async def test_a_stale_copy_cannot_settle_after_someone_else_took_the_message(admin, client, clock):
    """ "Message transfers, locks, and settlement": after the lock expires the message can be delivered
    to another receiver; the first holder's lock token no longer refers to a lock (lock lost)."""
    await admin.create_queue("q", lock_duration=timedelta(seconds=30))
    await send(client, "q", ServiceBusMessage("a"))
    stale = await receive_one(client.get_queue_receiver("q"))
    clock.advance(30)
    fresh_receiver = client.get_queue_receiver("q")
    fresh = await receive_one(fresh_receiver)

    with pytest.raises(MessageLockLostError):
        await fresh_receiver.complete_message(stale)
    await fresh_receiver.complete_message(fresh)


async def test_settling_twice_raises_already_settled(admin, client):
    """azure-servicebus ``MessageAlreadySettled``: "An attempt was made to complete an operation on a
    message that has already been settled (completed, abandoned, dead-lettered or deferred)"; a settled
    message has no ``lock_token``."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("a"), ServiceBusMessage("b"))
    receiver = client.get_queue_receiver("q")
    first, second = await receiver.receive_messages(max_message_count=2, max_wait_time=0.01)

    await receiver.complete_message(first)
    assert first.lock_token is None
    assert first.locked_until_utc is None
    with pytest.raises(MessageAlreadySettled):
        await receiver.complete_message(first)
    await receiver.abandon_message(second)
    with pytest.raises(MessageAlreadySettled):
        await receiver.dead_letter_message(second)


# --- 5. TTL -------------------------------------------------------------------------------------


async def test_effective_ttl_is_the_smaller_of_message_and_queue_ttl_and_expired_messages_vanish(
    admin, client, clock
):
    """Service Bus docs, "Message expiration (Time to Live)": a message-level TTL "can't be higher than
    the entity's TTL" and is silently adjusted; an expired message is no longer delivered and, without
    dead-lettering on expiration, is removed."""
    await admin.create_queue("q", default_message_time_to_live=timedelta(minutes=10))
    await send(
        client,
        "q",
        ServiceBusMessage("short", time_to_live=timedelta(minutes=1)),
        ServiceBusMessage("long", time_to_live=timedelta(hours=1)),
        ServiceBusMessage("default"),
    )
    async with client.get_queue_receiver("q") as receiver:
        peeked = await receiver.peek_messages(3)
    assert [m.time_to_live for m in peeked] == [
        timedelta(minutes=1),
        timedelta(minutes=10),
        timedelta(minutes=10),
    ]
    assert [m.expires_at_utc for m in peeked] == [
        START + timedelta(minutes=1),
        START + timedelta(minutes=10),
        START + timedelta(minutes=10),
    ]

    clock.advance(timedelta(minutes=1))
    async with client.get_queue_receiver("q") as receiver:
        left = await receiver.receive_messages(max_message_count=10, max_wait_time=0.01)
        assert [str(m) for m in left] == ["long", "default"]
        for m in left:
            await receiver.abandon_message(m)
    # (a new receiver: the first one's leftover credit took the two back as they were abandoned, as a
    # real link does, and a receive hands those out first whatever befell them since)
    clock.advance(timedelta(minutes=9))
    async with client.get_queue_receiver("q") as receiver:
        assert await receiver.receive_messages(max_message_count=10, max_wait_time=0.01) == []
    props = await admin.get_queue_runtime_properties("q")
    assert (props.total_message_count, props.dead_letter_message_count) == (0, 0)


async def test_expired_messages_are_dead_lettered_when_the_queue_says_so(admin, client, clock):
    """ "Overview of Service Bus dead-letter queues" (Time to live): with dead-lettering on expiration
    enabled, expiring messages move to the DLQ with reason ``TTLExpiredException``."""
    await admin.create_queue("q", dead_lettering_on_message_expiration=True)
    await send(client, "q", ServiceBusMessage("stale", time_to_live=timedelta(seconds=30)))
    clock.advance(30)
    assert await client.get_queue_receiver("q").receive_messages(max_wait_time=0.01) == []
    dead = await receive_one(client.get_queue_receiver("q", sub_queue=DLQ))
    assert dead.dead_letter_reason == "TTLExpiredException"


async def test_a_locked_message_does_not_expire_under_its_holder(admin, client, clock):
    """ "Message expiration (Time to Live)": while the message is under lock the application may be in
    possession of an expired message and may still process it; expiry applies once it is released."""
    await admin.create_queue("q", lock_duration=timedelta(seconds=60))
    await send(client, "q", ServiceBusMessage("a", time_to_live=timedelta(seconds=10)))
    receiver = client.get_queue_receiver("q")
    msg = await receive_one(receiver)
    clock.advance(20)
    await receiver.abandon_message(msg)
    assert await receiver.receive_messages(max_wait_time=0.01) == []
    assert (await admin.get_queue_runtime_properties("q")).total_message_count == 0


# --- 6. scheduled messages ----------------------------------------------------------------------


async def test_scheduled_messages_wait_for_their_time_count_as_scheduled_and_can_be_cancelled(
    admin, client, clock
):
    """Service Bus docs, "Message sequencing and timestamps" (Scheduled messages): scheduled messages
    "don't materialize in the queue until the defined enqueue time"; they can be peeked, and scheduling
    returns a sequence number that can cancel the message. The SDK's live test
    ``test_async_queue_schedule_message`` checks ``scheduled_enqueue_time_utc <= enqueued_time_utc``."""
    await admin.create_queue("q")
    at = START + timedelta(minutes=5)
    async with client.get_queue_sender("q") as sender:
        keep, cancel = await sender.schedule_messages([ServiceBusMessage("k"), ServiceBusMessage("c")], at)
        await sender.send_messages(ServiceBusMessage("by-property", scheduled_enqueue_time_utc=at))
        await sender.cancel_scheduled_messages(cancel)
        with pytest.raises(MessageNotFoundError):
            await sender.cancel_scheduled_messages([cancel])

    props = await admin.get_queue_runtime_properties("q")
    assert (props.active_message_count, props.scheduled_message_count) == (0, 2)
    receiver = client.get_queue_receiver("q")
    assert await receiver.receive_messages(max_wait_time=0.01) == []
    peeked = await client.get_queue_receiver("q").peek_messages(5)
    assert [m.state for m in peeked] == [ServiceBusMessageState.SCHEDULED] * 2

    clock.advance(timedelta(minutes=5))
    got = await receiver.receive_messages(max_message_count=5, max_wait_time=0.01)
    assert [str(m) for m in got] == ["k", "by-property"]
    # activated: a new sequence number, as if enqueued now (test_servicebus_sdk_fidelity.py)
    assert got[0].sequence_number > max(keep, cancel)
    assert all(m.scheduled_enqueue_time_utc == at <= m.enqueued_time_utc for m in got)
    assert (await admin.get_queue_runtime_properties("q")).scheduled_message_count == 0


async def test_a_waiting_receiver_wakes_when_the_fake_clock_reaches_a_schedule(admin, client, clock):
    """Scheduled messages ("Message sequencing and timestamps") become receivable at their time; with a
    FakeClock, advancing it wakes a receiver that is already waiting."""
    await admin.create_queue("q")
    async with client.get_queue_sender("q") as sender:
        await sender.schedule_messages(ServiceBusMessage("later"), START + timedelta(hours=1))
    waiting = asyncio.create_task(client.get_queue_receiver("q").receive_messages(max_wait_time=60))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    clock.advance(timedelta(hours=1))
    [msg] = await asyncio.wait_for(waiting, 30)
    assert str(msg) == "later"


# --- 7. dead-letter sub-queue -------------------------------------------------------------------


async def test_explicit_dead_lettering_keeps_reason_and_the_dlq_never_dead_letters_again(
    admin, client, clock
):
    """ "Overview of Service Bus dead-letter queues": an application can move a message to the DLQ with
    its own reason and description; in the DLQ "time-to-live isn't observed, and you can't dead-letter
    a message from a DLQ"; it supports peek-lock like any queue."""
    await admin.create_queue("q", max_delivery_count=1, default_message_time_to_live=timedelta(minutes=1))
    await send(client, "q", ServiceBusMessage("bad"))
    receiver = client.get_queue_receiver("q")
    await receiver.dead_letter_message(
        await receive_one(receiver), reason="Invalid", error_description="no id"
    )

    dlq = client.get_queue_receiver("q", sub_queue=DLQ)
    for _ in range(3):  # abandoning in the DLQ never moves it on, whatever max_delivery_count says
        dead = await receive_one(dlq)
        assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("Invalid", "no id")
        await dlq.abandon_message(dead)
    clock.advance(timedelta(hours=1))  # past the TTL: not observed in the DLQ
    dead = await receive_one(dlq)
    with pytest.raises(ServiceBusError):
        await dlq.dead_letter_message(dead, reason="again")
    # the SDK shuts a receiver's handler down on that refusal (a plain ServiceBusError, as it maps
    # amqp:not-allowed): a peek opens it again before the letter can be settled
    with pytest.raises(ValueError, match="handler has already been shutdown"):
        await dlq.complete_message(dead)
    await dlq.peek_messages(max_message_count=1, sequence_number=2**63 - 1)
    await dlq.complete_message(dead)
    assert (await admin.get_queue_runtime_properties("q")).total_message_count == 0


async def test_a_dead_lettered_message_can_be_resubmitted(admin, client):
    """ "Overview of Service Bus dead-letter queues": messages "can then be removed from the DLQ and
    inspected. An application might ... resubmit the message"; the SDK's sender accepts a received
    message and sends a copy."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("again", message_id="m-7"))
    receiver = client.get_queue_receiver("q")
    await receiver.dead_letter_message(await receive_one(receiver), reason="oops")
    dlq = client.get_queue_receiver("q", sub_queue=DLQ)
    dead = await receive_one(dlq)
    async with client.get_queue_sender("q") as sender:
        await sender.send_messages(dead)
    await dlq.complete_message(dead)

    replayed = await receive_one(receiver)
    assert (str(replayed), replayed.message_id, replayed.delivery_count) == ("again", "m-7", 0)
    assert replayed.sequence_number != dead.sequence_number


# --- 8. receive and delete ----------------------------------------------------------------------


async def test_receive_and_delete_removes_on_receive_and_cannot_settle(admin, client):
    """Service Bus docs, "Message transfers, locks, and settlement" (ReceiveAndDelete): the broker
    "considers the message consumed" when it sends it; the SDK raises ``ValueError`` for any settlement
    "in 'RECEIVE_AND_DELETE' receive mode"."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("once"))
    receiver = client.get_queue_receiver("q", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE)
    msg = await receive_one(receiver)
    assert msg.lock_token is None
    assert msg.locked_until_utc is None
    with pytest.raises(ValueError, match="RECEIVE_AND_DELETE"):
        await receiver.complete_message(msg)
    assert await client.get_queue_receiver("q").receive_messages(max_wait_time=0.01) == []
    assert (await admin.get_queue_runtime_properties("q")).total_message_count == 0


# --- 9. size limit ------------------------------------------------------------------------------


async def test_messages_and_batches_over_256_kb_raise_message_size_exceeded(admin, client):
    """Service Bus docs, "Service Bus quotas": maximum message size 256 KB on the Standard tier;
    azure-servicebus ``ServiceBusMessageBatch.add_message`` raises ``MessageSizeExceededError`` when the
    batch is full, and ``create_message_batch`` refuses a size above the entity's limit."""
    await admin.create_queue("q")
    async with client.get_queue_sender("q") as sender:
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(ServiceBusMessage(b"x" * STANDARD_MAX_MESSAGE_BYTES))
        with pytest.raises(MessageSizeExceededError):  # a list goes as one batch
            await sender.send_messages([ServiceBusMessage(b"x" * 100_000) for _ in range(3)])
        with pytest.raises(MessageSizeExceededError):
            await sender.schedule_messages(ServiceBusMessage(b"x" * 300_000), START)

        batch = await sender.create_message_batch()
        assert batch.max_size_in_bytes == STANDARD_MAX_MESSAGE_BYTES
        batch.add_message(ServiceBusMessage(b"x" * 200_000))
        with pytest.raises(MessageSizeExceededError):
            batch.add_message(ServiceBusMessage(b"x" * 70_000))
        await sender.send_messages(batch)
        await sender.send_messages(ServiceBusMessage(b"x" * 250_000))
        with pytest.raises(ValueError, match="too large"):
            await sender.create_message_batch(max_size_in_bytes=STANDARD_MAX_MESSAGE_BYTES + 1)
        by_hand = ServiceBusMessageBatch()  # the SDK's own default cap is 1 MB
        by_hand.add_message(ServiceBusMessage(b"x" * 200_000))
        by_hand.add_message(ServiceBusMessage(b"x" * 200_000))
        with pytest.raises(MessageSizeExceededError):
            await sender.send_messages(by_hand)
    assert (await admin.get_queue_runtime_properties("q")).active_message_count == 2


# --- competing consumers ------------------------------------------------------------------------


async def test_competing_receivers_never_get_the_same_locked_message(admin, namespace):
    """Service Bus docs, "Service Bus queues, topics, and subscriptions": with competing consumers
    "each message is received and processed by only one of the message consumers"; a peek-locked
    message is invisible to the others ("Message transfers, locks, and settlement")."""
    await admin.create_queue("q")
    clients = [FakeServiceBusClient(namespace) for _ in range(4)]
    seen: list[int] = []

    async def consume(sb: FakeServiceBusClient) -> None:
        receiver = sb.get_queue_receiver("q")
        while batch := await receiver.receive_messages(max_message_count=3, max_wait_time=0.05):
            seen.extend(m.sequence_number for m in batch)
            await asyncio.sleep(0)  # let the others in while these are held
            for m in batch:
                await receiver.complete_message(m)

    consumers = [asyncio.create_task(consume(clients[i % 4])) for i in range(20)]
    async with clients[0].get_queue_sender("q") as sender:
        for start in range(0, 200, 20):
            await sender.send_messages([ServiceBusMessage(str(i)) for i in range(start, start + 20)])
            await asyncio.sleep(0)
    await asyncio.gather(*consumers)

    assert sorted(seen) == list(range(1, 201))  # each exactly once
    assert (await admin.get_queue_runtime_properties("q")).total_message_count == 0


async def test_receive_waits_for_a_message_and_gives_up_after_max_wait_time():
    """azure-servicebus ``receive_messages``: ``max_wait_time`` is the "maximum time to wait in seconds
    for the first message to arrive"; with none arriving "an empty list will be returned". Real time."""
    namespace = FakeServiceBusNamespace()
    await FakeServiceBusAdministrationClient(namespace).create_queue("q")
    client = FakeServiceBusClient(namespace)
    receiver = client.get_queue_receiver("q")

    started = time.monotonic()
    assert await receiver.receive_messages(max_wait_time=0.05) == []
    assert time.monotonic() - started >= 0.045

    async def send_later() -> None:
        await asyncio.sleep(0.05)
        await send(client, "q", ServiceBusMessage("late"))

    sending = asyncio.create_task(send_later())
    started = time.monotonic()
    msg = await receive_one(receiver, wait=60)
    assert str(msg) == "late"
    assert time.monotonic() - started < 30  # as it arrived, not at the end of the 60 s wait
    await sending


# --- peek, defer, duplicates --------------------------------------------------------------------


async def test_peek_neither_locks_nor_counts_and_pages_through_the_queue(admin, client):
    """Service Bus docs, "Message browsing": peek returns messages "without locking" and doesn't
    change delivery state; azure-servicebus ``peek_messages``: peeked messages "cannot be completed,
    deferred or dead-lettered", and browsing continues from the last message seen."""
    await admin.create_queue("q")
    await send(client, "q", *(ServiceBusMessage(str(i)) for i in range(5)))
    browser = client.get_queue_receiver("q")

    assert [str(m) for m in await browser.peek_messages(2)] == ["0", "1"]
    assert [str(m) for m in await browser.peek_messages(2)] == ["2", "3"]
    again = await browser.peek_messages(10, sequence_number=1)
    assert [m.delivery_count for m in again] == [0] * 5
    assert all(m.lock_token is None for m in again)
    with pytest.raises(ValueError, match="peeked"):
        await browser.complete_message(again[0])

    got = await client.get_queue_receiver("q").receive_messages(max_message_count=5, max_wait_time=0.01)
    assert [m.delivery_count for m in got] == [0] * 5


async def test_deferred_messages_come_back_only_by_sequence_number(admin, client):
    """Service Bus docs, "Message deferral": a deferred message stays in the queue but can only be
    received by its sequence number; ``receive_deferred_messages`` returns it in state Deferred."""
    await admin.create_queue("q")
    await send(client, "q", ServiceBusMessage("later"))
    receiver = client.get_queue_receiver("q")
    msg = await receive_one(receiver)
    await receiver.defer_message(msg)

    assert await receiver.receive_messages(max_wait_time=0.01) == []
    assert (await admin.get_queue_runtime_properties("q")).active_message_count == 1
    [back] = await receiver.receive_deferred_messages([msg.sequence_number])
    assert back.state is ServiceBusMessageState.DEFERRED
    assert str(back) == "later"
    with pytest.raises(MessageNotFoundError):
        await receiver.receive_deferred_messages(msg.sequence_number)  # locked now
    await receiver.complete_message(back)


async def test_duplicate_detection_drops_a_repeated_message_id_within_the_window(admin, client, clock):
    """Service Bus docs, "Duplicate detection": with it enabled, a message whose MessageId was already
    sent within the window is accepted but dropped; after the window it is accepted again."""
    await admin.create_queue(
        "q", requires_duplicate_detection=True, duplicate_detection_history_time_window=timedelta(minutes=1)
    )
    await send(
        client, "q", ServiceBusMessage("1", message_id="same"), ServiceBusMessage("2", message_id="same")
    )
    clock.advance(timedelta(minutes=1))
    await send(client, "q", ServiceBusMessage("3", message_id="same"))
    got = await client.get_queue_receiver("q").receive_messages(max_message_count=5, max_wait_time=0.01)
    assert [str(m) for m in got] == ["1", "3"]


# --- runtime properties and administration ------------------------------------------------------


async def test_runtime_properties_count_active_scheduled_and_dead_lettered(admin, client):
    """Service Bus docs, "Get message counters": active, scheduled and dead-letter counts, locked
    messages still counting as active; ``total_message_count`` is the entity's whole message count."""
    await admin.create_queue("q")
    await send(client, "q", *(ServiceBusMessage(str(i)) for i in range(4)))
    async with client.get_queue_sender("q") as sender:
        await sender.schedule_messages(
            [ServiceBusMessage("s1"), ServiceBusMessage("s2")], START + timedelta(days=1)
        )
    receiver = client.get_queue_receiver("q")
    first, second, _locked = await receiver.receive_messages(max_message_count=3, max_wait_time=0.01)
    await receiver.complete_message(first)
    await receiver.dead_letter_message(second, reason="r")

    props = await admin.get_queue_runtime_properties("q")
    assert (
        props.active_message_count,
        props.scheduled_message_count,
        props.dead_letter_message_count,
        props.total_message_count,
    ) == (2, 2, 1, 5)
    assert props.name == "q"
    listed = [p async for p in admin.list_queues_runtime_properties()]
    assert [p.total_message_count for p in listed] == [5]


async def test_administration_client_manages_queues_like_the_sdk(admin):
    """azure-servicebus ``ServiceBusAdministrationClient``: ``create_queue`` returns ``QueueProperties``
    with the service defaults (max delivery count 10, lock duration 1 minute), raises
    ``ResourceExistsError`` for an existing name; get/update/delete raise ``ResourceNotFoundError`` for a
    missing one; the service rejects a lock duration above 5 minutes."""
    created = await admin.create_queue("Orders")
    assert isinstance(created, QueueProperties)
    assert (created.max_delivery_count, created.lock_duration) == (10, timedelta(seconds=60))
    with pytest.raises(ResourceExistsError):
        await admin.create_queue("orders")  # entity names are case-insensitive

    props = await admin.get_queue("orders")
    props.max_delivery_count = 4
    props.lock_duration = timedelta(seconds=20)
    await admin.update_queue(props)
    again = await admin.get_queue("ORDERS")
    assert (again.name, again.max_delivery_count, again.lock_duration) == ("Orders", 4, timedelta(seconds=20))
    await admin.update_queue({"name": "orders", "dead_lettering_on_message_expiration": True})
    assert (await admin.get_queue("orders")).dead_lettering_on_message_expiration is True

    with pytest.raises(HttpResponseError):
        await admin.create_queue("bad", lock_duration=timedelta(minutes=6))
    await admin.create_queue("other")
    assert [q.name async for q in admin.list_queues()] == ["Orders", "other"]

    await admin.delete_queue("other")
    for call in (admin.get_queue, admin.get_queue_runtime_properties, admin.delete_queue):
        with pytest.raises(ResourceNotFoundError):
            await call("other")


async def test_closed_handlers_refuse_work_and_async_iteration_ends_on_max_wait_time(admin, namespace):
    """azure-servicebus handlers: closing the client closes its senders and receivers, which then raise
    ``ValueError`` ("The handler has already been shutdown"); iterating a receiver yields messages and
    stops once ``max_wait_time`` passes with none."""
    await admin.create_queue("q")
    async with FakeServiceBusClient(namespace) as sb:
        await send(sb, "q", ServiceBusMessage("a"), ServiceBusMessage("b"))
        receiver = sb.get_queue_receiver("q", max_wait_time=0.02)
        got = []
        async for msg in receiver:
            got.append(str(msg))
            await receiver.complete_message(msg)
        assert got == ["a", "b"]
    with pytest.raises(ValueError, match="shutdown"):
        await receiver.receive_messages()
