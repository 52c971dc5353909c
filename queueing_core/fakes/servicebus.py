"""An in-memory Azure Service Bus (queues only), shaped like the ``azure-servicebus`` 7.x async SDK.

Point a provider written on ``azure.servicebus.aio`` at it in tests::

    clock = FakeClock()
    namespace = FakeServiceBusNamespace(clock=clock)
    async with FakeServiceBusAdministrationClient(namespace) as admin:
        await admin.create_queue("orders", max_delivery_count=3, lock_duration=timedelta(seconds=30))
    async with FakeServiceBusClient(namespace) as client:           # stands in for ServiceBusClient
        async with client.get_queue_sender("orders") as sender:
            await sender.send_messages(ServiceBusMessage("hello"))
        async with client.get_queue_receiver("orders") as receiver:
            [msg] = await receiver.receive_messages(max_wait_time=5)
            await receiver.complete_message(msg)

Messages go in as real ``ServiceBusMessage`` objects and come out as :class:`FakeReceivedMessage`, which
has the attributes of ``ServiceBusReceivedMessage`` with the values the *Python* SDK returns:

* ``delivery_count`` is the AMQP header's count of earlier failed deliveries: 0 on the first receive.
  (The .NET SDK adds one and documents "starts at 1"; the Python SDK does not, and its own live tests
  assert 0.) A queue with ``max_delivery_count=N`` hands a message out N times, with counts 0..N-1.
* ``application_properties`` keys, and string values, come back as ``bytes``; datetimes as epoch
  milliseconds; ``None`` when the message has none.

It is not a ``ServiceBusReceivedMessage`` subclass (that class needs a live AMQP link), so code that
checks ``isinstance`` against the SDK class will refuse it.

Kept from the broker: peek-lock with lock expiry and renewal, abandon, defer, dead-lettering (explicit,
max delivery count, expiry), effective TTL, scheduled messages and cancellation, receive-and-delete,
the 256 KB Standard-tier size limit, duplicate detection, runtime counts, and **rights**: a client made
with ``rights=`` (or ``rights_of_roles(...)`` for Entra role assignments) is refused what those rights
do not allow, with the exception the SDK raises for the service's refusal. Without ``Manage`` (only
*Azure Service Bus Data Owner* grants it to an identity) every administration call answers HTTP 401,
which the SDK raises as ``azure.core.exceptions.ClientAuthenticationError`` (built here by azure-core's
own ``map_error``, as the SDK's generated client does); without ``Send`` or ``Listen`` the AMQP link is
refused with ``amqp:unauthorized-access``, which the SDK raises as ``ServiceBusAuthorizationError``
(built here by the SDK's own error mapping). Not modelled: sessions,
topics, transactions, auto-forwarding, partitioning, ``prefetch_count`` above 0 (such a receiver
behaves as with 0), ``AutoLockRenewer``, AMQP value and sequence bodies.

**Link credit**, as the SDK leaves it with ``prefetch_count=0`` (read from azure-servicebus 7.15):

* ``receive_messages(n)`` first returns what the receiver's buffer holds, then sets the link credit to
  what it still wants (``aio/_servicebus_receiver_async.py`` ``ServiceBusReceiver._receive``:
  ``reset_link_credit_async``, which is ``link.flow(link_credit=...)``, an absolute value). Credit the
  call did not use stays on the link after it returns: nothing takes it back until ``close()``.
* While credit is outstanding the broker pushes each message that becomes available into it, locked
  (or, in receive-and-delete mode, deleted) as it is sent. It sits in the receiver's buffer and the
  next receive returns it first, its lock running (or lapsed) meanwhile: a lapse counts a delivery.
* With no receive in progress, the SDK's keep-alive reads the link every 5 s
  (``_pyamqp/aio/_client_async.py`` ``_keep_alive_async``, ``keep_alive_interval=5`` for prefetch 0)
  and releases what it reads (``aio/_transport/_pyamqp_transport_async.py``
  ``enhanced_message_received_async``, peek-lock only). Modelled as a release of the buffer
  ``keep_alive_seconds`` (real asyncio time, like every wait here) after a message reached an idle
  receiver; a :class:`FakeClock` moved past a lock before then is a client that did not read its link
  meanwhile (a stalled process): the lock lapses first.
* ``close()`` takes the credit back and releases what the buffer holds (``_close_handler``,
  ``drain_and_release_messages_async``; peek-lock receivers only: a receive-and-delete receiver's
  buffered messages are already gone from the broker, and are lost). A release ends the lock without
  counting a delivery (AMQP ``released``: Service Bus does not count it).

**Handler shut down by an error**, as the SDK leaves a receiver (azure-servicebus 7.15): an operation
that fails with a ``ServiceBusError`` whose ``_shutdown_handler`` is set (a connection or communication
error, a refused link, a missing entity: ``exceptions.py``) closes the receiver's handler
(``aio/_base_handler_async.py`` ``_handle_exception`` -> ``_close_handler``, which releases what the
link buffered). From then on ``renew_message_lock`` and every settlement are refused with the SDK's
``ValueError`` ("Failed to complete the message as the handler has already been shutdown.")
before anything is sent (``_common/receiver_mixins.py`` ``_check_message_alive``), until an operation
that opens the handler again: a receive, a peek or another management call, or ``async with``. The
locks it holds are the broker's and stay. This holds for an error raised here and for one a test
raises in place of an operation (a method of :class:`FakeServiceBusReceiver` replaced on the class,
as the fault suite does): the class wraps every operation installed on it.

Time comes from the namespace's clock. Pass a :class:`FakeClock` to move time by hand (advancing it
wakes waiting receivers; with a clock of your own, call ``namespace.wake_waiters()`` after moving it).
Waits given in seconds (``max_wait_time``) are always real asyncio time.
Everything runs in one event loop and each state change completes without an ``await`` in between,
so competing receivers can never take the same message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self

from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    map_error,
)
from azure.servicebus import (
    ServiceBusMessage,
    ServiceBusMessageBatch,
    ServiceBusMessageState,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.aio import AutoLockRenewer
from azure.servicebus.amqp import AmqpAnnotatedMessage, AmqpMessageBodyType
from azure.servicebus.exceptions import (
    MessageAlreadySettled,
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusAuthorizationError,
    ServiceBusError,
)
from azure.servicebus.management import QueueProperties

from ..clock import Clock, as_utc, utcnow

__all__ = [
    "ALL_RIGHTS",
    "DEFAULT_RECEIVE_WAIT_SECONDS",
    "KEEP_ALIVE_SECONDS",
    "LISTEN",
    "MANAGE",
    "MAX_DELIVERY_COUNT_EXCEEDED",
    "ROLE_RIGHTS",
    "SEND",
    "STANDARD_MAX_MESSAGE_BYTES",
    "TIMESPAN_MAX",
    "TTL_EXPIRED",
    "FakeClock",
    "FakeMessageBatch",
    "FakeQueueRuntimeProperties",
    "FakeReceivedMessage",
    "FakeServiceBusAdministrationClient",
    "FakeServiceBusClient",
    "FakeServiceBusNamespace",
    "FakeServiceBusReceiver",
    "FakeServiceBusSender",
    "rights_of_roles",
]

#: largest message (and batch) a Standard-tier entity accepts
STANDARD_MAX_MESSAGE_BYTES = 256 * 1024
#: the SDK's receive wait when neither the call nor the receiver gives one
DEFAULT_RECEIVE_WAIT_SECONDS = 60.0
#: how often the SDK's keep-alive reads a receive link with prefetch 0 (``keep_alive_interval``), seconds
KEEP_ALIVE_SECONDS = 5.0
#: what the service reports for "no limit" (.NET ``TimeSpan.MaxValue``), e.g. the default message TTL
TIMESPAN_MAX = timedelta(days=10675199, seconds=10085, microseconds=477581)
MAX_DELIVERY_COUNT_EXCEEDED = "MaxDeliveryCountExceeded"
TTL_EXPIRED = "TTLExpiredException"
_MAX_LOCK_DURATION = timedelta(minutes=5)
# the broker carries dead-letter reasons as application properties; the SDK reads them back from there
_REASON_KEY = "DeadLetterReason"
_DESCRIPTION_KEY = "DeadLetterErrorDescription"
_SHUTDOWN = "The handler has already been shutdown. Please use ServiceBusClient to create a new instance."
#: what ``_check_message_alive`` (azure-servicebus 7.15 ``_common/receiver_mixins.py``) answers a renewal
#: or settlement once an error shut the handler down; the action is the SDK's word for the operation
#: ("renew", "complete", "abandon", "dead-letter", "defer")
_HANDLER_SHUT = (
    "Failed to {} the message as the handler has already been shutdown."
    "Please use ServiceBusClient to create a new instance."
)


# --- rights -------------------------------------------------------------------------------------

#: the claims a SAS policy carries, and what an Entra role maps to on the service
MANAGE, SEND, LISTEN = "Manage", "Send", "Listen"
ALL_RIGHTS: frozenset[str] = frozenset({MANAGE, SEND, LISTEN})
#: Azure's built-in Service Bus data roles, by role definition id (the same in every tenant)
ROLE_RIGHTS: Mapping[str, frozenset[str]] = {
    "090c5cfd-751d-490a-894a-3ce6f1109419": ALL_RIGHTS,  # Azure Service Bus Data Owner
    "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39": frozenset({SEND}),  # Azure Service Bus Data Sender
    "4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0": frozenset({LISTEN}),  # Azure Service Bus Data Receiver
}


#: the scope a Service Bus client asks its Entra credential for
SERVICE_BUS_SCOPE = "https://servicebus.azure.net/.default"


def rights_of_roles(role_definition_ids: Iterable[str]) -> frozenset[str]:
    """The rights an identity holds on a namespace through these role assignments (others grant none)."""
    held: set[str] = set()
    for role in role_definition_ids:
        held |= ROLE_RIGHTS.get(role.lower(), frozenset())
    return frozenset(held)


def _object_id(token: str) -> str | None:
    """The ``oid`` claim of a JWT access token (what the service reads once it has validated it)."""
    import base64
    import json

    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    oid = claims.get("oid") if isinstance(claims, dict) else None
    return oid if isinstance(oid, str) else None


class _Caller:
    """Who a client is: the claims of a SAS policy, or an Entra credential whose token's identity holds
    roles on the namespace (``FakeServiceBusNamespace.role_assignments``), asked again on every call."""

    def __init__(
        self, namespace: FakeServiceBusNamespace, rights: Iterable[str], credential: Any | None
    ) -> None:
        self.namespace = namespace
        self.fixed = frozenset(rights)
        self.credential = credential

    async def rights(self) -> frozenset[str]:
        if self.credential is None:
            return self.fixed
        token = await self.credential.get_token(SERVICE_BUS_SCOPE)
        oid = _object_id(token.token)
        return rights_of_roles(self.namespace.role_assignments.get(oid, ())) if oid else frozenset()


class _Response:
    """The little of an HTTP response azure-core's ``HttpResponseError`` reads."""

    def __init__(self, status_code: int, reason: str, body: str) -> None:
        self.status_code = status_code
        self.reason = reason
        self._body = body

    def text(self, encoding: str | None = None) -> str:
        return self._body


