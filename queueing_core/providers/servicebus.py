"""Azure Service Bus provider on ``azure-servicebus`` (async).

- A queue per type (names sanitized to Service Bus rules), created at start when
  ``QUEUEING_SERVICEBUS_CREATE_QUEUES`` allows (the default, for local development) with the type's
  settings: max delivery count, lock duration (at most 5 minutes; longer leases are renewed), TTL and
  dead-lettering on expiration. Creating needs the Manage right (only *Azure Service Bus Data Owner*
  grants it to an identity); the Bicep provisions the queues and turns creation off. A refusal (401)
  is logged once as one line naming the role, and the runtime opens anyway.
- ``GET stats`` reads the queues' runtime properties (Manage again); without that right it counts by
  peeking (what *Data Receiver* allows) and says so in the response.
- Peek-lock receive; a success completes.
- **No link credit left standing.** With ``prefetch_count=0`` a receive that asks for n sets the link
  credit to n, and what it does not use stays on the link: the broker locks messages into it that
  nobody asked for (the SDK releases them only when it next reads the link, or at close). A receiver
  that came back short and is then not asked again for ``idle_close`` seconds (a paused queue, a
  worker at capacity, stopping) is closed once nothing it handed out is still unsettled: closing
  drains the credit and releases what it held, without counting a delivery. The next receive opens a
  new one. A message whose lock lapsed while it waited in the receiver's buffer is not run: it is
  another run's now (its settlement would be refused), and Service Bus redelivers it.
- **Retries are a scheduled copy, not an abandon.** Abandon makes the message available again at
  once (no backoff) and spends the entity's delivery count. The kit sends a copy scheduled for
  now + backoff, carrying the attempts used in its envelope, then completes the original. The
  entity's max delivery count stays the safety net for the case nothing can settle: a process that
  crashes holding the lock (each lock expiry counts one delivery).
- A pause, waiting for a handler or a release at shutdown do the same with a copy that keeps the
  attempt count, so they never burn delivery attempts.
- Dead letters use the native sub-queue with ``MaxDeliveryAttemptsExceeded``, ``Expired``,
  ``MalformedEnvelope``, ``NonRetryable`` or ``InvalidBody`` as the reason.
- ``delivery_count`` in the Python SDK counts earlier deliveries (0 on the first), so a delivery's
  attempt is ``envelope.attempt + delivery_count + 1``.

Pause/circuit state and history live in Azure Tables (``QueueingStorage``), shared by every instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.servicebus import (
    ServiceBusMessage,
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
    OperationTimeoutError,
    ServiceBusAuthorizationError,
    ServiceBusCommunicationError,
    ServiceBusConnectionError,
    ServiceBusError,
    ServiceBusServerBusyError,
)

from ..clock import utcnow
from ..connections import ServiceBusConnection
from ..control.base import ControlStore
from ..decisions import Complete, DeadLetter, Expire, dead_letter_of, due_at
from ..envelope import Envelope
from ..errors import InvalidArgument, InvalidOperation, MissingPermission, ProviderError, ProviderUnavailable
from ..infra import MAX_LOCK, delivery_limit, queue_time_to_live
from ..messages import MessageStatus
from ..naming import QueueNaming, Transport
from ..tracking import MessageQuery, MessageRecord, Reopen, Tracker, nothing_to_reopen
from ..transport import Capabilities, Delivery, Settlement, settled_each
from .dead_letters import (
    DEAD_STATES,
    SCAN_LIMIT,
    DeadLetterOps,
    empty_dead_letters,
    id_in_text,
    is_whole_queue,
)
from .names import PhysicalNames

if TYPE_CHECKING:
    from ..app import QueueingApp, Subscription

log = logging.getLogger("queueing.servicebus")
#: how far past its queue's time to live a message's may reach before it is refused (``check_expiry``):
#: the clocks of the hosts that build messages may differ by that much (never more than the grace)
EXPIRY_LEEWAY = timedelta(minutes=5)
#: how long a look for a message in its queue may take after a settlement it refused, seconds
_PEEK_TIMEOUT = 10.0

#: Standard tier: 256 KB per message including headers; leave room for the system properties
MAX_ENVELOPE_BYTES = 250 * 1024
#: the longest time to live a message can carry: the AMQP header's ``ttl`` is a uint of milliseconds,
#: and the SDK's encoder refuses a longer one with a bare ValueError (about 49.7 days)
MAX_MESSAGE_TTL = timedelta(milliseconds=2**32 - 1)
#: what the service reports for a queue whose messages never expire (.NET ``TimeSpan.MaxValue``, about
#: 10,675,199 days): anything from here on is "no limit"
_NO_TTL_LIMIT = timedelta(days=10675199)
TYPE_PROPERTY = "queueing-type"
#: the longest dead-letter description Service Bus's SDKs send, in UTF-16 code units: the .NET SDK,
#: which a Functions host settles through, refuses a longer one (a character beyond the BMP counts two)
MAX_DEAD_LETTER_TEXT = 4096


def dead_letter_text(text: str) -> str:
    """``text`` cut to :data:`MAX_DEAD_LETTER_TEXT` UTF-16 code units, no pair split. Cut by code
    points, a description with emoji passed the kit and was refused by the host: the message came back,
    ran again on every attempt, and ended with the wrong reason (found in review)."""
    if len(text) <= MAX_DEAD_LETTER_TEXT // 2:  # (no text of so few code points can be too long)
        return text
    units = text.encode("utf-16-le", "surrogatepass")
    if len(units) <= 2 * MAX_DEAD_LETTER_TEXT:
        return text
    # (a pair the cut splits leaves a lone high surrogate at the end, which "ignore" drops)
    return units[: 2 * MAX_DEAD_LETTER_TEXT].decode("utf-16-le", "ignore")


#: messages looked at per queue (and per dead-letter queue) when counting by peeking
PEEK_COUNT_LIMIT = 5000
CREATE_QUEUES_SETTING = "QUEUEING_SERVICEBUS_CREATE_QUEUES"
OWNER_ROLE = "Azure Service Bus Data Owner"
#: what says the service is away or busy for now, not that the request was wrong (the SDK's docstrings
#: say wait and retry): the data plane's AMQP errors and the administration client's HTTP ones
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    ServiceBusConnectionError,
    ServiceBusCommunicationError,
    ServiceBusServerBusyError,
    OperationTimeoutError,
    ServiceRequestError,
    ServiceResponseError,
    OSError,
)

#: the right each AMQP refusal names, and the least role that grants it
_ROLE_OF_CLAIM = {
    "'Send'": ("Send", "Azure Service Bus Data Sender"),
    "'Listen'": ("Listen", "Azure Service Bus Data Receiver"),
    "'Manage'": ("Manage", OWNER_ROLE),
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


#: how the SDK refuses a renewal or settlement once an error closed the receiver's handler
#: (azure-servicebus 7.15 ``_common/receiver_mixins.py`` ``_check_message_alive``: "Failed to complete
#: the message as the handler has already been shutdown."). A receiver the kit closed itself says "The
#: handler has already been shutdown." instead (``_check_live``), which no reopening mends.
_HANDLER_SHUT = "the message as the handler has already been shutdown"
#: a sequence number past every message's (the field is a signed 64-bit integer): a peek from it finds
#: nothing, so it locks nothing and moves no peek cursor
_PAST_EVERY_MESSAGE = 2**63 - 1

_T = TypeVar("_T")
#: one reopening at a time per receiver: the SDK's ``_open`` is not safe to run twice at once
_reopening: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


def _handler_shut(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and _HANDLER_SHUT in str(exc)


async def _on_open_handler(
    receiver: Any, call: Callable[[], Awaitable[_T]], *, timeout: float = _PEEK_TIMEOUT
) -> _T:
    """``call`` (a renewal or settlement through ``receiver``), tried once more after opening the
    receiver again if the SDK refused it because an error had shut its handler down.

    The SDK closes a receiver's handler when an operation fails with a connection error (every error it
    maps with ``shutdown_handler``: ``aio/_base_handler_async.py`` ``_handle_exception``), and from then
    on refuses every renewal and settlement before trying to reconnect: only a receive or a management
    call opens it again. The worker receives only when it has a free slot, so a worker whose slots all
    held long runs never did: every lock it held lapsed under its running handlers (found in review).
    A peek opens it (``_mgmt_request_response`` runs ``_open``) and, from a sequence number past every
    message's, finds and locks nothing. The locks are the broker's and outlive the handler: the held
    messages are renewed and settled by their lock tokens once it is open again.
    """
    try:
        return await call()
    except ValueError as exc:
        if not _handler_shut(exc):
            raise
    lock = _reopening.get(receiver)
    if lock is None:
        lock = _reopening[receiver] = asyncio.Lock()
    async with lock:
        try:
            return await call()  # another renewal may have opened it meanwhile
        except ValueError as exc:
            if not _handler_shut(exc):
                raise
            log.warning(
                "a Service Bus receiver was shut down by an error (a lost connection): opening it again "
                "to renew and settle the messages it holds"
            )
        await receiver.peek_messages(
            max_message_count=1, sequence_number=_PAST_EVERY_MESSAGE, timeout=timeout
        )
    return await call()


@contextlib.contextmanager
def _boundary(action: str) -> Any:
    try:
        yield
    except ClientAuthenticationError as exc:
        if getattr(exc, "status_code", None) != 401:  # no token at all (no identity, bad credential)
            raise ProviderError(f"{action}: signing in to Service Bus failed: {_first_line(exc)}") from None
        # only the administration API answers 401: it wants Manage, which only Data Owner grants
        raise MissingPermission(
            f"Service Bus refused {action} (401 Unauthorized): the identity has no Manage right, which "
            f"only the '{OWNER_ROLE}' role grants",
            right="Manage",
            role=OWNER_ROLE,
        ) from None
    except ServiceBusAuthorizationError as exc:
        right, role = next(
            (found for claim, found in _ROLE_OF_CLAIM.items() if claim in str(exc)),
            ("?", "a Service Bus data role"),
        )
        raise MissingPermission(
            f"Service Bus refused {action}: the identity has no {right} right; grant it the '{role}' role",
            right=right,
            role=role,
        ) from None
    except MessageSizeExceededError as exc:
        raise ProviderError(f"{action}: message too large for Service Bus ({exc})") from None
    except _UNAVAILABLE as exc:
        raise ProviderUnavailable(f"Service Bus unreachable or busy during {action}: {exc}") from None
    except ValueError as exc:
        if not _handler_shut(exc):
            raise
        # a connection error closed the receiver and opening it again failed: the service is away
        raise ProviderUnavailable(
            f"Service Bus unreachable during {action}: the receiver's connection was lost "
            f"({_first_line(exc)})"
        ) from None
    except (ServiceBusError, AzureError) as exc:
        raise ProviderError(f"{action} failed: {exc}") from None


def _added(batch: Any, msg: ServiceBusMessage, env: Envelope) -> bool:
    """Whether ``msg`` went into ``batch`` (False: the batch is full). Only the SDK's
    ``MessageSizeExceededError`` says full: any other ValueError is its AMQP encoder refusing the
    message, which another batch would refuse as well (read as full, the batch so far was sent and the
    error left after it: found in review)."""
    try:
        batch.add_message(msg)
    except MessageSizeExceededError:
        if not len(batch):
            raise  # the message alone is too large (the boundary says so)
        return False
    except ValueError as exc:
        raise ProviderError(f"Service Bus cannot carry message {env.message_id}: {exc}") from None
    return True


@dataclass(eq=False)
class _Link:
    """One queue's receiver and what keeps it open: receives in progress, and deliveries it handed out
    that are not settled yet (only the receiver that received a message can settle it)."""

    receiver: Any
    receiving: int = 0
    unsettled: int = 0
    #: not asked to receive for ``idle_close`` seconds after a short receive: close when nothing is held
    idle: bool = False
    timer: asyncio.TimerHandle | None = None


@dataclass
class _Handle:
    receiver: Any
    message: Any
    link: _Link | None = None


def _text(message: Any) -> str:
    body = message.body
    if isinstance(body, bytes | bytearray):
        return bytes(body).decode("utf-8", errors="replace")
    if isinstance(body, str):
        return body
    try:
        return b"".join(body).decode("utf-8", errors="replace")
    except TypeError:
        return str(message)


class _DeadLetterPages:
    """A dead-letter sub-queue read under peek-lock: letters passed over stay locked (so the next
    receive returns the ones after them) until the scan hands them back."""

    #: a letter's sequence number is its own for good: a letter whose lock lapsed (a lock duration
    #: shorter than an operator's retry takes) can be found again by it and no other letter matches
    keys_outlive_holds = True

    def __init__(self, receiver: Any, admin: Any, physical: str) -> None:
        self.receiver, self.admin, self.physical = receiver, admin, physical

    async def next_page(self) -> list[Any]:
        return list(await self.receiver.receive_messages(max_message_count=100, max_wait_time=1))

    def message_id(self, item: Any) -> str:
        return id_in_text(_text(item))

    def key(self, item: Any) -> Any:
        return item.sequence_number

    async def remove(self, item: Any) -> None:
        await _on_open_handler(self.receiver, lambda: self.receiver.complete_message(item))

    async def total(self) -> int | None:
        # a receiver that died keeps its letters locked for the lock duration: count them too
        try:
            props = await self.admin.get_queue_runtime_properties(self.physical)
        except (ServiceBusError, AzureError):  # no Manage right: cannot tell
            return None
        return int(props.dead_letter_message_count)

    async def hand_back(self, items: Sequence[Any]) -> None:
        for m in items:
            with contextlib.suppress(ServiceBusError):  # a lapsed lock hands it back by itself
                await _on_open_handler(self.receiver, functools.partial(self.receiver.abandon_message, m))


async def known_duplicate(
    tracker: Any,
    d: Delivery,
    sequence_number: int | None,
    delivery_count: int | None,
    complete: Callable[[], Awaitable[None]],
    timeout: float | None = None,
) -> bool:
    """A redelivered original whose outcome already went on in a copy (the copy was sent, completing
    the original failed, and the history noted its sequence number in ``copied_from``): ``complete``
    it without running the handler, and count it in the history. The worker's receive and the
    Functions host ask the same question of every message that came back. A lookup that takes longer
    than ``timeout`` seconds counts as not known: the message runs (it holds a lock that the lookup
    must not use up; only a history that answers it was copied may keep it from running)."""
    if d.envelope is None or not delivery_count or sequence_number is None:
        return False  # only a message that came back can be one
    try:
        rec = await asyncio.wait_for(tracker.get(d.envelope.message_id), timeout)
    except Exception as exc:  # history unreachable or slow: run it (a duplicate run beats a lost message)
        log.warning("could not look for a duplicate of %s: %s", d.envelope.message_id, _first_line(exc))
        return False
    if rec is None or rec.copied_from != str(sequence_number):
        return False
    d.duplicate = True
    log.warning(
        "message %s on %s came back after its copy was sent: completed as a duplicate, not run",
        d.envelope.message_id,
        d.queue,
    )
    try:
        await complete()
    except Exception as exc:  # it comes back once more and is recognised again
        log.warning("completing duplicate %s failed: %s", d.envelope.message_id, _first_line(exc))
        return True
    note = getattr(tracker, "note_duplicate", None)
    if note is not None:
        with contextlib.suppress(Exception):  # a count, not an outcome
            await note(d.envelope.message_id)
    return True


async def _gone(receiver: Any, seq: int) -> bool | None:
    """Whether the message with sequence number ``seq`` is no longer in the receiver's queue (a locked or
    scheduled message keeps its number, and a peek shows it); None when the peek fails."""
    try:
        found = await receiver.peek_messages(max_message_count=1, sequence_number=seq, timeout=_PEEK_TIMEOUT)
    except Exception as exc:
        log.warning("could not look for message %s in its queue: %s", seq, exc)
        return None
    return not found or found[0].sequence_number != seq


#: what the history says of a message Service Bus holds only as a scheduled message (a retry's copy,
#: a delay, a run again, a paused type's copy): none an operator's action writes here
_SCHEDULED_ONLY = frozenset(
    {MessageStatus.FAILED, MessageStatus.SLEEPING, MessageStatus.PAUSED, MessageStatus.WAITING_FOR_HANDLER}
)


class ServiceBusProvider(DeadLetterOps, PhysicalNames):
    transport = Transport.SERVICE_BUS

    def __init__(
        self,
        *,
        client: Any,
        admin: Any | None,
        control: ControlStore,
        tracker: Tracker,
        naming: QueueNaming | None = None,
        auto_create: bool = True,
        ttl_grace: timedelta = timedelta(hours=1),
        receive_wait: float = 1.0,
        idle_close: float = 1.0,
        max_message_bytes: int = MAX_ENVELOPE_BYTES,
        closers: Sequence[Any] = (),
    ) -> None:
        self.client = client
        self.admin = admin
        self.naming = naming
        self.auto_create = auto_create and admin is not None
        self.ttl_grace = ttl_grace
        #: the broker drops (or dead-letters) a message this long after its envelope's expiry: its own
        #: time to live, which nothing the kit writes later makes longer (``idempotency``)
        self.drops_expired_after = ttl_grace
        self.receive_wait = receive_wait
        #: seconds without a receive after a short one before the receiver is closed (its credit with it)
        self.idle_close = idle_close
        self.capabilities = Capabilities(
            max_delay=None,
            lock_renewal=True,
            # a queue's lock duration is its type's lease, at most this: a longer lease is renewed
            longest_lease=MAX_LOCK,
            native_dead_letter=True,
            max_message_bytes=max_message_bytes,
            # the dead-letter sub-queue keeps letters for good, the expired ones too
            dead_letters_kept=DEAD_STATES,
        )
        self._control = control
        self._tracker = tracker
        self._closers = list(closers)
        self._senders: dict[str, Any] = {}
        self._receivers: dict[str, _Link] = {}
        #: existing queues whose lock duration is shorter than their type's lease (``held_lease``)
        self._locks: dict[str, timedelta] = {}
        #: existing queues whose time to live is shorter than the one the kit gives (``check_expiry``)
        self._ttls: dict[str, timedelta] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._app: QueueingApp | None = None
        #: None until a management call says; False once the service refused one (401)
        self._can_manage: bool | None = None
        #: why ``native_counts`` are what they are, when it matters (the ops API shows it)
        self.counts_note: str | None = None

    @classmethod
    def from_connection(
        cls, connection: ServiceBusConnection, *, control: ControlStore, tracker: Tracker, **kwargs: Any
    ) -> ServiceBusProvider:
        client, admin, credential = connection.clients()
        closers = [c for c in (admin, credential) if c is not None]
        return cls(client=client, admin=admin, control=control, tracker=tracker, closers=closers, **kwargs)

    # -- wiring ------------------------------------------------------------------------------------
    def control_store(self) -> ControlStore:
        return self._control

    def tracker(self) -> Tracker:
        return self._tracker

    def _sender(self, queue: str) -> Any:
        name = self.physical(queue)
        s = self._senders.get(name)
        if s is None:
            s = self._senders[name] = self.client.get_queue_sender(name)
        return s

    def _link(self, queue: str) -> _Link:
        name = self.physical(queue)
        link = self._receivers.get(name)
        if link is None:
            receiver = self.client.get_queue_receiver(
                name, receive_mode=ServiceBusReceiveMode.PEEK_LOCK, prefetch_count=0
            )
            link = self._receivers[name] = _Link(receiver)
        return link

    def _watch_idle(self, name: str, link: _Link) -> None:
        """After a short receive: the credit it left is closed with the receiver unless another receive
        comes within ``idle_close`` (a worker that keeps polling keeps its receiver)."""
        if link.timer is not None:
            link.timer.cancel()
        link.timer = asyncio.get_running_loop().call_later(self.idle_close, self._went_idle, name, link)

    def _went_idle(self, name: str, link: _Link) -> None:
        link.timer = None
        if not link.receiving:
            link.idle = True
            self._close_if_idle(name, link)

    def _close_if_idle(self, name: str, link: _Link) -> None:
        # (the receiver must outlive every delivery it handed out: only it can settle them)
        if not link.idle or link.receiving or link.unsettled or self._receivers.get(name) is not link:
            return
        del self._receivers[name]
        task = asyncio.get_running_loop().create_task(self._close_receiver(link.receiver))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    @staticmethod
    async def _close_receiver(receiver: Any) -> None:
        # the SDK drains the credit and releases what the receiver buffered (no delivery counted)
        try:
            await receiver.close()
        except Exception as exc:  # its buffered messages come back when their locks lapse
            log.warning("closing an idle Service Bus receiver failed: %s", _first_line(exc))

    def _settled(self, d: Delivery) -> None:
        h = d.handle
        link = getattr(h, "link", None)
        if isinstance(link, _Link):
            h.link = None
            link.unsettled -= 1
            self._close_if_idle(self.physical(d.queue), link)

    async def open(self, app: QueueingApp) -> None:
        self._app = app
        if not self.auto_create or self.admin is None:
            return
        try:
            for sub in app.subscriptions():
                await self._create_queue(sub)
        except MissingPermission as exc:
            # not fatal: the queues may well exist (provisioned); a missing one fails its first send or
            # receive with "not found". Failing here would fail every trigger invocation instead.
            self._can_manage = False
            log.error(
                "%s; queues are not created: provision them (infra/main.bicep does) and set %s=false, "
                "or grant that role",
                exc,
                CREATE_QUEUES_SETTING,
            )

    async def _create_queue(self, sub: Subscription) -> None:
        assert self.admin is not None
        o = sub.options
        if delivery_limit(o.max_attempts) <= o.max_attempts:
            log.warning(
                "queue %s: max_attempts %d leaves no delivery beyond the attempts under Service Bus's "
                "limit (2000): a message whose runs all die is dead-lettered by the broker, unrecorded",
                sub.queue,
                o.max_attempts,
            )
        settings: dict[str, Any] = {
            "max_delivery_count": delivery_limit(o.max_attempts),
            "lock_duration": min(o.lease_duration, MAX_LOCK),
            "dead_lettering_on_message_expiration": True,
        }
        ttl = queue_time_to_live(o, self.ttl_grace)
        if ttl is not None:
            settings["default_message_time_to_live"] = ttl
        if o.idempotent:
            # as the generated Bicep does: the service drops a producer's repeated send of one message
            # id. Safe because every copy the kit sends (retry, pause, operator's retry) has its own id.
            settings["requires_duplicate_detection"] = True
        name = self.physical(sub.queue)
        with _boundary(f"creating queue {sub.queue}"):
            try:
                await self.admin.create_queue(name, **settings)
            except ResourceExistsError:
                existed = True
            else:
                existed = False
        self._can_manage = True
        if existed:
            # an existing queue is left as it is, its lock duration and its expiry too (created before
            # the lease or the expiration was raised, by hand, or in the emulator's config): renewals
            # must follow its lock, and no message may be promised a life its queue cuts short
            try:
                props = await asyncio.wait_for(self.admin.get_queue(name), _PEEK_TIMEOUT)
            except Exception as exc:  # not known: renewed by the type's lease, as before
                log.warning("could not read the settings of queue %s: %s", sub.queue, _first_line(exc))
            else:
                self._note_lock(props.lock_duration, sub)
                self._note_expiry(
                    props.default_message_time_to_live, props.dead_lettering_on_message_expiration, sub
                )

    def _note_lock(self, lock: timedelta | None, sub: Subscription) -> None:
        wanted = min(sub.options.lease_duration, MAX_LOCK)
        if lock is None or lock >= wanted:
            return
        self._locks[sub.queue] = lock
        log.warning(
            "queue %s exists with a lock duration of %s, shorter than its type's lease_duration (%s): "
            "its messages' locks are renewed by the queue's lock; give the queue the lease's lock "
            "duration (provision it again) so that the type's setting holds",
            sub.queue,
            lock,
            sub.options.lease_duration,
        )

    def _note_expiry(
        self, ttl: timedelta | None, dead_letters_expired: bool | None, sub: Subscription
    ) -> None:
        """An existing queue's time to live and expiry dead-lettering, held against what the kit gives
        a queue (the type's expiration plus the grace, and dead-lettering on): the broker expires every
        message by its queue's time to live whatever the message asks for, and deletes it unless the
        queue dead-letters expired messages, while its history still says Pending."""
        wanted = queue_time_to_live(sub.options, self.ttl_grace)  # None: never expires
        limited = ttl is not None and ttl < _NO_TTL_LIMIT
        if limited and ttl is not None and (wanted is None or ttl < wanted):
            self._ttls[sub.queue] = ttl
            log.warning(
                "queue %s exists with a default message time to live of %s, shorter than its type's "
                "expiration plus the grace (%s): Service Bus expires its messages by then, whatever the kit "
                "recorded, so enqueue refuses any message that would outlive it; give the queue that time to "
                "live (provision it again: `queueing infra params` and the Bicep, or the emulator's config)",
                sub.queue,
                ttl,
                "never" if wanted is None else wanted,
            )
        if dead_letters_expired is False and (limited or wanted is not None):
            log.warning(
                "queue %s exists with dead-lettering on message expiration off: a message Service Bus "
                "expires (not received within its expiry and the grace) is deleted, and its history still "
                "says Pending; the kit needs it on (provision the queue again: `queueing infra params` and "
                "the Bicep, or DeadLetteringOnMessageExpiration in the emulator's config)",
                sub.queue,
            )

    def held_lease(self, sub: Subscription) -> timedelta:
        """The lock Service Bus holds a message of ``sub`` for: its type's lease (at most
        :data:`MAX_LOCK`), or its queue's lock duration where an existing queue has a shorter one. The
        worker renews by it: renewing by the type's lease alone lost the lock of every run longer than
        a shorter queue lock (found in review)."""
        wanted = min(sub.options.lease_duration, MAX_LOCK)
        return min(wanted, self._locks.get(sub.queue, wanted))

    async def close(self) -> None:
        for link in self._receivers.values():
            if link.timer is not None:
                link.timer.cancel()
        receivers = [link.receiver for link in self._receivers.values()]
        for handler in [*self._senders.values(), *receivers]:
            with contextlib.suppress(Exception):
                await handler.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._senders.clear()
        self._receivers.clear()
        await self.client.close()
        for c in self._closers:
            with contextlib.suppress(Exception):
                await c.close()
        for store in (self._control, self._tracker):
            close = getattr(store, "aclose", None)
            if close is not None:
                await close()

    # -- producing ---------------------------------------------------------------------------------
    def _time_to_live(self, env: Envelope, start: datetime) -> timedelta | None:
        """The message's own time to live: its expiry, and the grace in which the kit (not the broker)
        finds it expired and dead-letters it with its reason, counted from ``start``, when the message
        becomes available: Service Bus counts a scheduled message's time to live from its scheduled
        time. Counted from the send, a message delayed further than its time to live could carry was
        refused, and a run again far off failed its settlement (found in review).

        None (the queue's own time to live applies) for a message that never expires, and for one
        longer than a message can carry (:data:`MAX_MESSAGE_TTL`): its queue's is at least as long
        (:meth:`check_expiry` refused it otherwise), and the kit finds it expired by its envelope."""
        if env.expires_at is None:
            return None
        # the grace always follows the activation: a copy due after its expiry (a long retry, a
        # defer) must still reach a worker, which finds it expired and records so; with 1 s the broker
        # dead-lettered it as TTLExpiredException, its history left Failed (found in review)
        ttl = max(timedelta(seconds=1), max(env.expires_at - start, timedelta(0)) + self.ttl_grace)
        return None if ttl > MAX_MESSAGE_TTL else ttl

    def check_expiry(self, app: QueueingApp, envelopes: Sequence[Envelope], now: datetime) -> None:
        """Refuse, before anything is sent, a message that would outlast its queue's time to live.

        Service Bus caps a message's time to live at its queue's without a word: such a message would
        be expired and dead-lettered by the broker before the expiry the kit recorded, its history
        left Pending. The queue's is the one the kit gives it (the Bicep through ``queueing infra
        params``, or :meth:`_create_queue`), or an existing queue's where that is shorter."""
        for env in envelopes:
            sub = app.subscription(env.type)
            if sub is None:
                continue
            existing = self._ttls.get(sub.queue)
            if existing is not None:
                self._refuse_past_existing_queue(sub, env, existing, now)
                continue
            if env.expires_at is None:
                continue
            # a scheduled message's time to live runs from its scheduled time: a delay past the type's
            # expiration with a later expiry to match (as the docs ask) is within its queue's
            start = max(now, env.not_before) if env.not_before is not None else now
            wanted = env.expires_at - start + self.ttl_grace
            limit = queue_time_to_live(sub.options, self.ttl_grace)
            # (leeway: a message built on a host whose clock is ahead, its default expiry from its
            # created_at, only loses that much of the grace)
            if limit is not None and wanted > limit + min(EXPIRY_LEEWAY, self.ttl_grace):
                expiration = sub.options.expiration
                raise InvalidArgument(
                    "expires_at",
                    f"the message would expire at {env.expires_at.isoformat()}, which would outlast its "
                    f"Service Bus queue {sub.queue!r}: the queue's time to live is the type's expiration "
                    f"({expiration}) plus the grace ({self.ttl_grace}), and Service Bus expires and "
                    "dead-letters every message there by then, whatever it asks for; give it at most "
                    f"ttl={expiration}, or a longer expiration on the type (and provision its queue again)",
                )

    def _refuse_past_existing_queue(
        self, sub: Subscription, env: Envelope, limit: timedelta, now: datetime
    ) -> None:
        """:meth:`check_expiry` on a queue that exists with a shorter time to live than the kit gives
        (warned of at start): a message the broker would remove before its recorded expiry is refused,
        one that never expires too. What is left of the grace after its expiry is whatever the queue
        leaves (the broker caps the message's own time to live at the queue's)."""
        start = max(now, env.not_before) if env.not_before is not None else now
        life = None if env.expires_at is None else env.expires_at - start
        if life is not None and life <= limit + min(EXPIRY_LEEWAY, self.ttl_grace):
            return
        raise InvalidArgument(
            "expires_at",
            (
                "the message never expires"
                if env.expires_at is None
                else f"the message would expire at {env.expires_at.isoformat()}"
            )
            + f", which would outlast its Service Bus queue {sub.queue!r}: the queue exists with a time to "
            f"live of {limit}, shorter than the type's expiration plus the grace, and Service Bus expires "
            "every message there by then, whatever it asks for; provision the queue again (`queueing infra "
            f"params` and the Bicep) so that its time to live is the type's, or give the message at most "
            f"ttl={limit}",
        )

    def _message(
        self, env: Envelope, now: datetime, *, copy: bool = False, at: datetime | None = None
    ) -> ServiceBusMessage:
        """``env`` as a Service Bus message, scheduled for its ``not_before`` (or ``at``, a copy's
        run-again time) when that is still to come."""
        due = env.not_before if env.not_before is not None and env.not_before > now else None
        if at is not None and at > now:
            due = at
        ttl = self._time_to_live(env, due or now)
        msg = ServiceBusMessage(
            env.encode_text(),
            content_type="application/json",
            # the original carries the message id (duplicate detection can drop a producer's retry);
            # a copy made for a retry or a deferral must not look like a duplicate of it
            message_id=f"{env.message_id}.{uuid.uuid4().hex[:8]}" if copy else str(env.message_id),
            correlation_id=env.correlation_id,
            subject=env.type,
            application_properties={TYPE_PROPERTY: env.type},
            time_to_live=ttl,
        )
        if due is not None:
            msg.scheduled_enqueue_time_utc = due
        return msg

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        # the service acknowledges each send once the message is stored: ``wait`` holds either way
        now = utcnow()
        if self._app is not None:  # (the producer checked already: this holds for any other sender)
            self.check_expiry(self._app, envelopes, now)
        by_queue: dict[str, list[Envelope]] = {}
        for env in envelopes:
            by_queue.setdefault(env.queue, []).append(env)
        # every batch is built (each message encoded and measured) before any is sent: a message the
        # SDK cannot encode fails the call with nothing sent, not after the messages before it went
        # out with no history written for them (found in review)
        batches: list[tuple[str, Any, Any]] = []
        for queue, envs in by_queue.items():
            sender = self._sender(queue)
            with _boundary(f"sending to {queue}"):
                batch = await sender.create_message_batch()
                for env in envs:
                    msg = self._message(env, now)
                    if not _added(batch, msg, env):  # the batch is full: another one
                        batches.append((queue, sender, batch))
                        batch = await sender.create_message_batch()
                        _added(batch, msg, env)
                batches.append((queue, sender, batch))
        for queue, sender, batch in batches:
            with _boundary(f"sending to {queue}"):
                await sender.send_messages(batch)

    async def send_copy(self, queue: str, env: Envelope, at: datetime | None) -> None:
        """A copy of ``env`` (not taken for a duplicate of the original), scheduled for ``at``."""
        now = utcnow()
        msg = self._message(env, now, copy=True, at=at)
        with _boundary(f"re-sending to {queue}"):
            await self._sender(queue).send_messages(msg)

    # -- consuming ---------------------------------------------------------------------------------
    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        name = self.physical(sub.queue)
        link = self._link(sub.queue)
        receiver = link.receiver
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        link.idle = False
        link.receiving += 1
        try:
            with _boundary(f"receiving from {sub.queue}"):
                # waits up to receive_wait for the first message: the receive itself is the long poll
                messages = await receiver.receive_messages(
                    max_message_count=max_messages, max_wait_time=self.receive_wait
                )
        finally:
            link.receiving -= 1
        if len(messages) < max_messages and not link.receiving:
            self._watch_idle(name, link)
        live = [m for m in messages if not self._lapsed(sub, m)]
        link.unsettled += len(live)
        deliveries = [
            Delivery.of(
                _text(m),
                queue=sub.queue,
                delivery_count=(m.delivery_count or 0) + 1,
                handle=_Handle(receiver, m, link),
                lease_until=m.locked_until_utc,
            )
            for m in live
        ]
        # every message that came back is looked for in the history, all at once and each for a
        # quarter of its lock at most: one after the other, a slow history store (Tables throttled, its
        # SDK trying again) used up the locks of the whole batch before the worker held any of them,
        # and each message ran, had its success refused and came back, until it was dead-lettered
        dup = await asyncio.gather(*(self._known_duplicate(d) for d in deliveries))
        kept = []
        for d, m, known in zip(deliveries, live, dup, strict=True):
            # (a lock that lapsed during the lookups is another run's now: Service Bus delivers it again)
            if known or self._lapsed(sub, m):
                self._settled(d)
            else:
                kept.append(d)
        return kept

    @staticmethod
    def _lapsed(sub: Subscription, m: Any) -> bool:
        """A message whose lock lapsed while it waited in the receiver's buffer (the broker pushed it into
        credit a receive left) or while the history was asked about it: Service Bus has counted the
        delivery and hands it to another receive, and would refuse this run's settlement (the SDK checks
        ``_lock_expired`` before settling)."""
        if not getattr(m, "_lock_expired", False):
            return False
        log.warning(
            "message %s on %s: its lock lapsed before it could run: not run here (Service Bus "
            "delivers it again)",
            m.sequence_number,
            sub.queue,
        )
        return True

    async def _known_duplicate(self, d: Delivery) -> bool:
        h: _Handle = d.handle
        m = h.message
        until: datetime | None = m.locked_until_utc
        left = (until - utcnow()).total_seconds() if until is not None else None
        return await known_duplicate(
            self._tracker,
            d,
            m.sequence_number,
            m.delivery_count,
            lambda: _on_open_handler(h.receiver, lambda: h.receiver.complete_message(m)),
            timeout=None if left is None else max(0.0, left / 4),
        )

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        return None  # receive already waited (up to receive_wait) for work to arrive

    async def _settle_one(self, s: Settlement) -> None:
        d, decision = s.delivery, s.decision
        h: _Handle = d.handle
        r, m = h.receiver, h.message
        try:
            if isinstance(decision, Complete):
                await _on_open_handler(r, lambda: r.complete_message(m))
            elif isinstance(decision, Expire | DeadLetter):
                reason, description = dead_letter_of(decision)
                described = dead_letter_text(description)
                await _on_open_handler(
                    r, lambda: r.dead_letter_message(m, reason=reason.pascal, error_description=described)
                )
            else:
                assert d.envelope is not None, "malformed messages are always dead-lettered"
                # Send the copy first: if completing fails afterwards, a duplicate beats a loss. The
                # lock is renewed before it, so a run whose lock has already lapsed sends no copy.
                await _on_open_handler(r, lambda: r.renew_message_lock(m))
                copy = d.copy_after(decision)
                await self.send_copy(d.queue, copy, due_at(decision, utcnow()))
                try:
                    await _on_open_handler(r, lambda: r.complete_message(m))
                except Exception as exc:
                    # The copy is out and carries the outcome on; the original stays and will come
                    # back. Its sequence number goes into the history, where its return is recognised.
                    d.left_behind = str(m.sequence_number)
                    log.warning(
                        "completing message %s on %s after sending its copy failed (%s): the original "
                        "will come back and is then completed as a duplicate",
                        d.envelope.message_id,
                        d.queue,
                        _first_line(exc),
                    )
                    # at once, not only with the history written after settling: the original may
                    # already be available to another receiver (its lock is gone)
                    note = getattr(self._tracker, "note_copied", None)
                    if note is not None:
                        with contextlib.suppress(Exception):
                            await note(d.envelope.message_id, d.left_behind)
        except (MessageLockLostError, MessageAlreadySettled) as exc:
            # another consumer owns it now (the lock expired): it will be processed again there. Or an
            # earlier try of this settlement took the message off the queue and its answer was lost:
            # then nobody else will record it (see ``Delivery.unconfirmed``)
            d.refuse(type(exc).__name__)
            await self._note_if_gone(s)

    @staticmethod
    async def _note_if_gone(s: Settlement) -> None:
        """For a settlement that takes the message off its queue (completion, expiry, dead-lettering) and
        that Service Bus refused or that failed: whether the message is no longer in its queue (peeked by
        its sequence number, which a locked or scheduled message keeps), in which case this run's own
        try may be what removed it (``Delivery.unconfirmed``). Not known when the peek fails."""
        if not isinstance(s.decision, Complete | Expire | DeadLetter):
            return
        h: _Handle = s.delivery.handle
        s.delivery.unconfirmed = await _gone(h.receiver, h.message.sequence_number) is True

    async def gone_from_queue(self, queue: str, sequence_number: int) -> bool | None:
        """Whether the message with that sequence number is no longer in ``queue`` (peeked on a
        receiver of its own: the Functions host settles through the host, not through a receiver of
        the kit's); None when the peek fails."""
        try:
            async with self.client.get_queue_receiver(self.physical(queue)) as receiver:
                return await _gone(receiver, sequence_number)
        except Exception as exc:  # (opening the receiver; the peek's own failure is _gone's)
            log.warning("could not look for message %s in %s: %s", sequence_number, queue, exc)
            return None

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        results = await asyncio.gather(*(self._settle_one(s) for s in settlements), return_exceptions=True)
        with _boundary("settling messages"):  # every one failed: the first error, in the kit's terms
            settled_each(settlements, results, "Service Bus")
        # some settled, so the batch is not tried again: one that failed, its answer lost, may have
        # been applied all the same
        await asyncio.gather(
            *(
                self._note_if_gone(s)
                for s, r in zip(settlements, results, strict=True)
                if isinstance(r, Exception)
            )
        )
        # done with them either way (one that failed is not tried again): its receiver may close
        for s in settlements:
            self._settled(s.delivery)

    def _renew_within(self, d: Delivery) -> float:
        """Seconds a renewal of ``d``'s lock may take: a third of its lock. The worker waits for its
        whole round of renewals, so one renewal the SDK kept trying (a throttled or re-attaching link)
        held up the next renewal of every other message, whose locks lapsed under running handlers
        (found in review)."""
        sub = self._app.subscription(d.type_name) if self._app is not None and d.type_name else None
        lock = self.held_lease(sub) if sub is not None else MAX_LOCK
        return max(0.1, lock.total_seconds() / 3)

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        lost: list[Delivery] = []
        #: what failed a renewal otherwise: each delivery's own, so one cannot end the round for the rest
        failed: list[BaseException] = []

        async def one(d: Delivery) -> None:
            h: _Handle = d.handle
            # two tries in the round, each for half of it: a try that hangs (one slow answer) is given
            # up in time for a fresh one to renew the lock before it lapses
            each = self._renew_within(d) / 2
            for last in (False, True):
                try:
                    # the SDK's own timeout (all its tries) first; the wait stops one that overruns it
                    d.lease_until = await asyncio.wait_for(
                        _on_open_handler(
                            h.receiver,
                            lambda: h.receiver.renew_message_lock(h.message, timeout=0.9 * each),
                            timeout=0.9 * each,
                        ),
                        each,
                    )
                    return
                except (TimeoutError, OperationTimeoutError) as exc:
                    # slow, not refused: tried again (here, then next round) while the lock lasts
                    if d.lease_until is not None and d.lease_until <= utcnow():
                        lost.append(d)
                        return
                    log.warning(
                        "renewing the lock of message %s on %s took over %.1fs (%s): %s",
                        h.message.sequence_number,
                        d.queue,
                        each,
                        type(exc).__name__,
                        "tried again next round" if last else "trying again",
                    )
                except (MessageLockLostError, MessageAlreadySettled, ServiceBusError):
                    lost.append(d)
                    return
                except Exception as exc:
                    lost.append(d)
                    failed.append(exc)
                    return

        await asyncio.gather(*(one(d) for d in deliveries))
        if failed and len(failed) == len(deliveries):
            with _boundary("renewing locks"):  # none renewed: the first error, in the kit's terms
                raise failed[0]
        for exc in failed:
            log.warning("renewing the lock of a Service Bus message failed: %s", _first_line(exc))
        return lost

    # -- ops ---------------------------------------------------------------------------------------
    async def native_counts(self) -> dict[str, dict[str, int]]:
        """Active, scheduled and dead-lettered counts per queue: the queues' runtime properties when the
        identity may read them (Manage), else counted by peeking (Listen), and ``counts_note`` says so."""
        if self._app is None:
            return {}
        if self.admin is not None and self._can_manage is not False:
            try:
                counts = await self._runtime_counts(self._app)
            except MissingPermission as exc:
                self._can_manage = False
                log.warning("%s; GET stats counts by peeking from now on", exc)
            else:
                self.counts_note = None
                return counts
        self.counts_note = (
            "Service Bus counts come from peeking: the app's identity may not read queue properties "
            f"(that needs the Manage right, '{OWNER_ROLE}'), so each count is a lower bound and stops "
            f"at {PEEK_COUNT_LIMIT}"
        )
        return await self._peeked_counts(self._app)

    async def _runtime_counts(self, app: QueueingApp) -> dict[str, dict[str, int]]:
        assert self.admin is not None
        out: dict[str, dict[str, int]] = {}
        for sub in app.subscriptions():
            with _boundary("reading queue properties"), contextlib.suppress(ResourceNotFoundError):
                p = await self.admin.get_queue_runtime_properties(self.physical(sub.queue))
                out[sub.queue] = {
                    "active": p.active_message_count,
                    "scheduled": p.scheduled_message_count,
                    "dead_lettered": p.dead_letter_message_count,
                }
        return out

    async def _peeked_counts(self, app: QueueingApp) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for sub in app.subscriptions():
            active = await self._peek_all(sub.queue, None)
            dead = await self._peek_all(sub.queue, ServiceBusSubQueue.DEAD_LETTER)
            if active is None or dead is None:
                continue  # the queue is not there: no counts for it (as with runtime properties)
            scheduled = sum(1 for m in active if m.state == ServiceBusMessageState.SCHEDULED)
            out[sub.queue] = {
                "active": len(active) - scheduled,
                "scheduled": scheduled,
                "dead_lettered": len(dead),
            }
        return out

    async def _peek_all(self, queue: str, sub_queue: ServiceBusSubQueue | None) -> list[Any] | None:
        """Up to PEEK_COUNT_LIMIT messages in sequence order, none locked; None if there is no queue."""
        receiver = self.client.get_queue_receiver(self.physical(queue), sub_queue=sub_queue)
        found: list[Any] = []
        with _boundary(f"peeking at {queue}"):
            try:
                async with receiver:
                    next_sequence = 0  # 0: from the start
                    while len(found) < PEEK_COUNT_LIMIT:
                        batch = await receiver.peek_messages(
                            max_message_count=min(250, PEEK_COUNT_LIMIT - len(found)),
                            sequence_number=next_sequence,
                        )
                        if not batch:
                            break
                        found.extend(batch)
                        next_sequence = batch[-1].sequence_number + 1
            except MessagingEntityNotFoundError:
                return None
        return found

    @contextlib.asynccontextmanager
    async def _dead_letter_pages(self, queue: str) -> AsyncIterator[_DeadLetterPages]:
        receiver = self.client.get_queue_receiver(
            self.physical(queue), sub_queue=ServiceBusSubQueue.DEAD_LETTER
        )
        with _boundary(f"reading dead letters of {queue}"):
            async with receiver:
                yield _DeadLetterPages(receiver, self.admin, self.physical(queue))

    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        if record.status in ("Failed", "Sleeping"):
            raise InvalidOperation(
                f"message {record.message_id} is scheduled on Service Bus for {record.not_before}: "
                "a scheduled message cannot be brought forward (it runs then)"
            )

        # the copy is sent before the original leaves: a failure in between leaves two, never none
        async def send() -> None:
            async with reopen():
                await self.send_copy(record.queue, envelope, None)

        if record.status in DEAD_STATES:
            # the letters are found and locked before the copy is sent, and only those are completed
            # after: the copy may run and be dead-lettered again meanwhile, and its new letter stays
            # (a lock that lapsed during the send leaves the old letter, a duplicate, never a loss)
            await self._dead_letters(record.queue, {str(record.message_id)}, before_removing=send)
        else:
            await send()
        return True

    async def _cancel_scheduled(self, queue: str) -> tuple[set[str], set[str]]:
        """Cancel every scheduled message of ``queue`` (found by peeking, which shows them with their
        sequence numbers); returns the message ids of those cancelled, and of every message the peek
        found (locked, deferred and scheduled ones too). One at a time: Service Bus refuses a whole
        batch when one of it is no longer scheduled (it came due, or another purge cancelled it), and
        then cancels none."""
        sender = self._sender(queue)
        cancelled: set[str] = set()
        seen: set[str] = set()
        with _boundary(f"cancelling the scheduled messages of {queue}"):
            async with self.client.get_queue_receiver(self.physical(queue)) as receiver:
                next_sequence = 0  # 0: from the start
                while batch := await receiver.peek_messages(
                    max_message_count=250, sequence_number=next_sequence
                ):
                    next_sequence = batch[-1].sequence_number + 1
                    for m in batch:
                        seen.add(id_in_text(_text(m)))
                        if m.state != ServiceBusMessageState.SCHEDULED:
                            continue
                        try:
                            await sender.cancel_scheduled_messages(m.sequence_number)
                        except MessageNotFoundError:
                            continue  # no longer scheduled: if it came due, the drain takes it
                        cancelled.add(id_in_text(_text(m)))
        return cancelled, seen

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        raise InvalidOperation(
            "a Service Bus lock belongs to the receiver that holds it: only that receiver "
            "can release it; it returns by itself when the lock duration ends"
        )

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool:
        return True  # a flag in the history; the message itself has left the queue

    async def ops_remove(self, query: MessageQuery, records: Sequence[MessageRecord]) -> set[uuid.UUID]:
        """Dead letters (and expired ones) are removed from the dead-letter queue; a purge of a whole
        queue also cancels its scheduled messages and drains its active ones (those a worker holds
        stay). Returns the ids of the messages removed: only their history goes."""
        removed: set[str] = set()
        if is_whole_queue(query):
            assert query.queue is not None
            # scheduled messages first (a retry's or a delay's): a receive never sees them, so the
            # drain left them to run, history and all. One that came due meanwhile, the drain takes
            cancelled, seen = await self._cancel_scheduled(query.queue)
            removed |= cancelled
            # a message the history shows waiting as a scheduled message that the peek found nowhere
            # in the queue is gone from it: one an earlier purge cancelled before it stopped (its
            # history was left, and a purge again found nothing to cancel). Only those statuses: an
            # operator's retry records Pending before it sends its copy, which the peek may not see yet
            # (and only once the dead-letter queue is found empty: see below)
            nowhere = {
                str(r.message_id)
                for r in records
                if r.status in _SCHEDULED_ONLY and str(r.message_id) not in seen
            }
            with _boundary(f"draining {query.queue}"):
                async with self.client.get_queue_receiver(
                    self.physical(query.queue), receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE
                ) as r:
                    while batch := await r.receive_messages(max_message_count=100, max_wait_time=1):
                        removed |= {id_in_text(_text(m)) for m in batch}
            async with self._dead_letter_pages(query.queue) as pages:
                dead_removed = await empty_dead_letters(pages, SCAN_LIMIT)
            if dead_removed is None:  # none left: every dead letter's history goes (see there)
                removed |= nowhere
                return {
                    r.message_id for r in records if r.status in DEAD_STATES or str(r.message_id) in removed
                }
            # letters left past the scan's limit: one of them may be a message whose history still said
            # it waited (Service Bus dead-letters one by itself, at its delivery limit): it stays
            removed |= dead_removed
        else:
            dead = [r for r in records if r.status in DEAD_STATES]
            for queue in {r.queue for r in dead}:
                wanted = {str(r.message_id) for r in dead if r.queue == queue}
                removed |= await self._dead_letters(queue, wanted)
        return {r.message_id for r in records if str(r.message_id) in removed}
