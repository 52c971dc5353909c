"""The in-memory Service Bus and the provider's error translation, held against the installed
``azure-servicebus`` SDK and Microsoft Learn's documented service behaviour (a review found the
transient errors below translated as permanent, settlement errors left untranslated, and the stand-in
keeping a scheduled message's sequence number and expiring deferred messages).

Every exception here is the SDK's own class, built by the SDK's own AMQP error mapping where it has one
(``PyamqpTransport._handle_amqp_exception_with_condition`` / ``create_servicebus_exception``), never
retyped.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from azure.core.exceptions import ServiceRequestError, ServiceResponseError
from azure.servicebus import ServiceBusMessage, ServiceBusMessageState
from azure.servicebus._common.constants import ERROR_CODE_SERVER_BUSY, ERROR_CODE_TIMEOUT
from azure.servicebus._pyamqp.error import AMQPConnectionError, AMQPException, ErrorCondition
from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
from azure.servicebus.exceptions import (
    MessageLockLostError,
    OperationTimeoutError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusServerBusyError,
)

from queueing_core.decisions import Complete
from queueing_core.errors import ProviderError, ProviderUnavailable
from queueing_core.fakes.servicebus import (
    FakeClock,
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
)
from queueing_core.providers import servicebus as sb_provider
from queueing_core.transport import Delivery, Settlement

START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
_log = logging.getLogger("review")


def _sdk_error(condition: Any, description: str, *, connection: bool = False) -> Exception:
    """The exception the SDK raises for this AMQP condition, through its own mapping."""
    exc_type = AMQPConnectionError if connection else AMQPException
    return PyamqpTransport.create_servicebus_exception(
        _log, exc_type(condition=condition, description=description)
    )


# --- the provider's one error translation --------------------------------------------------------


def _transient_errors() -> list[tuple[str, Exception]]:
    return [
        # com.microsoft:server-busy -> "Client can wait for a period of time, then retry" (SDK docstring)
        ("server-busy", _sdk_error(ERROR_CODE_SERVER_BUSY, "The server is busy.")),
        # com.microsoft:timeout -> OperationTimeoutError (retryable=True in the SDK)
        ("timeout", _sdk_error(ERROR_CODE_TIMEOUT, "The operation did not complete in time.")),
        # amqp:not-found on the connection -> "Client isn't able to establish a connection" (SDK docstring)
        (
            "communication",
            _sdk_error(ErrorCondition.NotFound, "The host could not be reached.", connection=True),
        ),
        # the administration client is HTTP (azure-core): these are its "could not reach it" errors
        ("admin-request", ServiceRequestError("Cannot connect to host fake.servicebus.windows.net:443")),
        ("admin-response", ServiceResponseError("Connection reset by peer")),
    ]


def test_the_sdk_builds_the_classes_this_review_expects():
    """Sanity: the SDK's own mapping gives these classes (so the next test holds real types)."""
    kinds = {name: type(exc) for name, exc in _transient_errors()}
    assert kinds["server-busy"] is ServiceBusServerBusyError
    assert kinds["timeout"] is OperationTimeoutError
    assert kinds["communication"] is ServiceBusCommunicationError
    # and the one the boundary does handle, for contrast
    conn = _sdk_error(ErrorCondition.SocketError, "socket closed", connection=True)
    assert isinstance(conn, ServiceBusConnectionError)


@pytest.mark.parametrize(("name", "error"), _transient_errors(), ids=[n for n, _ in _transient_errors()])
def test_transient_sdk_errors_become_provider_unavailable(name, error):
    """``ProviderUnavailable``: "The transport cannot be reached now; callers retry with backoff". The
    Storage Queue, Tables and SQS boundaries put server-busy/throttling and azure-core's
    ServiceRequestError/ServiceResponseError there; the Service Bus boundary sends these real SDK
    errors to plain ``ProviderError`` (ops API answers 500 instead of 503 + Retry-After; the CLI's
    ``_run`` prints a traceback instead of one line)."""
    with pytest.raises(ProviderError) as caught, sb_provider._boundary("sending to orders"):
        raise error
    assert isinstance(caught.value, ProviderUnavailable), (
        f"{type(error).__name__} was translated to {type(caught.value).__name__}, not ProviderUnavailable"
    )