def _refuse_management(namespace: FakeServiceBusNamespace, entity: str | None, *, write: bool) -> None:
    """What the service answers an administration call without Manage: 401 with its XML error body,
    turned into an exception by azure-core's ``map_error`` exactly as the SDK's generated client does."""
    claim = "Manage,EntityWrite" if write else "Manage,EntityRead"
    tracker = f"{namespace.fully_qualified_namespace}:" + (
        f"Queue:{entity}" if entity else "$Resources/queues"
    )
    body = (
        f"<Error><Code>401</Code><Detail>{claim} claims required for this operation. "
        f"TrackingId:{uuid.uuid4()}_G1, SystemTracker:{tracker}, "
        f"Timestamp:{namespace.now():%Y-%m-%dT%H:%M:%S}</Detail></Error>"
    )
    map_error(401, _Response(401, "Unauthorized", body), {401: ClientAuthenticationError})  # type: ignore[arg-type]


def _refuse_link(namespace: FakeServiceBusNamespace, entity: str, claim: str) -> ServiceBusError:
    """What the service answers a link without the claim, through the SDK's own AMQP error mapping."""
    description = (
        f"Unauthorized access. '{claim}' claim(s) are required to perform this operation. "
        f"Resource: 'sb://{namespace.fully_qualified_namespace}/{entity.lower()}'. "
        f"TrackingId:{uuid.uuid4()}_G1, SystemTracker:gateway, Timestamp:{namespace.now():%Y-%m-%dT%H:%M:%S}"
    )
    try:
        import logging

        from azure.servicebus._pyamqp.error import AMQPException, ErrorCondition
        from azure.servicebus._transport._pyamqp_transport import PyamqpTransport
    except ImportError:  # a later SDK moved its transport: the same exception type, built by hand
        return ServiceBusAuthorizationError(
            message=f"{description} Error condition: amqp:unauthorized-access."
        )
    error: ServiceBusError = PyamqpTransport.create_servicebus_exception(
        logging.getLogger("azure.servicebus"),
        AMQPException(condition=ErrorCondition.UnauthorizedAccess, description=description),
    )
    return error


class FakeClock:
    """A UTC clock that moves only when told to; advancing it wakes receivers waiting on its namespaces."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = as_utc(start) if start is not None else datetime(2026, 1, 1, tzinfo=UTC)
        self._namespaces: weakref.WeakSet[FakeServiceBusNamespace] = weakref.WeakSet()

    def __call__(self) -> datetime:
        return self._now

    def advance(self, delta: timedelta | float) -> datetime:
        """Move forward by ``delta`` (a timedelta or seconds); return the new time."""
        step = delta if isinstance(delta, timedelta) else timedelta(seconds=delta)
        if step < timedelta(0):
            raise ValueError("a FakeClock only moves forward")
        self._now += step
        for namespace in list(self._namespaces):
            namespace.wake_waiters()
        return self._now

    def _attach(self, namespace: FakeServiceBusNamespace) -> None:
        self._namespaces.add(namespace)


# --- broker state -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Payload:
    """What the broker keeps of a sent message: a copy, since the sender may reuse its object."""

    body: bytes | None
    application_properties: dict[str | bytes, Any] | None
    message_id: str | None
    correlation_id: str | None
    subject: str | None
    content_type: str | None
    to: str | None
    reply_to: str | None
    reply_to_session_id: str | None
    session_id: str | None
    partition_key: str | None
    time_to_live: timedelta | None
    scheduled_enqueue_time_utc: datetime | None

    @classmethod
    def of(cls, message: ServiceBusMessage) -> _Payload:
        if message.body_type == AmqpMessageBodyType.DATA:
            body: bytes | None = b"".join(message.body)
        elif message.body_type == AmqpMessageBodyType.VALUE and message.body is None:
            body = None
        else:
            raise TypeError("the fake keeps str and bytes bodies only (no AMQP value or sequence bodies)")
        props = message.application_properties
        scheduled = message.scheduled_enqueue_time_utc
        return cls(
            body=body,
            application_properties=dict(props) if props else None,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            subject=message.subject,
            content_type=message.content_type,
            to=message.to,
            reply_to=message.reply_to,
            reply_to_session_id=message.reply_to_session_id,
            session_id=message.session_id,
            partition_key=message.partition_key,
            time_to_live=message.time_to_live,
            scheduled_enqueue_time_utc=as_utc(scheduled) if scheduled is not None else None,
        )


@dataclass(slots=True, eq=False)
class _Entry:
    sequence_number: int
    payload: _Payload
    #: when the message is (or, while scheduled, will be) active; TTL counts from here
    enqueued_at: datetime
    #: effective TTL, min(message, queue default); None = never expires
    time_to_live: timedelta | None
    scheduled: bool = False
    deferred: bool = False
    in_dead_letter: bool = False
    #: the SDK's delivery_count: earlier deliveries that were abandoned or whose lock expired
    failed_deliveries: int = 0
    lock_token: uuid.UUID | None = None
    locked_until: datetime | None = None

    @property
    def expires_at(self) -> datetime | None:
        if self.time_to_live is None:
            return None
        try:
            return self.enqueued_at + self.time_to_live
        except OverflowError:
            return None

    def available(self) -> bool:
        return not (self.scheduled or self.deferred or self.lock_token is not None)


_DURATION_SETTINGS = frozenset(
    {
        "lock_duration",
        "default_message_time_to_live",
        "duplicate_detection_history_time_window",
        "auto_delete_on_idle",
    }
)


@dataclass(frozen=True, slots=True)
class _Settings:
    """A queue's description, with the service's defaults."""

    max_delivery_count: int = 10
    lock_duration: timedelta = timedelta(seconds=60)
    default_message_time_to_live: timedelta = TIMESPAN_MAX
    dead_lettering_on_message_expiration: bool = False
    requires_duplicate_detection: bool = False
    duplicate_detection_history_time_window: timedelta = timedelta(minutes=10)
    # kept so properties round-trip; no behaviour behind them
    auto_delete_on_idle: timedelta = TIMESPAN_MAX
    enable_batched_operations: bool = True
    enable_express: bool = False
    enable_partitioning: bool = False
    max_size_in_megabytes: int = 1024
    max_message_size_in_kilobytes: int | None = None
    user_metadata: str | None = None
    authorization_rules: list[Any] | None = None
    status: str = "Active"

    def updated(self, values: Mapping[str, Any]) -> _Settings:
        """These settings with every non-None value of ``values`` applied, validated like the service."""
        changes: dict[str, Any] = {}
        for name, value in values.items():
            if value is None:
                continue
            if name in _DURATION_SETTINGS and not isinstance(value, timedelta):
                raise TypeError(f"{name}: the fake takes a timedelta, not {type(value).__name__}")
            changes[name] = value
        settings = dataclasses.replace(self, **changes)
        # the service answers these with 400 Bad Request
        if settings.max_delivery_count < 1:
            raise HttpResponseError(message="max_delivery_count must be at least 1.")
        if not timedelta(0) < settings.lock_duration <= _MAX_LOCK_DURATION:
            raise HttpResponseError(message="lock_duration must be positive and at most 5 minutes.")
        if settings.default_message_time_to_live <= timedelta(0):
            raise HttpResponseError(message="default_message_time_to_live must be positive.")
        return settings

    def to_properties(self, name: str) -> QueueProperties:
        return QueueProperties(
            name,
            authorization_rules=self.authorization_rules,
            auto_delete_on_idle=self.auto_delete_on_idle,
            dead_lettering_on_message_expiration=self.dead_lettering_on_message_expiration,
            default_message_time_to_live=self.default_message_time_to_live,
            duplicate_detection_history_time_window=self.duplicate_detection_history_time_window,
            availability_status="Available",
            enable_batched_operations=self.enable_batched_operations,
            enable_express=self.enable_express,
            enable_partitioning=self.enable_partitioning,
            lock_duration=self.lock_duration,
            max_delivery_count=self.max_delivery_count,
            max_size_in_megabytes=self.max_size_in_megabytes,
            requires_duplicate_detection=self.requires_duplicate_detection,
            requires_session=False,
            status=self.status,
            forward_to=None,
            user_metadata=self.user_metadata,
            forward_dead_lettered_messages_to=None,
            max_message_size_in_kilobytes=self.max_message_size_in_kilobytes,
        )


_SETTING_NAMES = tuple(f.name for f in dataclasses.fields(_Settings))


def _reject_unmodelled(
    requires_session: bool | None, forward_to: str | None, forward_dead_lettered_messages_to: str | None
) -> None:
    if requires_session:
        raise NotImplementedError("the fake Service Bus has no sessions")
    if forward_to or forward_dead_lettered_messages_to:
        raise NotImplementedError("the fake Service Bus does not auto-forward")


class _Queue:
    """One queue and its dead-letter sub-queue. Entries are keyed by sequence number, in arrival order."""

    def __init__(self, name: str, settings: _Settings, now: datetime, clock: Clock = utcnow) -> None:
        self.name = name
        self._clock = clock
        self.settings = settings
        self.active: dict[int, _Entry] = {}
        self.dead_letter: dict[int, _Entry] = {}
        self.created_at = self.updated_at = self.accessed_at = now
        self._sequence = itertools.count(1)
        self._seen_message_ids: dict[str, datetime] = {}

    def now(self) -> datetime:
        """The namespace's time, for what a received message says of its lock."""
        return as_utc(self._clock())

    def sub(self, dead_letter: bool) -> dict[int, _Entry]:
        return self.dead_letter if dead_letter else self.active

    def enqueue(self, payload: _Payload, now: datetime, scheduled_at: datetime | None) -> int:
        sequence_number = next(self._sequence)
        self.accessed_at = now
        if self._is_duplicate(payload.message_id, now):
            return sequence_number  # accepted, then dropped: that is what duplicate detection does
        due = max(now, scheduled_at) if scheduled_at is not None else now
        self.active[sequence_number] = _Entry(
            sequence_number, payload, due, self._effective_ttl(payload.time_to_live), scheduled=due > now
        )
        return sequence_number

    def _is_duplicate(self, message_id: str | None, now: datetime) -> bool:
        if not self.settings.requires_duplicate_detection or message_id is None:
            return False
        window = self.settings.duplicate_detection_history_time_window
        self._seen_message_ids = {m: t for m, t in self._seen_message_ids.items() if now - t < window}
        if message_id in self._seen_message_ids:
            return True
        self._seen_message_ids[message_id] = now
        return False

    def _effective_ttl(self, message_ttl: timedelta | None) -> timedelta | None:
        # a message's TTL cannot outlive the queue's default; the service silently shortens it
        limit = self.settings.default_message_time_to_live
        ttl = limit if message_ttl is None else min(message_ttl, limit)
        return None if ttl >= TIMESPAN_MAX else ttl

    def sweep(self, now: datetime) -> bool:
        """Apply what time has made due (schedules, lock expiry, message expiry); True if anything changed."""
        changed = False
        for entry in list(self.active.values()):
            if entry.scheduled and entry.enqueued_at <= now:
                # "appended to the queue as if it had been enqueued at the current instant, which
                # includes assigning a new SequenceNumber" (Message sequencing and timestamps)
                del self.active[entry.sequence_number]
                entry.scheduled = False
                entry.sequence_number = next(self._sequence)
                self.active[entry.sequence_number] = entry
                changed = True
            if entry.locked_until is not None and entry.locked_until <= now:
                self.release(entry)
                changed = True
                if self.active.get(entry.sequence_number) is not entry:
                    continue  # dead-lettered at the delivery limit
            # a locked message does not expire under its holder, who may still complete it
            expires_at = entry.expires_at
            # nor does a deferred one: it waits for a receive by its sequence number (Message deferral)
            if (
                entry.lock_token is None
                and not entry.scheduled
                and not entry.deferred
                and expires_at is not None
                and expires_at <= now
            ):
                self._expire(entry)
                changed = True
        for entry in list(self.dead_letter.values()):
            if entry.locked_until is not None and entry.locked_until <= now:
                self.release(entry)
                changed = True
        return changed

    def _expire(self, entry: _Entry) -> None:
        if self.settings.dead_lettering_on_message_expiration:
            self.move_to_dead_letter(entry, TTL_EXPIRED, "The message expired and was dead lettered.")
        else:
            del self.active[entry.sequence_number]

    def next_change(self) -> datetime | None:
        """The next instant at which :meth:`sweep` would change something."""
        times = [e.locked_until for e in self.dead_letter.values() if e.locked_until is not None]
        for entry in self.active.values():
            if entry.locked_until is not None:
                times.append(entry.locked_until)
            elif entry.scheduled:
                times.append(entry.enqueued_at)
            elif (expires_at := entry.expires_at) is not None:
                times.append(expires_at)
        return min(times, default=None)

    def take(self, dead_letter: bool, now: datetime, count: int, *, lock: bool) -> list[_Entry]:
        sub = self.sub(dead_letter)
        taken = list(itertools.islice((e for e in sub.values() if e.available()), count))
        for entry in taken:
            if lock:
                self.lock(entry, now)
            else:
                del sub[entry.sequence_number]
        if taken:
            self.accessed_at = now
        return taken

    def lock(self, entry: _Entry, now: datetime) -> None:
        entry.lock_token = uuid.uuid4()
        entry.locked_until = now + self.settings.lock_duration

    def unlock(self, entry: _Entry) -> None:
        """End a lock without counting a delivery: the AMQP ``released`` outcome."""
        entry.lock_token = entry.locked_until = None

    def release(self, entry: _Entry) -> None:
        """End a failed delivery (abandoned, or its lock expired): count it; dead-letter at the limit."""
        entry.lock_token = entry.locked_until = None
        entry.failed_deliveries += 1
        limit = self.settings.max_delivery_count
        if not entry.in_dead_letter and entry.failed_deliveries >= limit:
            self.move_to_dead_letter(
                entry,
                MAX_DELIVERY_COUNT_EXCEEDED,
                f"Message could not be consumed after {limit} delivery attempts.",
            )

    def move_to_dead_letter(self, entry: _Entry, reason: str | None, description: str | None) -> None:
        del self.active[entry.sequence_number]
        props = dict(entry.payload.application_properties or {})
        if reason is not None:
            props[_REASON_KEY] = reason
        if description is not None:
            props[_DESCRIPTION_KEY] = description
        payload = dataclasses.replace(entry.payload, application_properties=props or None)
        # a fresh delivery count; TTL is kept for display but not enforced in the dead-letter queue
        self.dead_letter[entry.sequence_number] = _Entry(
            entry.sequence_number, payload, entry.enqueued_at, entry.time_to_live, in_dead_letter=True
        )

    def runtime_properties(self) -> FakeQueueRuntimeProperties:
        scheduled = sum(1 for e in self.active.values() if e.scheduled)
        active = len(self.active) - scheduled  # locked and deferred messages are still in the queue
        dead = len(self.dead_letter)
        entries = itertools.chain(self.active.values(), self.dead_letter.values())
        return FakeQueueRuntimeProperties(
            name=self.name,
            active_message_count=active,
            scheduled_message_count=scheduled,
            dead_letter_message_count=dead,
            transfer_dead_letter_message_count=0,
            transfer_message_count=0,
            total_message_count=active + scheduled + dead,
            size_in_bytes=sum(len(e.payload.body or b"") for e in entries),
            created_at_utc=self.created_at,
            updated_at_utc=self.updated_at,
            accessed_at_utc=self.accessed_at,
        )