async def test_settle_translates_sdk_errors_into_the_kits_tree():
    """``settle`` has no boundary: when the SDK's ``complete_message`` raises (here the real
    ``ServiceBusConnectionError`` from its own AMQP mapping), the raw SDK exception leaves the provider,
    against "Driver errors translated at the boundary into one exception tree"."""

    class Receiver:
        async def complete_message(self, message: Any) -> None:
            raise _sdk_error(ErrorCondition.SocketError, "connection lost", connection=True)

    class Message:
        sequence_number = 7
        delivery_count = 0
        locked_until_utc = START + timedelta(seconds=30)

    provider = sb_provider.ServiceBusProvider(client=None, admin=None, control=None, tracker=None)  # type: ignore[arg-type]
    delivery = Delivery.of("{}", queue="orders", handle=sb_provider._Handle(Receiver(), Message()))
    try:
        await provider.settle([Settlement(delivery, Complete())])
    except ProviderUnavailable:
        pass
    except Exception as exc:
        raise AssertionError(f"settle raised the SDK's {type(exc).__module__}.{type(exc).__name__}") from exc
    else:
        raise AssertionError("settle raised nothing although the only settlement failed")


# --- the fake against documented broker behaviour ------------------------------------------------


@pytest.fixture
def clock():
    return FakeClock(START)


@pytest.fixture
async def ns(clock):
    namespace = FakeServiceBusNamespace(clock=clock)
    await FakeServiceBusAdministrationClient(namespace).create_queue("q")
    return namespace


async def test_a_scheduled_message_gets_a_new_sequence_number_and_goes_to_the_back_when_it_activates(
    ns, clock
):
    """Microsoft Learn, "Message sequencing and timestamps": "The SequenceNumber for a scheduled message
    is only valid while the message is in this state. As the message transitions to the active state,
    the message is appended to the queue as if had been enqueued at the current instant, which includes
    assigning a new SequenceNumber." The fake keeps the scheduling sequence number and the original
    position, so an activated retry copy jumps ahead of messages sent after it was scheduled."""
    async with FakeServiceBusClient(ns) as client:
        async with client.get_queue_sender("q") as sender:
            [scheduled_seq] = await sender.schedule_messages(
                ServiceBusMessage("later"), START + timedelta(seconds=10)
            )
            await sender.send_messages(ServiceBusMessage("sent-after"))
        clock.advance(timedelta(seconds=11))
        async with client.get_queue_receiver("q") as receiver:
            got = await receiver.receive_messages(max_message_count=10, max_wait_time=0.05)
    by_body = {str(m): m for m in got}
    assert [str(m) for m in got] == ["sent-after", "later"], "activated message not appended at the back"
    assert by_body["later"].sequence_number != scheduled_seq
    assert by_body["later"].sequence_number > by_body["sent-after"].sequence_number


async def test_a_deferred_message_is_not_expired_until_someone_asks_for_it(ns, clock):
    """Microsoft Learn, "Message deferral": "Deferred messages aren't expired and automatically moved to
    a dead-letter queue until a client app attempts to receive them using an API and the sequence
    number. This behavior is by design." The fake's sweep expires (here: deletes) deferred messages
    like active ones."""
    async with FakeServiceBusClient(ns) as client:
        async with client.get_queue_sender("q") as sender:
            await sender.send_messages(ServiceBusMessage("d", time_to_live=timedelta(seconds=30)))
        async with client.get_queue_receiver("q") as receiver:
            [m] = await receiver.receive_messages(max_wait_time=0.05)
            await receiver.defer_message(m)
            clock.advance(timedelta(minutes=5))
            peeked = await receiver.peek_messages(max_message_count=10, sequence_number=1)
    assert [p.state for p in peeked] == [ServiceBusMessageState.DEFERRED]