class FakeServiceBusNamespace:
    """The shared broker state: create one per test and hand it to clients (several may share it)."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        fully_qualified_namespace: str = "fake.servicebus.windows.net",
        max_message_size_in_bytes: int = STANDARD_MAX_MESSAGE_BYTES,
        role_assignments: Mapping[str, Iterable[str]] | None = None,
        keep_alive_seconds: float | None = KEEP_ALIVE_SECONDS,
    ) -> None:
        self.clock: Clock = clock if clock is not None else utcnow
        #: how long a message pushed into an idle receiver's credit stays locked before the SDK's
        #: keep-alive releases it (real seconds); None: never (a client that does not read its link)
        self.keep_alive_seconds = keep_alive_seconds
        #: Azure RBAC on the namespace: principal (object) id -> role definition ids, for clients that
        #: sign in with an Entra credential
        self.role_assignments: dict[str, list[str]] = {
            principal: list(roles) for principal, roles in (role_assignments or {}).items()
        }
        self.fully_qualified_namespace = fully_qualified_namespace
        self.max_message_size_in_bytes = max_message_size_in_bytes
        self._queues: dict[str, _Queue] = {}  # by lower-cased name: entity names are case-insensitive
        self._changed = asyncio.Event()
        #: open receivers that have had link credit, in the order they first asked: the broker's pushes
        self._credited: list[FakeServiceBusReceiver] = []
        self._offering = False
        if isinstance(clock, FakeClock):
            clock._attach(self)

    def now(self) -> datetime:
        return as_utc(self.clock())

    def wake_waiters(self) -> None:
        """Make waiting receivers look again (``FakeClock.advance`` does this; so must your own clock)."""
        # a fresh event per change: each waiter holds the one it saw before it last looked
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        self._offer()

    def _offer(self) -> None:
        """The broker pushing what is available into receivers' outstanding link credit, at once."""
        if self._offering:
            return
        self._offering = True
        try:
            now = self.now()
            # which link with credit the service fills first is not specified: a receive in progress
            # here, then the others in the order they first asked
            for receiver in sorted(self._credited, key=lambda r: not r._receiving):
                queue = self._find(receiver.entity_name)
                if queue is not None and receiver._credit > 0:
                    queue.sweep(now)  # (a lapsed lock frees its message for the push)
                    receiver._fill(queue, now)
        finally:
            self._offering = False

    @property
    def queue_names(self) -> list[str]:
        return [q.name for q in self._queues.values()]

    def _find(self, name: str) -> _Queue | None:
        return self._queues.get(name.lower())

    def _queue(self, name: str) -> _Queue:
        """The live queue, with everything due by now applied."""
        queue = self._find(name)
        if queue is None:
            raise MessagingEntityNotFoundError(
                message=f"The messaging entity '{self.fully_qualified_namespace}/{name}' could not be found."
            )
        if queue.sweep(self.now()):
            self.wake_waiters()
        return queue


# --- client side --------------------------------------------------------------------------------


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and timeout <= 0:
        raise ValueError("The timeout must be greater than 0.")


def _received_value(value: Any) -> Any:
    # what the AMQP decoder hands back: strings as bytes, timestamps as epoch milliseconds
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, datetime):
        return int(as_utc(value).timestamp() * 1000)
    return value


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value if isinstance(value, str) else None


class FakeReceivedMessage:
    """A received message with the attributes of ``ServiceBusReceivedMessage`` and the SDK's value shapes.

    ``b"".join(msg.body)`` gives the body bytes and ``str(msg)`` the decoded text. ``lock_token`` and
    ``locked_until_utc`` are ``None`` once the message is settled, and for peeked or receive-and-delete
    messages.
    """

    def __init__(
        self,
        entry: _Entry,
        source: _Queue,
        *,
        state: ServiceBusMessageState,
        locked: bool,
        peeked: bool = False,
    ) -> None:
        payload = entry.payload
        self._payload = payload
        self._source = source
        self._dead_letter = entry.in_dead_letter
        self._peeked = peeked
        self._settled = not locked and not peeked  # receive-and-delete messages arrive settled
        self._lock_token = entry.lock_token if locked else None
        self._locked_until = entry.locked_until if locked else None
        self._now = source.now
        self.auto_renew_error: Exception | None = None
        self.sequence_number: int = entry.sequence_number
        self.enqueued_sequence_number: int = entry.sequence_number
        self.enqueued_time_utc: datetime = entry.enqueued_at
        self.time_to_live: timedelta | None = entry.time_to_live
        self.delivery_count: int = entry.failed_deliveries
        self.state = state
        self.message_id = payload.message_id
        self.correlation_id = payload.correlation_id
        self.subject = payload.subject
        self.content_type = payload.content_type
        self.to = payload.to
        self.reply_to = payload.reply_to
        self.reply_to_session_id = payload.reply_to_session_id
        self.session_id = payload.session_id
        self.partition_key = payload.partition_key
        self.scheduled_enqueue_time_utc = payload.scheduled_enqueue_time_utc
        props = payload.application_properties
        self.application_properties: dict[str | bytes, Any] | None = (
            {(k.encode("utf-8") if isinstance(k, str) else k): _received_value(v) for k, v in props.items()}
            if props
            else None
        )
        self.dead_letter_reason = _text(props.get(_REASON_KEY)) if props else None
        self.dead_letter_error_description = _text(props.get(_DESCRIPTION_KEY)) if props else None
        #: set by the service only for messages auto-forwarded out of a dead-letter queue
        self.dead_letter_source: str | None = None

    @property
    def body(self) -> Iterator[bytes] | None:
        """The data sections, like the SDK's data body (``None`` for a message sent with body ``None``)."""
        if self._payload.body is None:
            return None
        return iter((self._payload.body,))

    @property
    def body_type(self) -> AmqpMessageBodyType:
        return AmqpMessageBodyType.VALUE if self._payload.body is None else AmqpMessageBodyType.DATA

    @property
    def lock_token(self) -> uuid.UUID | None:
        return None if self._settled else self._lock_token

    @property
    def locked_until_utc(self) -> datetime | None:
        return None if self._settled else self._locked_until

    @property
    def _lock_expired(self) -> bool:
        """As the SDK's (``_common/message.py``): whether ``locked_until_utc`` has passed; the SDK refuses
        to settle such a message (``MessageLockLostError``) without asking the service."""
        until = self.locked_until_utc
        return until is not None and until <= self._now()

    @property
    def expires_at_utc(self) -> datetime | None:
        if self.time_to_live is None:
            return None
        return self.enqueued_time_utc + self.time_to_live

    def __str__(self) -> str:
        body = self._payload.body
        return "None" if body is None else body.decode("utf-8")

    def __repr__(self) -> str:
        return (
            f"FakeReceivedMessage(sequence_number={self.sequence_number}, message_id={self.message_id!r}, "
            f"delivery_count={self.delivery_count}, state={self.state.name}, body={str(self)[:80]!r})"
        )

    def _to_outgoing(self) -> ServiceBusMessage:
        # re-sending a received message (a dead-letter replay, say) sends a copy without broker state
        return ServiceBusMessage(
            self._payload.body,
            application_properties=dict(self.application_properties) if self.application_properties else None,
            message_id=self.message_id,
            correlation_id=self.correlation_id,
            subject=self.subject,
            content_type=self.content_type,
            to=self.to,
            reply_to=self.reply_to,
            reply_to_session_id=self.reply_to_session_id,
            session_id=self.session_id,
            partition_key=self.partition_key,
            time_to_live=self._payload.time_to_live,
        )


_Sendable = ServiceBusMessage | FakeReceivedMessage


def _outgoing(message: Any) -> ServiceBusMessage:
    if isinstance(message, ServiceBusMessage):
        return message
    if isinstance(message, FakeReceivedMessage):
        return message._to_outgoing()
    raise TypeError(
        f"the fake sends ServiceBusMessage objects (and messages it handed out), not {type(message).__name__}"
    )


class FakeMessageBatch(ServiceBusMessageBatch):
    """A real ``ServiceBusMessageBatch`` (so the SDK's own size accounting) that remembers its messages."""

    def __init__(self, max_size_in_bytes: int) -> None:
        super().__init__(max_size_in_bytes=max_size_in_bytes)
        self.messages: list[ServiceBusMessage] = []

    def add_message(
        self, message: ServiceBusMessage | FakeReceivedMessage | AmqpAnnotatedMessage | Mapping[str, Any]
    ) -> None:
        outgoing = _outgoing(message)
        super().add_message(outgoing)  # raises MessageSizeExceededError when full
        self.messages.append(outgoing)


def _check_size(message: ServiceBusMessage, limit: int) -> None:
    try:
        FakeMessageBatch(limit).add_message(message)
    except MessageSizeExceededError:
        raise MessageSizeExceededError(
            message=f"The message is larger than the entity's limit of {limit} bytes."
        ) from None


class _Closing:
    """``async with`` closes it on the way out, as the SDK's clients, senders and receivers do."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        pass


class _Link(_Closing):
    """What a sender and a receiver share: one queue, an async context, and no use after close."""

    #: the claim the service checks when this kind of link attaches
    claim = ""

    def __init__(
        self, namespace: FakeServiceBusNamespace, queue_name: str, caller: _Caller | None = None
    ) -> None:
        self._namespace = namespace
        self.entity_name = queue_name
        self.fully_qualified_namespace = namespace.fully_qualified_namespace
        self._caller = caller or _Caller(namespace, ALL_RIGHTS, None)
        self._closed = False

    async def __aenter__(self) -> Self:
        await self._authorize()
        self._namespace._queue(self.entity_name)  # opening the link fails on a missing entity
        return self

    async def close(self) -> None:
        # like the service, messages a receiver still holds stay locked until their lock expires
        self._closed = True

    def _check_live(self) -> None:
        if self._closed:
            raise ValueError(_SHUTDOWN)

    async def _authorize(self) -> None:
        """The handler is open and the caller holds the claim this kind of link needs."""
        self._check_live()
        if self.claim not in await self._caller.rights():
            raise _refuse_link(self._namespace, self.entity_name, self.claim)


class FakeServiceBusSender(_Link):
    """Mirrors ``azure.servicebus.aio.ServiceBusSender`` for one queue."""

    claim = SEND

    async def send_messages(
        self,
        message: _Sendable | Iterable[_Sendable] | ServiceBusMessageBatch,
        *,
        timeout: float | None = None,
    ) -> None:
        """Send one message, a list (sent as one batch, so it must fit in one), or a batch."""
        await self._authorize()
        _check_timeout(timeout)
        queue = self._namespace._queue(self.entity_name)
        limit = self._namespace.max_message_size_in_bytes
        if isinstance(message, FakeMessageBatch):
            outgoing = list(message.messages)
        elif isinstance(message, ServiceBusMessageBatch):
            # built by hand, so with the SDK's 1 MB default cap rather than the entity's limit
            if message.size_in_bytes > limit:
                raise MessageSizeExceededError(
                    message=f"The batch is larger than the entity's limit of {limit} bytes."
                )
            outgoing = list(message._messages)  # the SDK reads a foreign batch the same way
        elif isinstance(message, _Sendable):
            outgoing = [_outgoing(message)]
            _check_size(outgoing[0], limit)
        else:
            batch = FakeMessageBatch(limit)
            for item in message:
                batch.add_message(item)
            outgoing = batch.messages
        payloads = [_Payload.of(m) for m in outgoing]
        now = self._namespace.now()
        for payload in payloads:
            queue.enqueue(payload, now, payload.scheduled_enqueue_time_utc)
        self._namespace.wake_waiters()

    async def create_message_batch(self, max_size_in_bytes: int | None = None) -> FakeMessageBatch:
        await self._authorize()
        limit = self._namespace.max_message_size_in_bytes
        if max_size_in_bytes and max_size_in_bytes > limit:
            raise ValueError(
                f"Max message size: {max_size_in_bytes} is too large, "
                f"acceptable max batch size is: {limit} bytes."
            )
        return FakeMessageBatch(max_size_in_bytes or limit)

    async def schedule_messages(
        self,
        messages: _Sendable | Iterable[_Sendable],
        schedule_time_utc: datetime,
        *,
        timeout: float | None = None,
    ) -> list[int]:
        """Enqueue at ``schedule_time_utc`` (naive = UTC); return the sequence numbers, for cancelling."""
        await self._authorize()
        _check_timeout(timeout)
        queue = self._namespace._queue(self.entity_name)
        items = [messages] if isinstance(messages, _Sendable) else list(messages)
        outgoing = [_outgoing(m) for m in items]
        for m in outgoing:
            _check_size(m, self._namespace.max_message_size_in_bytes)
        at = as_utc(schedule_time_utc)
        now = self._namespace.now()
        numbers = [
            queue.enqueue(dataclasses.replace(_Payload.of(m), scheduled_enqueue_time_utc=at), now, at)
            for m in outgoing
        ]
        self._namespace.wake_waiters()
        return numbers

    async def cancel_scheduled_messages(
        self, sequence_numbers: int | list[int], *, timeout: float | None = None
    ) -> None:
        await self._authorize()
        _check_timeout(timeout)
        numbers = [sequence_numbers] if isinstance(sequence_numbers, int) else list(sequence_numbers)
        queue = self._namespace._queue(self.entity_name)
        missing = [n for n in numbers if not ((e := queue.active.get(n)) is not None and e.scheduled)]
        if missing:  # already enqueued, already cancelled, or never scheduled; nothing is cancelled then
            raise MessageNotFoundError(message=f"No scheduled message with sequence number(s) {missing}.")
        for n in numbers:
            queue.active.pop(n, None)
        self._namespace.wake_waiters()


def _is_dead_letter(sub_queue: ServiceBusSubQueue | str | None) -> bool:
    if sub_queue is None:
        return False
    value = sub_queue if isinstance(sub_queue, ServiceBusSubQueue) else ServiceBusSubQueue(sub_queue.lower())
    if value is ServiceBusSubQueue.DEAD_LETTER:
        return True
    raise NotImplementedError("the fake has no transfer dead-letter queue (it never forwards)")


#: the receiver's operations that run through the SDK's ``_do_retryable_operation`` (or, for
#: ``__aenter__``, ``_open_with_retry``): an error that leaves one of them goes through
#: ``_handle_exception`` first
_HANDLER_OPERATIONS = frozenset(
    {
        "__aenter__",
        "__anext__",
        "receive_messages",
        "receive_deferred_messages",
        "peek_messages",
        "renew_message_lock",
        "complete_message",
        "abandon_message",
        "defer_message",
        "dead_letter_message",
    }
)
_KEEPS_HANDLER_STATE = "_fake_servicebus_keeps_handler_state"


def _shuts_the_handler(exc: BaseException) -> bool:
    """Whether the SDK closes the receiver's handler for this error (``aio/_base_handler_async.py``
    ``_handle_exception``: ``if error._shutdown_handler: await self._close_handler()``). Every
    ``ServiceBusError`` carries the flag, True unless its class says otherwise (``exceptions.py``:
    ``ServiceBusConnectionError``, ``ServiceBusCommunicationError``, ``ServiceBusAuthorizationError``,
    ``MessagingEntityNotFoundError`` and a plain ``ServiceBusError`` set it; ``OperationTimeoutError``,
    ``ServiceBusServerBusyError``, ``MessageLockLostError`` and ``MessageNotFoundError`` do not)."""
    return isinstance(exc, ServiceBusError) and bool(getattr(exc, "_shutdown_handler", True))


def _keeps_handler_state(operation: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """``operation`` with the SDK's rule applied to what it raises (see :func:`_shuts_the_handler`)."""
    if getattr(operation, _KEEPS_HANDLER_STATE, False):
        return operation

    @functools.wraps(operation)
    async def call(self: FakeServiceBusReceiver, *args: Any, **kwargs: Any) -> Any:
        try:
            return await operation(self, *args, **kwargs)
        except Exception as exc:
            if _shuts_the_handler(exc):
                self._close_handler()
            raise

    setattr(call, _KEEPS_HANDLER_STATE, True)
    return call