async def test_settling_after_lock_expiry_raises_the_sdks_lock_lost(ns, clock):
    """Faithful (kept as a pin): the SDK's ``_settle_message_with_retry`` raises MessageLockLostError
    once ``locked_until_utc`` has passed; so does the fake."""
    async with FakeServiceBusClient(ns) as client:
        async with client.get_queue_sender("q") as sender:
            await sender.send_messages(ServiceBusMessage("x"))
        async with client.get_queue_receiver("q") as receiver:
            [m] = await receiver.receive_messages(max_wait_time=0.05)
            clock.advance(timedelta(seconds=61))
            with pytest.raises(MessageLockLostError):
                await receiver.renew_message_lock(m)
            with pytest.raises(MessageLockLostError):
                await receiver.complete_message(m)


# --- a handler shut down by an error, held against the SDK's own receiver --------------------------


class _NoNetworkHandler:
    """What the SDK's receiver opens as its AMQP handler, answering its management requests as the
    service does (a peek past every message: 204; a renewal: the new expiry; a settlement: 200), with
    no network. Everything above it is the installed SDK's own receiver code."""

    _shutdown = False
    _link = None  # (no receive link: a settlement goes by the management link, as the SDK falls back)

    def __init__(self) -> None:
        self.operations: list[str] = []
        self.peeked_from: list[int] = []

    async def open_async(self, connection: Any = None) -> None:
        self._shutdown = False

    async def client_ready_async(self) -> bool:
        return True

    async def close_async(self) -> None:
        self._shutdown = True

    async def mgmt_request_async(self, message: Any, *, operation: Any, **kwargs: Any) -> Any:
        from azure.servicebus._pyamqp.message import Message

        name = operation["VALUE"]
        self.operations.append(name)
        if name == "com.microsoft:peek-message":
            self.peeked_from.append(message.value["from-sequence-number"]["VALUE"])
            return 204, b"No Content", Message(application_properties={})
        if name == "com.microsoft:renew-lock":
            until = int((datetime.now(UTC) + timedelta(seconds=60)).timestamp() * 1000)
            return 200, b"OK", Message(value={b"expirations": [until]}, application_properties={})
        return 200, b"OK", Message(value={}, application_properties={})


def _sdk_receiver() -> tuple[Any, Any, _NoNetworkHandler]:
    """The SDK's own receiver, running (as after its first receive), and a message it received."""
    from azure.core.credentials import AzureNamedKeyCredential
    from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiveMode
    from azure.servicebus._pyamqp.message import Header, Message
    from azure.servicebus.aio import ServiceBusReceiver

    receiver = ServiceBusReceiver(
        fully_qualified_namespace="nowhere.servicebus.windows.net",
        credential=AzureNamedKeyCredential("name", "c2VjcmV0"),
        queue_name="q",
        receive_mode=ServiceBusReceiveMode.PEEK_LOCK,
    )
    handler = _NoNetworkHandler()

    def create_handler(auth: Any) -> None:  # (its own builds a pyamqp client that would connect)
        receiver._handler = handler

    receiver._create_handler = create_handler  # type: ignore[method-assign]
    until = int((datetime.now(UTC) + timedelta(seconds=60)).timestamp() * 1000)
    amqp = Message(
        data=[b"x"],
        header=Header(delivery_count=0),
        message_annotations={b"x-opt-sequence-number": 1, b"x-opt-locked-until": until},
        delivery_annotations={b"x-opt-lock-token": b"\x01" * 16},
    )
    message = ServiceBusReceivedMessage(amqp, receive_mode=ServiceBusReceiveMode.PEEK_LOCK, receiver=receiver)
    receiver._handler, receiver._running = handler, True  # as its first receive left it
    return receiver, message, handler