class _ReceiverType(type):
    """Applies :func:`_keeps_handler_state` to the receiver's operations, and to any installed on the
    class later: a test that replaces one to make it fail (the fault suite raises the SDK's own
    ``ServiceBusConnectionError`` in place of the call) leaves the receiver as the SDK would."""

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
        super().__init__(name, bases, namespace)
        for attribute in _HANDLER_OPERATIONS & namespace.keys():
            type.__setattr__(cls, attribute, _keeps_handler_state(namespace[attribute]))

    def __setattr__(cls, name: str, value: Any) -> None:
        if name in _HANDLER_OPERATIONS and inspect.iscoroutinefunction(value):
            value = _keeps_handler_state(value)
        super().__setattr__(name, value)


class FakeServiceBusReceiver(_Link, metaclass=_ReceiverType):
    """Mirrors ``azure.servicebus.aio.ServiceBusReceiver`` for a queue or its dead-letter sub-queue."""

    claim = LISTEN

    def __init__(
        self,
        namespace: FakeServiceBusNamespace,
        queue_name: str,
        *,
        caller: _Caller | None = None,
        sub_queue: ServiceBusSubQueue | str | None = None,
        receive_mode: ServiceBusReceiveMode | str = ServiceBusReceiveMode.PEEK_LOCK,
        max_wait_time: float | None = None,
        prefetch_count: int = 0,
    ) -> None:
        if max_wait_time is not None and max_wait_time <= 0:
            raise ValueError("The max_wait_time must be greater than 0.")
        super().__init__(namespace, queue_name, caller)
        self._dead_letter = _is_dead_letter(sub_queue)
        self._receive_mode = (
            receive_mode
            if isinstance(receive_mode, ServiceBusReceiveMode)
            else ServiceBusReceiveMode(receive_mode.lower())
        )
        self._max_wait_time = max_wait_time
        self._prefetch_count = prefetch_count  # only the bound for max_message_count=None; no prefetch
        self._last_sequence_number: int | None = None  # the SDK's peek cursor
        #: link credit the broker may still fill, and what it pushed that no receive has returned yet
        self._credit = 0
        self._buffer: list[FakeReceivedMessage] = []
        self._receiving = 0  # receive calls in progress (the SDK's ``_receive_context``)
        self._keep_alive: asyncio.TimerHandle | None = None
        #: the SDK's ``_running``: the handler is open (set by ``_open``; an error can shut it down)
        self._running = False

    async def __aenter__(self) -> Self:
        await super().__aenter__()  # the SDK's ``_open_with_retry``
        self._running = True
        return self

    async def _open(self) -> None:
        """The SDK's ``_open``, which every receive and management call (a peek) runs first: the link
        attaches (the service checks the claim) and the handler runs again after an error shut it."""
        await self._authorize()
        self._running = True

    def _close_handler(self) -> None:
        """The SDK's ``_close_handler`` (what an error that shuts the handler down runs, and
        ``close``): the credit drained and what the link buffered released; later renewals and
        settlements are refused until :meth:`_open` runs again."""
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None
        self._credit = 0
        with contextlib.suppress(ValueError):
            self._namespace._credited.remove(self)
        self._release_buffer()
        self._running = False

    @property
    def receive_mode(self) -> ServiceBusReceiveMode:
        return self._receive_mode

    @property
    def entity_path(self) -> str:
        return f"{self.entity_name}/$DeadLetterQueue" if self._dead_letter else self.entity_name

    # receiving

    async def receive_messages(
        self, max_message_count: int | None = 1, max_wait_time: float | None = None
    ) -> list[FakeReceivedMessage]:
        """Up to ``max_message_count`` messages available now, waiting up to ``max_wait_time`` s for one."""
        await self._open()
        if max_wait_time is not None and max_wait_time <= 0:
            raise ValueError("The max_wait_time must be greater than 0.")
        if max_message_count is not None and max_message_count <= 0:
            raise ValueError("The max_message_count must be greater than 0")
        count = max_message_count or self._prefetch_count
        if not count:
            return []
        if max_wait_time is None:
            max_wait_time = self._max_wait_time or DEFAULT_RECEIVE_WAIT_SECONDS
        return await self._receive(count, max_wait_time)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> FakeReceivedMessage:
        """One message at a time; ends after the receiver's ``max_wait_time`` with none (never if unset)."""
        await self._open()
        wait = math.inf if self._max_wait_time is None else self._max_wait_time
        messages = await self._receive(1, wait)
        if not messages:
            raise StopAsyncIteration
        return messages[0]

    async def _receive(self, count: int, wait: float) -> list[FakeReceivedMessage]:
        # as ServiceBusReceiver._receive (aio/_servicebus_receiver_async.py): the buffer first; then the
        # credit set to what is still wanted, which outlives the call
        self._receiving += 1
        try:
            batch = self._unbuffer(count)
            if len(batch) >= count:
                return batch
            self._credit = count - len(batch)
            if self not in self._namespace._credited:
                self._namespace._credited.append(self)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait
            while True:
                changed = self._namespace._changed  # taken before looking, so no change is missed
                queue = self._namespace._queue(self.entity_name)
                self._fill(queue, self._namespace.now())
                batch += self._unbuffer(count - len(batch))
                # (the SDK goes on ~0.2 s after the first new message, for more; this returns at once)
                if batch:
                    return batch
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return []
                # sleep until something could have changed: a send or settlement (the event), or the
                # namespace clock reaching a lock expiry or schedule (assuming it runs at real speed)
                delay = min(remaining, self._seconds_until_next_change())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(None if math.isinf(delay) else delay):
                        await changed.wait()
        finally:
            self._receiving -= 1
            if self._buffer and not self._receiving:
                self._start_keep_alive()

    def _unbuffer(self, count: int) -> list[FakeReceivedMessage]:
        """Up to ``count`` pushed messages, oldest first, whatever their locks say now."""
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        if taken:
            self._last_sequence_number = taken[-1].sequence_number
        return taken

    def _fill(self, queue: _Queue, now: datetime) -> None:
        """The broker's push into this link's credit: each message locked (or deleted) as it is sent."""
        if self._closed or self._credit <= 0:
            return
        lock = self._receive_mode is ServiceBusReceiveMode.PEEK_LOCK
        entries = queue.take(self._dead_letter, now, self._credit, lock=lock)
        if not entries:
            return
        self._credit -= len(entries)
        self._buffer += [
            FakeReceivedMessage(e, queue, state=ServiceBusMessageState.ACTIVE, locked=lock) for e in entries
        ]
        if not self._receiving:
            self._start_keep_alive()

    def _start_keep_alive(self) -> None:
        # only peek-lock receivers release (the SDK installs enhanced_message_received_async for them)
        wait = self._namespace.keep_alive_seconds
        if (
            wait is None
            or self._keep_alive is not None
            or self._receive_mode is not ServiceBusReceiveMode.PEEK_LOCK
        ):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (no loop: the next receive returns them)
            return
        self._keep_alive = loop.call_later(wait, self._keep_alive_read)

    def _keep_alive_read(self) -> None:
        self._keep_alive = None
        if self._receiving:  # a receive in progress returns what the link holds
            return
        self._release_buffer()

    def _release_buffer(self) -> None:
        """Settle every buffered message ``released``: its lock ends, no delivery is counted."""
        buffered, self._buffer = self._buffer, []
        queue = self._namespace._find(self.entity_name)
        if queue is None or self._receive_mode is not ServiceBusReceiveMode.PEEK_LOCK:
            return  # (receive-and-delete: they left the broker when pushed)
        queue.sweep(self._namespace.now())  # a lock that lapsed first has counted its delivery
        for message in buffered:
            entry = queue.sub(self._dead_letter).get(message.sequence_number)
            if message._source is queue and entry is not None and entry.lock_token == message._lock_token:
                queue.unlock(entry)
        if buffered:
            self._namespace.wake_waiters()

    def _seconds_until_next_change(self) -> float:
        queue = self._namespace._find(self.entity_name)
        when = queue.next_change() if queue is not None else None
        if when is None:
            return math.inf
        # a floor keeps a clock that lags the event loop from turning this into a spin
        return max((when - self._namespace.now()).total_seconds(), 0.0) + 0.001

    async def close(self) -> None:
        # the SDK's _close_handler: drain the credit and release what the buffer holds (peek-lock);
        # messages already returned stay locked until settled or their lock expires
        self._close_handler()
        await super().close()

    async def receive_deferred_messages(
        self, sequence_numbers: int | list[int], *, timeout: float | None = None
    ) -> list[FakeReceivedMessage]:
        """Deferred messages by sequence number (locked, or removed in receive-and-delete mode)."""
        await self._open()
        _check_timeout(timeout)
        numbers = [sequence_numbers] if isinstance(sequence_numbers, int) else list(sequence_numbers)
        queue = self._namespace._queue(self.entity_name)
        sub = queue.sub(self._dead_letter)
        entries = []
        for n in numbers:
            entry = sub.get(n)
            if entry is None or not entry.deferred or entry.lock_token is not None:
                raise MessageNotFoundError(
                    message=f"Failed to lock one or more specified messages: no deferred message {n}."
                )
            entries.append(entry)
        lock = self._receive_mode is ServiceBusReceiveMode.PEEK_LOCK
        now = self._namespace.now()
        for entry in entries:
            if lock:
                queue.lock(entry, now)
            else:
                del sub[entry.sequence_number]
        return [
            FakeReceivedMessage(e, queue, state=ServiceBusMessageState.DEFERRED, locked=lock) for e in entries
        ]

    async def peek_messages(
        self, max_message_count: int = 1, *, sequence_number: int = 0, timeout: float | None = None
    ) -> list[FakeReceivedMessage]:
        """Browse without locking or counting a delivery; scheduled, deferred and locked messages included.

        Like the SDK, ``sequence_number=0`` continues after the last message this receiver received or
        peeked, so repeated peeks page through the queue.
        """
        await self._open()  # a management call: ``_mgmt_request_response`` opens the handler first
        _check_timeout(timeout)
        if int(max_message_count) < 0:
            raise ValueError("max_message_count must be 1 or greater.")
        if not sequence_number:
            sequence_number = self._last_sequence_number + 1 if self._last_sequence_number else 1
        queue = self._namespace._queue(self.entity_name)
        found = sorted(
            (e for e in queue.sub(self._dead_letter).values() if e.sequence_number >= sequence_number),
            key=lambda e: e.sequence_number,
        )[:max_message_count]
        if found:
            self._last_sequence_number = found[-1].sequence_number
        return [
            FakeReceivedMessage(e, queue, state=_peeked_state(e), locked=False, peeked=True) for e in found
        ]

    # settling

    def _check_message_alive(self, message: FakeReceivedMessage, action: str) -> None:
        """What the SDK checks before a renewal or settlement is sent, in its order (``_check_live``,
        then ``_common/receiver_mixins.py`` ``_check_message_alive``)."""
        self._check_live()
        if not isinstance(message, FakeReceivedMessage):
            raise TypeError("Parameter 'message' must be of type ServiceBusReceivedMessage")
        if message._peeked:
            raise ValueError(
                f"The operation {action} is not supported for peeked messages."
                "Only messages received using receive methods in PEEK_LOCK mode can be settled."
            )
        if self._receive_mode is ServiceBusReceiveMode.RECEIVE_AND_DELETE:
            raise ValueError(f"The operation {action} is not supported in 'RECEIVE_AND_DELETE' receive mode.")
        if message._settled:
            raise MessageAlreadySettled(action=action)
        if not self._running:
            raise ValueError(_HANDLER_SHUT.format(action))

    async def _locked_entry(self, message: FakeReceivedMessage, action: str) -> tuple[_Queue, _Entry]:
        """The broker's entry still locked by ``message``, checked in the order the SDK checks."""
        self._check_message_alive(message, action)
        await self._authorize()
        queue = self._namespace._queue(self.entity_name)  # an expired lock is released here
        entry = queue.sub(self._dead_letter).get(message.sequence_number)
        if (
            message._source is not queue
            or message._dead_letter != self._dead_letter
            or entry is None
            or entry.lock_token != message._lock_token
        ):
            raise MessageLockLostError(message="The lock on the message lock has expired.")
        return queue, entry

    async def complete_message(self, message: FakeReceivedMessage) -> None:
        queue, entry = await self._locked_entry(message, "complete")
        del queue.sub(self._dead_letter)[entry.sequence_number]
        message._settled = True

    async def abandon_message(self, message: FakeReceivedMessage) -> None:
        """Unlock now for immediate redelivery, counting a delivery (dead-letters at the queue's limit)."""
        queue, entry = await self._locked_entry(message, "abandon")
        queue.release(entry)
        message._settled = True
        self._namespace.wake_waiters()

    async def defer_message(self, message: FakeReceivedMessage) -> None:
        """Set aside: only :meth:`receive_deferred_messages` with its sequence number can get it again."""
        _, entry = await self._locked_entry(message, "defer")
        entry.lock_token = entry.locked_until = None
        entry.deferred = True
        message._settled = True

    async def dead_letter_message(
        self, message: FakeReceivedMessage, reason: str | None = None, error_description: str | None = None
    ) -> None:
        queue, entry = await self._locked_entry(message, "dead-letter")
        if entry.in_dead_letter:
            raise ServiceBusError("A message in a dead-letter queue cannot be dead-lettered again.")
        queue.move_to_dead_letter(entry, reason, error_description)
        message._settled = True
        self._namespace.wake_waiters()

    async def renew_message_lock(
        self, message: FakeReceivedMessage, *, timeout: float | None = None
    ) -> datetime:
        """Extend the lock by the queue's lock duration from now; return the new ``locked_until_utc``."""
        self._check_message_alive(message, "renew")  # (the SDK checks the timeout after these)
        _check_timeout(timeout)
        queue, entry = await self._locked_entry(message, "renew")
        entry.locked_until = message._locked_until = self._namespace.now() + queue.settings.lock_duration
        return entry.locked_until


def _peeked_state(entry: _Entry) -> ServiceBusMessageState:
    if entry.scheduled:
        return ServiceBusMessageState.SCHEDULED
    if entry.deferred:
        return ServiceBusMessageState.DEFERRED
    return ServiceBusMessageState.ACTIVE


class _SignedIn(_Closing):
    """A client of the namespace, signed in with a SAS policy's ``rights`` or an Entra ``credential``."""

    def __init__(
        self,
        namespace: FakeServiceBusNamespace,
        *,
        rights: Iterable[str] = ALL_RIGHTS,
        credential: Any | None = None,
    ) -> None:
        self.namespace = namespace
        self._caller = _Caller(namespace, rights, credential)


class FakeServiceBusClient(_SignedIn):
    """Mirrors ``azure.servicebus.aio.ServiceBusClient``, on a :class:`FakeServiceBusNamespace`.

    ``rights`` are the claims of its SAS policy (default: all, like the namespace's
    RootManageSharedAccessKey); with ``credential`` (an async Entra token credential, as the real client
    takes) the rights are instead those of the token's identity in ``namespace.role_assignments``.
    Senders need ``Send``, receivers ``Listen``.
    """

    def __init__(
        self,
        namespace: FakeServiceBusNamespace,
        *,
        rights: Iterable[str] = ALL_RIGHTS,
        credential: Any | None = None,
    ) -> None:
        super().__init__(namespace, rights=rights, credential=credential)
        self.fully_qualified_namespace = namespace.fully_qualified_namespace
        self._handlers: list[FakeServiceBusSender | FakeServiceBusReceiver] = []

    async def close(self) -> None:
        """Close every sender and receiver this client made, as the SDK does."""
        for handler in self._handlers:
            await handler.close()
        self._handlers.clear()

    def get_queue_sender(
        self, queue_name: str, *, client_identifier: str | None = None, socket_timeout: float | None = None
    ) -> FakeServiceBusSender:
        sender = FakeServiceBusSender(self.namespace, queue_name, self._caller)
        self._handlers.append(sender)
        return sender

    def get_queue_receiver(
        self,
        queue_name: str,
        *,
        sub_queue: ServiceBusSubQueue | str | None = None,
        receive_mode: ServiceBusReceiveMode | str = ServiceBusReceiveMode.PEEK_LOCK,
        max_wait_time: float | None = None,
        auto_lock_renewer: AutoLockRenewer | None = None,
        prefetch_count: int = 0,
        client_identifier: str | None = None,
        socket_timeout: float | None = None,
    ) -> FakeServiceBusReceiver:
        if auto_lock_renewer is not None:
            raise NotImplementedError("the fake has no AutoLockRenewer support; call renew_message_lock")
        receiver = FakeServiceBusReceiver(
            self.namespace,
            queue_name,
            caller=self._caller,
            sub_queue=sub_queue,
            receive_mode=receive_mode,
            max_wait_time=max_wait_time,
            prefetch_count=prefetch_count,
        )
        self._handlers.append(receiver)
        return receiver