async def _outcomes(receiver: Any, message: Any) -> dict[str, str]:
    """What each renewal and settlement of ``message`` answers (none of them is applied: each is refused
    or only the renewal goes through)."""
    calls = {
        "renew": lambda: receiver.renew_message_lock(message, timeout=5),
        "complete": lambda: receiver.complete_message(message),
        "abandon": lambda: receiver.abandon_message(message),
        "defer": lambda: receiver.defer_message(message),
        "dead-letter": lambda: receiver.dead_letter_message(message, reason="r", error_description="d"),
    }
    out = {}
    for name, call in calls.items():
        try:
            await call()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "done"
            if name != "renew":
                break  # (a settlement that went through ends the message)
    return out


_CONNECTION_ERRORS = [
    # what the SDK maps each AMQP failure to, and whether it shuts the handler down
    ("socket", AMQPConnectionError, ErrorCondition.SocketError),
    ("communication", AMQPConnectionError, ErrorCondition.NotFound),
    ("server-busy", AMQPException, ERROR_CODE_SERVER_BUSY),
    ("timeout", AMQPException, ERROR_CODE_TIMEOUT),
]


@pytest.mark.parametrize(
    ("name", "kind", "condition"), _CONNECTION_ERRORS, ids=[c[0] for c in _CONNECTION_ERRORS]
)
async def test_an_error_shuts_the_handler_down_as_the_sdk_does_until_a_peek_opens_it(
    ns, clock, monkeypatch, name, kind, condition
):
    """The SDK closes a receiver's handler for an error it maps with ``shutdown_handler``
    (``_handle_exception``) and then refuses every renewal and settlement with a ValueError before
    trying to reconnect, until a receive or a management call (a peek) opens it again. The stand-in had
    no such state: an error raised in place of a call (as the fault suite raises it) left it usable,
    so no test ever met the refusal the provider could not handle (found in review). Here the SDK's
    own receiver and the stand-in's go through the same error and the same calls and must answer the
    same."""
    from queueing_core.fakes.servicebus import FakeServiceBusReceiver

    sdk, sdk_message, handler = _sdk_receiver()
    try:  # (it returns an error it would retry, and raises one it would not: closing first either way)
        error = await sdk._handle_exception(kind(condition, description="injected: the link went away"))
    except ServiceBusError as raised:
        error = raised

    async with FakeServiceBusClient(ns) as client:
        async with client.get_queue_sender("q") as sender:
            await sender.send_messages(ServiceBusMessage("x"))
        fake = client.get_queue_receiver("q")
        async with fake:
            [fake_message] = await fake.receive_messages(max_wait_time=0.05)
            real = FakeServiceBusReceiver.renew_message_lock

            async def fails(self: Any, message: Any, *, timeout: float | None = None) -> Any:
                raise error  # the SDK's own exception, raised in place of the call

            monkeypatch.setattr(FakeServiceBusReceiver, "renew_message_lock", fails)
            with pytest.raises(type(error)):
                await fake.renew_message_lock(fake_message, timeout=5)
            monkeypatch.setattr(FakeServiceBusReceiver, "renew_message_lock", real)

            shut = not sdk._running
            assert shut is error._shutdown_handler  # (the SDK's own rule)
            sdk_after, fake_after = await _outcomes(sdk, sdk_message), await _outcomes(fake, fake_message)
            assert fake_after == sdk_after
            if not shut:
                assert sdk_after == {"renew": "done", "complete": "done"}
                return
            assert set(sdk_after) == {"renew", "complete", "abandon", "defer", "dead-letter"}
            assert all("handler has already been shutdown" in said for said in sdk_after.values())

            # a peek from past every message opens both again, and finds (and locks) nothing
            assert await sdk.peek_messages(max_message_count=1, sequence_number=2**63 - 1, timeout=5) == []
            assert await fake.peek_messages(max_message_count=1, sequence_number=2**63 - 1, timeout=5) == []
            assert handler.peeked_from == [2**63 - 1]
            # the held message is renewed and settled by its lock token again
            assert await _outcomes(sdk, sdk_message) == {"renew": "done", "complete": "done"}
            assert await _outcomes(fake, fake_message) == {"renew": "done", "complete": "done"}
            assert handler.operations[-2:] == ["com.microsoft:renew-lock", "com.microsoft:update-disposition"]