# --- admin side ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FakeQueueRuntimeProperties:
    """The attributes of ``azure.servicebus.management.QueueRuntimeProperties``."""

    name: str
    active_message_count: int
    scheduled_message_count: int
    dead_letter_message_count: int
    transfer_dead_letter_message_count: int
    transfer_message_count: int
    total_message_count: int
    size_in_bytes: int
    created_at_utc: datetime
    updated_at_utc: datetime
    accessed_at_utc: datetime


class FakeServiceBusAdministrationClient(_SignedIn):
    """Mirrors ``azure.servicebus.aio.management.ServiceBusAdministrationClient`` for queues.

    Properties come back as real ``QueueProperties``; durations must be ``timedelta`` (the SDK also
    takes ISO-8601 strings). Every call needs the ``Manage`` right (the service's rule, reads included);
    without it the call fails as the service's 401 does.
    """

    async def _authorize(self, entity: str | None, *, write: bool = False) -> None:
        if MANAGE not in await self._caller.rights():
            _refuse_management(self.namespace, entity, write=write)

    def _existing(self, queue_name: str) -> _Queue:
        queue = self.namespace._find(queue_name)
        if queue is None:
            raise ResourceNotFoundError(f"Queue '{queue_name}' does not exist in this namespace.")
        return queue

    async def create_queue(
        self,
        queue_name: str,
        *,
        authorization_rules: list[Any] | None = None,
        auto_delete_on_idle: timedelta | None = None,
        dead_lettering_on_message_expiration: bool | None = None,
        default_message_time_to_live: timedelta | None = None,
        duplicate_detection_history_time_window: timedelta | None = None,
        enable_batched_operations: bool | None = None,
        enable_express: bool | None = None,
        enable_partitioning: bool | None = None,
        lock_duration: timedelta | None = None,
        max_delivery_count: int | None = None,
        max_size_in_megabytes: int | None = None,
        requires_duplicate_detection: bool | None = None,
        requires_session: bool | None = None,
        forward_to: str | None = None,
        user_metadata: str | None = None,
        forward_dead_lettered_messages_to: str | None = None,
        max_message_size_in_kilobytes: int | None = None,
    ) -> QueueProperties:
        """Create a queue; ``None`` means the service default (max delivery 10, lock 60 s, no TTL limit)."""
        await self._authorize(queue_name, write=True)
        _reject_unmodelled(requires_session, forward_to, forward_dead_lettered_messages_to)
        if self.namespace._find(queue_name) is not None:
            raise ResourceExistsError(f"Queue '{queue_name}' already exists.")
        settings = _Settings().updated(
            {
                "authorization_rules": authorization_rules,
                "auto_delete_on_idle": auto_delete_on_idle,
                "dead_lettering_on_message_expiration": dead_lettering_on_message_expiration,
                "default_message_time_to_live": default_message_time_to_live,
                "duplicate_detection_history_time_window": duplicate_detection_history_time_window,
                "enable_batched_operations": enable_batched_operations,
                "enable_express": enable_express,
                "enable_partitioning": enable_partitioning,
                "lock_duration": lock_duration,
                "max_delivery_count": max_delivery_count,
                "max_size_in_megabytes": max_size_in_megabytes,
                "requires_duplicate_detection": requires_duplicate_detection,
                "user_metadata": user_metadata,
                "max_message_size_in_kilobytes": max_message_size_in_kilobytes,
            }
        )
        self.namespace._queues[queue_name.lower()] = _Queue(
            queue_name, settings, self.namespace.now(), self.namespace.clock
        )
        return settings.to_properties(queue_name)

    async def get_queue(self, queue_name: str) -> QueueProperties:
        await self._authorize(queue_name)
        queue = self._existing(queue_name)
        return queue.settings.to_properties(queue.name)

    async def get_queue_runtime_properties(self, queue_name: str) -> FakeQueueRuntimeProperties:
        await self._authorize(queue_name)
        self._existing(queue_name)
        return self.namespace._queue(queue_name).runtime_properties()

    async def list_queues(self) -> AsyncIterator[QueueProperties]:
        await self._authorize(None)
        for q in list(self.namespace._queues.values()):
            yield q.settings.to_properties(q.name)

    async def list_queues_runtime_properties(self) -> AsyncIterator[FakeQueueRuntimeProperties]:
        await self._authorize(None)
        for name in self.namespace.queue_names:
            yield self.namespace._queue(name).runtime_properties()

    async def update_queue(self, queue: QueueProperties | Mapping[str, Any]) -> None:
        """Apply a ``QueueProperties`` (from :meth:`get_queue`, edited) or a mapping with ``name``."""
        if isinstance(queue, QueueProperties):
            name: str = queue.name
            values: dict[str, Any] = {n: getattr(queue, n) for n in _SETTING_NAMES}
            unmodelled = (queue.requires_session, queue.forward_to, queue.forward_dead_lettered_messages_to)
        else:
            name = queue["name"]
            values = {n: queue[n] for n in _SETTING_NAMES if n in queue}
            unmodelled = (
                queue.get("requires_session"),
                queue.get("forward_to"),
                queue.get("forward_dead_lettered_messages_to"),
            )
        _reject_unmodelled(*unmodelled)
        await self._authorize(name, write=True)
        existing = self._existing(name)
        existing.settings = existing.settings.updated(values)
        existing.updated_at = self.namespace.now()
        self.namespace.wake_waiters()

    async def delete_queue(self, queue_name: str) -> None:
        await self._authorize(queue_name, write=True)
        self._existing(queue_name)
        del self.namespace._queues[queue_name.lower()]
        self.namespace.wake_waiters()
