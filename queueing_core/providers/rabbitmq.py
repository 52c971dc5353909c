"""RabbitMQ provider on ``aio-pika``.

- The default exchange and a durable queue per type (sanitized to RabbitMQ's rules), declared on
  publish and on subscribe, so work can be enqueued before any consumer exists. Each queue has a
  real dead-letter queue ``<queue>.dead-letter`` (beyond the seed, which drops): the queue's
  ``x-dead-letter-exchange`` routes what the broker itself drops (an AMQP ``expiration`` that ran
  out) there, and the kit publishes its own dead letters there.
- **Dead letters are published, then the original acked** (not ``nack(requeue=False)``): a nack can
  carry no reason, while a published copy carries the reason and description in its headers (and, for
  an envelope, in the envelope's headers as on the other transports) and keeps bytes that are not an
  envelope exactly as they came. The copy is confirmed before the ack, so a dead letter is never lost.
- **Receive: a consumer per queue feeding an in-process buffer** (``basic.consume`` with a prefetch
  of ``max_concurrency x prefetch``, at most AMQP's 65,535), not ``basic.get``: the broker pushes
  while handlers run, so the worker's ``receive`` finds messages waiting instead of paying a round
  trip per message, and ``wait_for_work`` wakes the moment a message arrives. A consumer that nobody
  asks for work for ``idle_timeout`` (a stopped or paused worker; never while a ``wait_for_work``
  waits on it) is cancelled and its buffered messages are handed back (as copies: a requeue would
  mark them redelivered), so an idle process does not hoard work.
- Manual ack. RabbitMQ has no native delay (``max_delay = 0``): retries with backoff, deferrals
  (pause, waiting for a handler, sleeping) and delayed enqueues go through the delayed-message store
  and are republished when due. A copy carries the attempts used in its envelope (and ``x-attempt``),
  so a pause or a wait never burns attempts; a redelivery (the consumer died holding the message)
  counts one attempt.
- Every publish waits for the broker's confirm: an enqueue returns once the broker has the message
  (``enqueue`` and ``enqueue_and_wait`` alike), and copies, dead letters and forwarded delayed
  messages are confirmed before the original is acked.
- No AMQP ``expiration``: a message past its expiry waits until a worker receives it, which records it
  "Expired" and puts it in the dead-letter queue with the reason ``expired`` (a broker time to live
  moved the message of a paused type unread, without a reason, its history left Pending). The queue's
  ``x-dead-letter-exchange`` stays for messages that have one (sent by an earlier version or by
  another publisher).
- **Properties another client wrote are read whatever they hold** (:mod:`.amqp_decoding`): a message
  id or header name that is not UTF-8, a timestamp in microseconds or headers nested hundreds deep
  closed the connection that received the message, which then came back for ever. Such a message is
  dead-lettered as malformed (``malformed-envelope``, its body kept, the reason naming what could not
  be read), never run on values that are not the ones sent.
- **A dead letter moved back with the broker's own tools runs again** (the management UI's "Move
  messages", a shovel: body and properties as they were). Its AMQP headers carry the kit's
  dead-letter reason, which no message the kit publishes to a live queue carries: it starts again as
  after an operator's retry (see :func:`_moved_back`).
- ``connect_robust`` reconnects after a broker restart; consumers are restored. Settling a message
  received on a connection that has since died is skipped (the broker requeued it): nothing acked
  is lost, and what was not acked is delivered again.
- **A settlement that cannot be completed gives the message back** (``basic.nack`` with requeue)
  ``give_back_after`` seconds after its first failed try, if no later try completed it meanwhile.
  RabbitMQ has no lease that lapses: an unacked delivery stays with its consumer's open channel until
  the process ends, so a retry whose copy to the delayed store failed (the side database down, its
  breaker open) or a dead letter the broker did not confirm would otherwise never run again while
  the worker runs. The give-back plays the part of a lapsed lease: the worker's settler still retries
  meanwhile (a brief outage costs nothing), and once the message is given back every later try of
  that settlement is refused before it copies or acks anything (its outcome is not applied; the
  redelivery, which counts one attempt, decides).

Pause/circuit state, history and the delayed store live in the SQL database of ``SideStores``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import aio_pika
from aio_pika.abc import (
    AbstractChannel,
    AbstractIncomingMessage,
    AbstractQueue,
    AbstractRobustChannel,
    AbstractRobustConnection,
)
from aio_pika.exceptions import (
    AMQPConnectionError,
    AMQPError,
    ChannelClosed,
    ChannelInvalidStateError,
    DeliveryError,
)
from yarl import URL

from .. import retry_policy
from ..clock import Clock, utcnow
from ..decisions import Complete, DeadLetter, DeadLetterReason, Expire, counts_attempt, dead_letter_of, due_at
from ..envelope import REASON, Envelope, dead_letter_marks
from ..errors import (
    InvalidOperation,
    MalformedEnvelope,
    ProviderError,
    ProviderUnavailable,
)
from ..naming import QueueNaming, Transport
from ..tracking import MessageRecord
from ..transport import Capabilities, Delivery, RunBound, Settlement, settled_each
from . import amqp_decoding
from .amqp_decoding import unreadable
from .dead_letters import DEAD_STATES, id_in_text, started_again
from .delayed import FORWARD_FAILED, DelayedMessage, forward_failed_record, record_stored_text
from .delayed.breaker import first_line
from .names import companion_name
from .side_stores import SideStoreOps, WholeQueuePurge
from .sql.history import SideStores, malformed_id
from .sql.leases import SqlLeaseStore

if TYPE_CHECKING:
    from ..app import QueueingApp, Subscription
    from ..settings import QueueingSettings

log = logging.getLogger("queueing.rabbitmq")

# before any connection reads a message: see amqp_decoding
amqp_decoding.install()

DEAD_LETTER_SUFFIX = ".dead-letter"
ATTEMPT = "x-attempt"
#: a fresh id on every message the kit publishes: a requeued message keeps it, a new copy (a retry, a
#: deferral, a handler's "run again later", an operator's retry) has its own (see _redelivery_key)
COPY = "x-queueing-copy"
#: seconds the redelivery count may wait for the side database before the receive goes on without it
COUNT_TIMEOUT = 1.0
TYPE = "x-queueing-type"
#: the longest wait between two reconnect attempts (the wait doubles from ``reconnect_interval``)
MAX_RECONNECT_INTERVAL = 30.0
#: room left in a message for what its dead letter adds (the reason and a description of up to 4,000
#: characters, JSON-escaped, in the body and the headers): a letter the broker refused left its message
#: to come back for ever, each refusal closing the channel every publish of the process shares
DEAD_LETTER_ROOM = 64 * 1024
#: the largest envelope the kit sends: RabbitMQ 4's default ``max_message_size`` (16 MiB; 3.x allowed
#: 128 MiB) less that room. A broker configured for more takes ``max_message_bytes``
MAX_MESSAGE_BYTES = 16 * 1024 * 1024 - DEAD_LETTER_ROOM
#: the most unacked messages a consumer's ``basic.qos`` can ask for (prefetch-count is an AMQP short):
#: ``max_concurrency x prefetch`` may be more (each is validated alone), and a larger value failed the
#: subscribe with a raw error, for ever (aio-pika's robust channel keeps it and asks it again on reconnect)
MAX_PREFETCH = 65535
#: the broker's ``consumer_timeout`` (30 minutes unless its configuration says otherwise): a message a
#: consumer holds unacknowledged longer than this closes the consumer's channel
CONSUMER_TIMEOUT = 1800.0
#: how long before the consumer timeout a run is cut: the broker checks it once a minute (its channel
#: tick), and the cut run's settlement (a copy published and confirmed, then the ack) must land first
CONSUMER_TIMEOUT_MARGIN = 60.0
#: a consumer timeout this long or longer is taken for none
LONGEST_CONSUMER_TIMEOUT = 366 * 24 * 3600.0


@contextlib.contextmanager
def _boundary(action: str) -> Iterator[None]:
    """aio-pika errors become the kit's: the broker unreachable -> ProviderUnavailable, else ProviderError."""
    try:
        yield
    except ProviderError:
        raise
    except DeliveryError as exc:  # nacked or returned (unroutable): the broker refused this message
        raise ProviderError(f"RabbitMQ refused the message during {action}: {first_line(exc)}") from None
    except (AMQPConnectionError, ChannelInvalidStateError, ConnectionError, OSError, TimeoutError) as exc:
        raise ProviderUnavailable(f"RabbitMQ unreachable during {action}: {first_line(exc)}") from None
    except AMQPError as exc:
        raise ProviderError(f"{action} failed: {first_line(exc)}") from None


def run_bound(consumer_timeout: float | None) -> RunBound | None:
    """The longest a run may go on, from its delivery to the consumer, before the broker's consumer
    timeout closes the channel it came on: every message of the queue held on that channel (the others
    running, those in its buffer) is then delivered again while its first run goes on, and the run that
    outlasted it runs again and again until its attempts are used (review). None: the broker has none."""
    if not consumer_timeout or not consumer_timeout < LONGEST_CONSUMER_TIMEOUT:
        return None  # (none, or so long it is none: a year and more)
    margin = min(CONSUMER_TIMEOUT_MARGIN, consumer_timeout / 10)
    return RunBound(
        timedelta(seconds=consumer_timeout - margin),
        f"the run came within {margin:g} s of RabbitMQ's consumer timeout ({consumer_timeout:g} s), past "
        "which the broker takes back every message of its channel (a broker set for longer runs: "
        "QUEUEING_RABBITMQ_CONSUMER_TIMEOUT to its consumer_timeout, in seconds)",
    )


def _said_closed(physical: str) -> Callable[[object, BaseException | None], None]:
    """A consumer's channel the broker closed (a consumer timeout, an acknowledgement it refused) is
    said once, at WARNING: its messages come back, and the lost leases each run then reports would
    show no cause."""

    def closed(_channel: object, exc: BaseException | None) -> None:
        if isinstance(exc, ChannelClosed):
            log.warning("RabbitMQ closed the consumer channel of %s: %s", physical, first_line(exc))

    return closed


def redact(url: str) -> str:
    u = URL(url)
    return str(u.with_password("******")) if u.password else str(u)


def _stale(message: AbstractIncomingMessage) -> bool:
    """Received on a channel that has since closed: the broker has put the message back already."""
    try:
        message.channel  # noqa: B018 - the property raises when the channel is closed
    except ChannelInvalidStateError:
        return True
    return False


class _QuietReconnects(logging.Filter):
    """Demote aio-pika's and aiormq's own lines about a lost connection and each reconnect attempt
    (several per attempt, some with tracebacks) to DEBUG: the provider logs one line per attempt."""

    LOGGERS = ("aiormq.connection", "aio_pika.robust_connection", "aio_pika.tools")
    NOISE = (
        "Connection attempt to",
        "error when creating transport",
        "Unexpected connection close",
        "Cancelling cause reader exited",
        "RobustChannel._on_close",
        "closed. Reconnecting after",
    )
    _installed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.CRITICAL and any(n in record.getMessage() for n in self.NOISE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            cls._installed = True
            quiet = cls()
            for name in cls.LOGGERS:
                logging.getLogger(name).addFilter(quiet)


@dataclass
class _Handle:
    message: AbstractIncomingMessage
    physical: str
    #: one settlement try at a time, and the give-back waits for a try under way (the settler may try
    #: the same settlement again while the give-back timer runs)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: acked, found stale or given back: no longer counted in flight; nothing more to do
    done: bool = False
    #: nacked back to the broker after its settlement failed: every later try is refused
    given_back: bool = False
    #: the give-back timer, armed by the first failed try
    timer: asyncio.Task[None] | None = None


@dataclass
class _Consumer:
    physical: str
    channel: AbstractChannel
    queue: AbstractQueue
    tag: str | None = None
    #: messages the broker pushed, each with when it came (the broker's consumer timeout runs from then)
    buffer: deque[tuple[AbstractIncomingMessage, datetime]] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    #: loop time of the last receive/wait_for_work (the worker still wants this queue's work)
    wanted_at: float = 0.0
    #: wait_for_work calls waiting on this consumer now: never idle meanwhile (a wait may be longer
    #: than ``idle_timeout``, and a cancelled consumer can wake nobody when a message arrives)
    waiters: int = 0
    #: the queue's type's expiration: a dead letter moved back starts it again (see _moved_back)
    expiration: timedelta | None = None


class _DeadLetterPages:
    """A dead-letter queue read with ``basic.get`` on a channel of the scan's own, which also holds a
    consumer of the queue (``prefetch`` 1) for as long as the scan runs: the broker counts consumers
    but not the letters a channel holds unacked, and a reader that holds letters is always a
    consumer, so :meth:`total` can tell (see there). The consumer is handed one letter at a time; it
    is held like the others and paged like them."""

    def __init__(self, dlq: AbstractQueue, timeout: float) -> None:
        self.dlq, self.timeout = dlq, timeout
        #: letters the scan's consumer was handed, not paged yet
        self.pushed: deque[AbstractIncomingMessage] = deque()
        self._underlay: object = None
        self._tag = ""

    async def register(self) -> None:
        await self.dlq.channel.set_qos(prefetch_count=1)
        self._tag = await self.dlq.consume(self._handed, no_ack=False)
        self._underlay = await self.dlq.channel.get_underlay_channel()

    async def _same_channel(self) -> None:
        if await self.dlq.channel.get_underlay_channel() is not self._underlay:
            # reopened after a dropped connection: the letters held went back, and delivery tags
            # (the letters' keys here) start again, so the scan cannot tell what it has read
            raise ProviderUnavailable("the connection dropped during the dead-letter scan; repeat the action")

    async def _handed(self, message: AbstractIncomingMessage) -> None:
        self.pushed.append(message)

    async def next_page(self) -> list[AbstractIncomingMessage]:
        await self._same_channel()
        if not self.pushed:
            m = await self.dlq.get(no_ack=False, fail=False, timeout=self.timeout)
            if m is None:
                # a letter handed to the consumer just before (its credit back after an ack) can be
                # written after this empty answer; the broker writes it before the next one
                m = await self.dlq.get(no_ack=False, fail=False, timeout=self.timeout)
                for _ in range(3):  # (and aio-pika hands it over two tasks later)
                    await asyncio.sleep(0)
            await self._same_channel()  # (a get waits out a reconnect, and goes on the new channel)
            if m is not None:
                return [m]
        return [self.pushed.popleft()] if self.pushed else []

    def message_id(self, item: AbstractIncomingMessage) -> str:
        return item.message_id or id_in_text(item.body.decode("utf-8", errors="replace"))

    def key(self, item: AbstractIncomingMessage) -> Any:
        return item.delivery_tag

    async def remove(self, item: AbstractIncomingMessage) -> None:
        await item.ack()

    async def total(self) -> int | None:
        """0 when no letter is out of this scan's sight: none waits and no consumer of the queue but
        this scan's own (every reader is one, from before its first read, and a reader's channel that
        closes gives its letters back and loses its consumer in one step of the queue's), in one
        answer of the broker's, taken while this scan still holds what it read; None otherwise. (A
        count taken after closing this scan's channel let another operator remove the letters it gave
        back before the count, leaving room for a letter still held elsewhere: found in review.)"""
        raw = await self.dlq.channel.get_underlay_channel()
        if raw is not self._underlay:
            return None  # reopened: see next_page
        # (asked of the channel itself: aio-pika's robust channel answers a passive declare of a queue
        # it declared before from its own memory)
        counts = await raw.queue_declare(self.dlq.name, passive=True)
        # a letter the queue handed to this scan's consumer before it counted may be written after
        # the count's answer, but before the next answer on the channel (aio-pika then hands it over
        # two tasks later)
        await raw.queue_declare(self.dlq.name, passive=True)
        for _ in range(3):
            await asyncio.sleep(0)
        if self.pushed or counts.consumer_count != 1 or counts.message_count != 0:
            return None
        if self._tag not in getattr(raw, "consumers", {}):  # (aiormq's channel; absent: cannot tell)
            # the broker cancelled this scan's consumer (the queue deleted and declared again): the
            # one consumer counted may be another reader's
            return None
        return 0

    async def hand_back(self, items: Sequence[AbstractIncomingMessage]) -> None:
        """Requeued (to their places in the queue); closing the scan's channel would return them too,
        but a retry hands back the letters it passed over before it sends its copy."""
        for m in items:
            await m.nack(requeue=True)


def _redelivery_key(d: Delivery) -> str:
    """The published copy a delivery is of: the id the kit gave it when it published it (a message
    from before that header, or another publisher's: its id and the attempts its envelope carries)."""
    assert d.envelope is not None
    copy = (d.handle.message.headers or {}).get(COPY)
    if isinstance(copy, str) and copy:
        return f"copy:{copy}"
    return f"{d.envelope.message_id}/{d.envelope.attempt}"


def _counted(task: asyncio.Future[dict[str, int]]) -> None:
    """A redelivery count done: its error (the side database down) read, so none goes unretrieved."""
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.debug("a redelivery count failed: %s", first_line(error))  # (its receive said so, if waiting)


#: AMQP's short-string properties (correlation-id, type) hold at most 255 bytes
SHORTSTR_BYTES = 255


def _short(text: str | None) -> str | None:
    """``text`` for an AMQP short-string property, or None when it does not fit: the envelope in the body
    carries it whole (the kit reads it from there), while a value too long failed the publish itself, a
    raw error after a batch's earlier messages had gone (a correlation id may be 256 characters, and
    each character up to 4 bytes)."""
    return text if text is None or len(text.encode("utf-8")) <= SHORTSTR_BYTES else None


def _moved_back(
    env: Envelope, headers: Mapping[str, Any] | None, expiration: timedelta | None, since: datetime
) -> Envelope | None:
    """``env`` started again where its message is one of the kit's dead letters moved back to its live
    queue, else None. Only an operator puts one there, with the broker's own tools (the management
    UI's "Move messages", a shovel), which publish each letter again with its body and properties as
    they were: the kit's own messages on a live queue never carry its dead-letter reason among their
    AMQP headers. Its envelope kept the attempts its message had used (all of them) and no expiry (the
    dead-letter queue keeps letters for good), so its first delivery was past its last attempt and it
    was dead-lettered again unrun, "ended without a settlement" (found in review). It starts again as
    an operator's retry sends it (and as SQS starts a letter its redrive moved back): no attempts
    used, its type's expiration from ``since`` (when the broker handed it over: RabbitMQ stamps no time
    of its own on a moved message), and without the marks of its dead-lettering."""
    if REASON not in env.headers or not isinstance((headers or {}).get(REASON), str):
        return None
    return started_again(env, expiration, since)


class RabbitMQProvider(SideStoreOps):
    transport = Transport.RABBITMQ

    def __init__(
        self,
        url: str,
        *,
        stores: SideStores,
        naming: QueueNaming | None = None,
        auto_declare: bool = True,
        ttl_grace: timedelta = timedelta(hours=1),
        prefetch: int = 1,
        publish_timeout: float = 10.0,
        reconnect_interval: float = retry_policy.AMQP_RECONNECT,
        connect_retries: int = 8,
        idle_timeout: float = 10.0,
        give_back_after: float = 30.0,
        delayed_retries: int = 3,
        dispatcher_options: dict[str, Any] | None = None,
        clock: Clock = utcnow,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        consumer_timeout: float | None = CONSUMER_TIMEOUT,
    ) -> None:
        self.url = url
        self._use_stores(stores, delayed_retries, clock, dispatcher_options)
        #: hand-outs of redelivered copies, per copy (see _count_redeliveries)
        self.redeliveries = SqlLeaseStore(stores.sql, "rabbitmq-redelivered")
        self.naming = naming
        self.auto_declare = auto_declare
        self.ttl_grace = ttl_grace
        #: the kit sends no AMQP expiration, but an earlier version sent expiry + ``ttl_grace``, after
        #: which the broker moves a message unread: ``idempotency`` keeps assuming it of a waiting
        #: message (it sends a new message rather than discard one against it, one run either way)
        self.drops_expired_after = ttl_grace
        self.prefetch = max(1, prefetch)
        self.publish_timeout = publish_timeout
        self.reconnect_interval = reconnect_interval
        self.connect_retries = connect_retries
        self.idle_timeout = idle_timeout
        #: seconds after a settlement's first failed try before the message goes back to the broker
        #: (a lease's part: longer than the worker's settle retries, ~6 s, so a brief outage of the
        #: side database is ridden out without a redelivery)
        self.give_back_after = give_back_after
        self._give_backs: set[asyncio.Task[None]] = set()
        #: redelivery counts that outlived their receive's wait (see _count_redeliveries)
        self._counts: set[asyncio.Future[dict[str, int]]] = set()
        self.capabilities = Capabilities(
            max_delay=timedelta(0),
            lock_renewal=False,
            native_dead_letter=True,
            push_wakeups=True,
            max_message_bytes=max_message_bytes,
            # its dead-letter queue has no expiry: letters, the expired ones too, stay until handled
            dead_letters_kept=DEAD_STATES,
            longest_run=run_bound(consumer_timeout),
        )
        self._conn: AbstractRobustConnection | None = None
        self._confirmed: AbstractChannel | None = None  # every publish, with publisher confirms
        self._admin: AbstractRobustChannel | None = (
            None  # declarations: a refused one closes only this channel
        )
        self._declared: set[str] = set()
        self._declare_lock = asyncio.Lock()
        self._consumers: dict[str, _Consumer] = {}
        self._consumer_lock = asyncio.Lock()
        #: queues whose prefetch was capped at AMQP's limit (said once each: see _prefetch_count)
        self._capped: set[str] = set()
        self._janitor: asyncio.Task[None] | None = None
        self._app: QueueingApp | None = None
        self._closing = False
        #: -1 while connected; else the reconnect attempts that failed in this outage
        self._failed_reconnects = -1
        _QuietReconnects.install()

    @classmethod
    def from_settings(cls, settings: QueueingSettings, **kwargs: Any) -> RabbitMQProvider:
        kwargs.setdefault("ttl_grace", settings.ttl_grace)
        kwargs.setdefault("prefetch", settings.prefetch)
        kwargs.setdefault("connect_retries", settings.connect_retries)
        kwargs.setdefault("delayed_retries", settings.delayed_store_retries)
        if settings.rabbitmq_max_message_bytes is not None:
            kwargs.setdefault("max_message_bytes", settings.rabbitmq_max_message_bytes)
        kwargs.setdefault("consumer_timeout", settings.rabbitmq_consumer_timeout or None)
        return cls(
            settings.rabbitmq_url.get_secret_value(), stores=SideStores.from_settings(settings), **kwargs
        )

    # -- wiring ------------------------------------------------------------------------------------
    @staticmethod
    def dead_letter_name(physical: str) -> str:
        return companion_name(physical, DEAD_LETTER_SUFFIX, Transport.RABBITMQ)

    @staticmethod
    def queue_arguments(physical: str) -> dict[str, Any]:
        return {
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": RabbitMQProvider.dead_letter_name(physical),
        }

    # -- lifecycle ---------------------------------------------------------------------------------
    async def open(self, app: QueueingApp) -> None:
        self._app = app
        self._closing = False
        await self.stores.open()
        if self._conn is None:
            await self._connect()
        for sub in app.subscriptions():
            await self._declare(self.physical(sub.queue))
        if self._janitor is None:
            self._janitor = asyncio.create_task(self._hand_back_idle(), name="queueing-rabbitmq-idle")

    async def _connect(self) -> None:
        delay = 0.5
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = await aio_pika.connect_robust(
                    self.url, reconnect_interval=str(self.reconnect_interval), timeout=10
                )
                break
            except (AMQPError, ConnectionError, OSError, TimeoutError) as exc:
                if attempt > self.connect_retries:
                    raise ProviderUnavailable(
                        f"RabbitMQ at {redact(self.url)} is unreachable after {attempt} tries: "
                        f"{first_line(exc)}"
                    ) from None
                log.warning(
                    "RabbitMQ at %s is unreachable (%s); retry %d/%d in %.1fs",
                    redact(self.url),
                    first_line(exc),
                    attempt,
                    self.connect_retries,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        conn.close_callbacks.add(self._on_lost)
        conn.reconnect_callbacks.add(self._on_restored)
        self._conn = conn
        with _boundary("opening channels"):
            self._confirmed = await conn.channel(publisher_confirms=True, on_return_raises=True)
            self._admin = await conn.channel(publisher_confirms=False)

    def _on_lost(self, connection: Any, exc: BaseException | None = None) -> None:
        """Called by aio-pika when the connection closes and after each failed reconnect attempt:
        one line per attempt (aio-pika's and aiormq's own lines are demoted, see ``_QuietReconnects``),
        and the wait before the next attempt doubles up to ``MAX_RECONNECT_INTERVAL``."""
        if self._closing:
            return
        why = first_line(exc) if exc else "closed"
        if self._failed_reconnects < 0:
            self._failed_reconnects = 0
            log.warning(
                "lost the connection to RabbitMQ at %s (%s); reconnecting in %.1fs",
                redact(self.url),
                why,
                self.reconnect_interval,
            )
            return
        self._failed_reconnects += 1
        wait = min(MAX_RECONNECT_INTERVAL, self.reconnect_interval * 2**self._failed_reconnects)
        connection.reconnect_interval = wait  # read by aio-pika before it sleeps for the next attempt
        log.warning(
            "RabbitMQ at %s still unreachable (%s); reconnect attempt %d failed, next in %.1fs",
            redact(self.url),
            why,
            self._failed_reconnects,
            wait,
        )

    def _on_restored(self, connection: Any) -> None:
        log.warning(
            "reconnected to RabbitMQ at %s after %d failed attempt(s); consumers restored",
            redact(self.url),
            max(0, self._failed_reconnects),
        )
        self._failed_reconnects = -1
        connection.reconnect_interval = self.reconnect_interval
        # declared again at the next publish to each: a broker back without its queues (restarted
        # without its data, a queue deleted meanwhile) returned that publish as unroutable (review)
        self._declared.clear()

    async def close(self) -> None:
        self._closing = True
        if self._janitor is not None:
            self._janitor.cancel()
            await asyncio.gather(self._janitor, return_exceptions=True)
            self._janitor = None
        # the channels close next, and the broker requeues every unacked message itself
        for task in list(self._give_backs):
            task.cancel()
        await asyncio.gather(*self._give_backs, return_exceptions=True)
        self._give_backs.clear()
        # redelivery counts still on their way (see _count_redeliveries): a few seconds, then dropped
        if self._counts:
            await asyncio.wait(set(self._counts), timeout=5)
        for count in list(self._counts):
            count.cancel()
        for c in list(self._consumers.values()):
            with contextlib.suppress(Exception):
                await self._stop_consumer(c)
        self._consumers.clear()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = self._confirmed = self._admin = None
        self._declared.clear()
        await self.stores.close()

    def _connected(self) -> AbstractRobustConnection:
        conn = self._conn
        if conn is None:
            raise ProviderUnavailable("not connected to RabbitMQ: open the runtime first")
        if not conn.connected.is_set():
            raise ProviderUnavailable(f"RabbitMQ at {redact(self.url)} is unreachable; reconnecting")
        return conn

    async def _declare(self, physical: str) -> None:
        """Declare the queue and its dead-letter queue once per connection (idempotent on the broker)."""
        if not self.auto_declare or physical in self._declared:
            return
        self._connected()
        async with self._declare_lock:
            if physical in self._declared:
                return
            assert self._admin is not None
            with _boundary(f"declaring queue {physical}"):
                # robust=False: the admin channel keeps no queue to declare again at a reconnect (it
                # kept one more at every purge and failed publish, for the life of the process, and
                # declared them all, one round trip each, before its channels were back); the kit
                # declares again itself when a publish fails (``_declared``)
                await self._admin.declare_queue(self.dead_letter_name(physical), durable=True, robust=False)
                await self._admin.declare_queue(
                    physical, durable=True, arguments=self.queue_arguments(physical), robust=False
                )
            self._declared.add(physical)

    # -- publishing --------------------------------------------------------------------------------
    def _message(
        self, env: Envelope, now: datetime, headers: dict[str, Any] | None = None
    ) -> aio_pika.Message:
        # no AMQP expiration, whatever the envelope's expiry: the kit records expiry itself (every
        # delivery checks it, and dead-letters an expired message with its reason). With one (expiry +
        # ttl_grace), a message of a paused type passed it unread and the queue's dead-letter exchange
        # moved it without the kit's reason, its history left Pending where no listing of dead letters
        # showed it
        return aio_pika.Message(
            env.encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(env.message_id),
            correlation_id=_short(env.correlation_id),
            type=_short(env.type),
            timestamp=now,
            headers={ATTEMPT: env.attempt, TYPE: env.type, COPY: uuid.uuid4().hex, **(headers or {})},
        )

    async def _publish(self, physical: str, message: aio_pika.Message, *, dead: bool = False) -> None:
        """Publish to ``physical`` (its dead-letter queue with ``dead``), declaring both first, and wait
        for the broker's confirm."""
        self._connected()
        await self._declare(physical)
        channel = self._confirmed
        assert channel is not None
        target = self.dead_letter_name(physical) if dead else physical
        try:
            with _boundary(f"publishing to {target}"):
                async with asyncio.timeout(self.publish_timeout):
                    if isinstance(channel, AbstractRobustChannel):
                        # after a reconnect the connection is up before its channels are restored:
                        # a publish in between found the channel closed (seen in CI)
                        await channel.ready()
                    # mandatory: an unroutable message (its queue deleted) is returned, not dropped
                    await channel.default_exchange.publish(message, routing_key=target, mandatory=True)
        except ProviderError:
            self._declared.discard(physical)  # declare again next time, in case it was deleted
            raise

    async def send_at(self, physical: str, env: Envelope, due: datetime | None) -> None:
        """Publish now (confirmed), or keep in the delayed store until ``due``."""
        now = self.clock()
        if due is not None and due > now:
            await self.delayed.store(env, physical, due)
        else:
            await self._publish(physical, self._message(env, now))

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        now = self.clock()
        later: list[tuple[Envelope, str, datetime]] = []
        ready: list[Envelope] = []
        for e in envelopes:
            if e.not_before is not None and e.not_before > now:
                later.append((e, self.physical(e.queue), e.not_before))
            else:
                ready.append(e)
        if later:
            # the queues exist before the dispatcher forwards to them, wherever it runs
            for physical in {p for _, p, _ in later}:
                await self._declare(physical)
            await self.delayed.store_many(later)
        await asyncio.gather(
            # confirmed, as every publish: once enqueue returns the broker has the message (``wait``
            # asks nothing more here); unconfirmed, a broker that failed before writing it would lose a
            # message the caller was told was sent
            *(self._publish(self.physical(e.queue), self._message(e, now)) for e in ready)
        )

    async def forward_delayed(self, item: DelayedMessage) -> None:
        """Publish a due message from the delayed store (confirmed: it is removed from the store next)."""
        now = self.clock()
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope as exc:
            # no run could read it: straight to the dead-letter queue, as SQS and Storage Queues send
            # such a row. Published raw to the live queue, the worker dead-lettered it under an id taken
            # from the text (the row's own message left Sleeping for good; a text naming another
            # message's id overwrote that message's history)
            await self._dead_letter_stored_text(item, f"a delayed message is not an envelope: {exc}")
            return
        await self._publish(item.destination, self._message(env, now))

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        now = self.clock()
        try:
            env = Envelope.decode(item.envelope)
        except MalformedEnvelope:
            # (a row that is not an envelope whose dead letter failed before: decoding it again here
            # failed every try, and the row was due again for ever)
            await self._dead_letter_stored_text(item, description)
            return
        await self._dead_letter_envelope(item.destination, env, FORWARD_FAILED, description, now)
        await self.stores.history.upsert([forward_failed_record(env, description, now)])

    async def _dead_letter_stored_text(self, item: DelayedMessage, description: str) -> None:
        """A delayed-store row whose text is not an envelope: the text as it was stored goes to the
        dead-letter queue with the reason ``malformed-envelope`` (in the headers, as the receive path
        sends such bytes), under the message id the row was stored with, and the history says so under
        that id. Published (confirmed) before the history is written and before the dispatcher removes
        the row: a failure after the publish leaves a second letter, never none."""
        now = self.clock()
        reason = DeadLetterReason.MALFORMED_ENVELOPE.value
        message = aio_pika.Message(
            item.envelope.encode(),
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(item.message_id),
            timestamp=now,
            headers={**dead_letter_marks(reason, description, now)},
        )
        await self._publish(item.destination, message, dead=True)
        queue = self.logical_of(item.destination)
        await record_stored_text(self.stores.history, item, queue, reason, description, now)

    async def _dead_letter_envelope(
        self, physical: str, env: Envelope, reason: str, description: str, now: datetime
    ) -> None:
        marks = dead_letter_marks(reason, description, now)
        # no expiry in the dead-letter queue: a dead letter waits for an operator, not for a TTL
        copy = env.model_copy(update={"headers": {**env.headers, **marks}, "expires_at": None})
        await self._publish(physical, self._message(copy, now, marks), dead=True)

    async def _dead_letter(
        self, d: Delivery, physical: str, attempts: int, reason: str, description: str
    ) -> None:
        now = self.clock()
        if d.envelope is not None:
            env = d.envelope.with_attempt(attempts)
            await self._dead_letter_envelope(physical, env, reason, description, now)
            return
        # not an envelope: keep the bytes as they came, say why in the headers
        raw = d.raw if isinstance(d.raw, bytes) else d.raw.encode()
        message = aio_pika.Message(
            raw,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(malformed_id(d.text())),
            timestamp=now,
            headers={**dead_letter_marks(reason, description, now)},
        )
        await self._publish(physical, message, dead=True)

    # -- consuming ---------------------------------------------------------------------------------
    async def _consumer(self, sub: Subscription) -> _Consumer:
        physical = self.physical(sub.queue)
        c = self._consumers.get(physical)
        if c is not None and c.tag is not None:
            c.wanted_at = asyncio.get_running_loop().time()
            return c
        async with self._consumer_lock:
            c = self._consumers.get(physical)
            if c is None or c.tag is None:
                conn = self._connected()
                await self._declare(physical)
                with _boundary(f"subscribing to {physical}"):
                    if c is None:
                        channel = await conn.channel(publisher_confirms=False)
                        try:
                            # the broker hands out at most this many unacked messages: the worker's slots
                            await channel.set_qos(prefetch_count=self._prefetch_count(sub, physical))
                            queue = await channel.declare_queue(
                                physical, durable=True, arguments=self.queue_arguments(physical)
                            )
                        except BaseException:
                            # a robust channel left open stays with the connection, which reopens it
                            # (and asks its settings again) at every reconnect: one per failed try
                            with contextlib.suppress(Exception):
                                await channel.close()
                            raise
                        channel.close_callbacks.add(_said_closed(physical))
                        c = self._consumers[physical] = _Consumer(
                            physical, channel, queue, expiration=sub.options.expiration
                        )
                    consumer = c

                    async def on_message(message: AbstractIncomingMessage) -> None:
                        consumer.buffer.append((message, utcnow()))
                        consumer.ready.set()

                    c.tag = await c.queue.consume(on_message, no_ack=False)
            c.wanted_at = asyncio.get_running_loop().time()
            return c

    def _prefetch_count(self, sub: Subscription, physical: str) -> int:
        """The type's slots times ``prefetch``, at most AMQP's limit: so many unacked messages already
        mean "as many as the broker will push", so the limit is the setting's sensible reading."""
        wanted = sub.options.max_concurrency * self.prefetch
        if wanted <= MAX_PREFETCH:
            return wanted
        if physical not in self._capped:
            self._capped.add(physical)
            log.warning(
                "the prefetch of %s (max_concurrency %d x prefetch %d = %d) is over AMQP's limit; "
                "the consumer asks for %d",
                physical,
                sub.options.max_concurrency,
                self.prefetch,
                wanted,
                MAX_PREFETCH,
            )
        return MAX_PREFETCH

    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        c = await self._consumer(sub)
        out: list[Delivery] = []
        while c.buffer and len(out) < max_messages:
            m, came = c.buffer.popleft()
            if _stale(m):
                continue  # from before a reconnect: the broker requeued it and will deliver it again
            c.in_flight += 1
            out.append(self._delivery(m, came, sub.queue, c))
        if not c.buffer:
            c.ready.clear()
        try:
            await self._count_redeliveries([d for d in out if d.handle.message.redelivered])
        except BaseException:  # cancelled while counting: they never reached a handler, back they go
            for d in reversed(out):
                c.buffer.appendleft((d.handle.message, d.received_at))
            c.in_flight = max(0, c.in_flight - len(out))
            c.ready.set()
            raise
        return out

    def _delivery(self, m: AbstractIncomingMessage, came: datetime, queue: str, c: _Consumer) -> Delivery:
        # classic queues count no deliveries: a redelivery means a consumer died holding it (running it,
        # or only in its buffer); see _count_redeliveries
        count = 2 if m.redelivered else 1
        handle = _Handle(m, c.physical)
        damaged = unreadable(m.headers)
        if damaged is not None:
            # not run, whatever its body: what the properties that could not be read said is unknown
            # (a header the handler or the kit reads, an id). Dead-lettered as malformed, its body kept
            why = MalformedEnvelope(f"its AMQP properties could not be read: {damaged}", m.body)
            return Delivery(queue, m.body, None, why, count, handle, came)
        d = Delivery.of(m.body, queue=queue, delivery_count=count, handle=handle, received_at=came)
        fresh = None if d.envelope is None else _moved_back(d.envelope, m.headers, c.expiration, came)
        if fresh is not None:
            log.info(
                "RabbitMQ message %s (%s) came back from its dead-letter queue (moved by the broker's "
                "tools): run again with fresh attempts",
                fresh.message_id,
                fresh.type,
            )
            d.envelope, d.attempt = fresh, fresh.attempt + count
        return d

    async def _count_redeliveries(self, redelivered: list[Delivery]) -> None:
        """The broker says only "redelivered": the first redelivery of a copy is taken as one attempt
        used (its consumer died holding it), but not as proof of a run (it may have sat in a buffer
        whose connection dropped), so it runs. Every copy this process hands out redelivered is counted
        in the side database; each one after that counts an attempt more and does prove the attempts
        used: a message that kills every worker that takes it is dead-lettered once they are used up
        (without this it went round for ever). A count that cannot be read leaves the first reading."""
        counted = [d for d in redelivered if d.envelope is not None]
        for d in redelivered:
            d.runs_counted = False
        if not counted:
            return
        keys = {id(d): _redelivery_key(d) for d in counted}
        # bounded: the broker's receive never waits long on the side database (a write lock held
        # elsewhere, a connect timeout). The count goes on by itself (a database call in a thread is not
        # cut short by a cancellation) and is kept for the next redelivery; this one takes the first
        # reading. A receive cancelled meanwhile leaves it running too
        task = asyncio.ensure_future(self.redeliveries.count(sorted(set(keys.values())), self.clock()))
        self._counts.add(task)
        task.add_done_callback(self._counts.discard)
        task.add_done_callback(_counted)
        done, _ = await asyncio.wait({task}, timeout=COUNT_TIMEOUT)
        if not done:
            log.warning("counting redeliveries on RabbitMQ took over %.0fs: counted later", COUNT_TIMEOUT)
            return
        try:
            before = task.result()
        except Exception as exc:  # the side database is down: run it, as before the count
            log.warning("could not count redeliveries on RabbitMQ: %s", first_line(exc))
            return
        for d in counted:
            handed = before.get(keys[id(d)], 0)  # hand-outs of this copy redelivered, before this one
            d.attempt += handed
            d.runs_counted = handed > 0

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        c = await self._consumer(sub)
        c.waiters += 1
        try:
            if not c.buffer:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.ready.wait(), timeout)
        finally:
            c.waiters -= 1
            c.wanted_at = asyncio.get_running_loop().time()

    async def _hand_back_idle(self) -> None:
        """Cancel consumers nobody asks for work (a stopped or paused worker) and hand their buffered
        messages back to the queue, so other consumers get them."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.05, self.idle_timeout / 4))
            for c in list(self._consumers.values()):
                if self._idle(c, loop.time()) and (c.tag is not None or c.buffer):
                    try:
                        await self._stop_consumer(c, if_idle=True)
                    except Exception as exc:
                        log.warning("could not stop the idle consumer of %s: %s", c.physical, first_line(exc))

    def _idle(self, c: _Consumer, now: float) -> bool:
        return c.in_flight == 0 and c.waiters == 0 and now - c.wanted_at > self.idle_timeout

    async def _stop_consumer(self, c: _Consumer, *, if_idle: bool = False) -> None:
        async with self._consumer_lock:
            if if_idle and not self._idle(c, asyncio.get_running_loop().time()):
                return  # asked for work while the lock was awaited (a wait for work began)
            if c.tag is not None:
                tag, c.tag = c.tag, None
                with _boundary(f"cancelling the consumer of {c.physical}"):
                    await c.queue.cancel(tag)
            held = list(c.buffer)
            c.buffer.clear()
            c.ready.clear()
        for m, came in held:
            await self._hand_back(m, came, c)

    async def _hand_back(self, m: AbstractIncomingMessage, came: datetime, c: _Consumer) -> None:
        """Return a message that never reached a handler without marking it redelivered."""
        if _stale(m):
            return
        physical = c.physical
        try:
            env = Envelope.decode(m.body)
        except MalformedEnvelope:
            env = None
        try:
            if env is None:
                raise ProviderError("not an envelope")
            if unreadable(m.headers) is not None:
                # (a copy would carry none of its properties, those that could not be read included:
                # it would run as a message it is not)
                raise ProviderError("its AMQP properties could not be read")
            # a dead letter moved back is handed back started again: the copy carries none of the
            # marks that tell one, and its used attempts would dead-letter it unrun
            env = _moved_back(env, m.headers, c.expiration, came) or env
            await self._publish(physical, self._message(env, self.clock()))
            await m.ack()
        except (ProviderError, AMQPError, ChannelInvalidStateError) as exc:
            # (said, because the broker then marks it redelivered: its next run counts one attempt,
            # and a copy whose confirm was only late is a duplicate)
            log.warning(
                "could not hand a buffered message of %s back as a copy (%s): returned to the broker",
                physical,
                first_line(exc),
            )
            with contextlib.suppress(AMQPError, ChannelInvalidStateError):
                await m.nack(requeue=True)

    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]:
        done = await super().maintain(app)
        done["redeliveries_pruned"] = await self.redeliveries.prune(self.clock())
        return done

    # -- settling ----------------------------------------------------------------------------------
    async def _settle_one(self, s: Settlement) -> None:
        d, decision = s.delivery, s.decision
        h: _Handle = d.handle
        # the settler may try the same settlement again (after a failure) while the give-back timer
        # runs: one at a time, and never after the message was given back
        async with h.lock:
            if h.given_back:
                d.refuse("given back to the broker when its settlement could not be completed")
                return
            if h.done:
                return  # acked by an earlier try
            if _stale(h.message):
                d.refuse("the channel that received it closed; the broker delivers it again")
                self._resolved(h)
                return
            try:
                now = self.clock()
                if isinstance(decision, Complete):
                    pass
                elif isinstance(decision, Expire | DeadLetter):
                    reason, description = dead_letter_of(decision)
                    await self._dead_letter(
                        d, h.physical, d.attempts_used(decision), reason.value, description
                    )
                else:
                    assert d.envelope is not None, "malformed messages are always dead-lettered"
                    used = d.attempts_used(decision)
                    if not d.runs_counted and not counts_attempt(decision):
                        # a first redelivery's attempt (its consumer died holding it) was never proven
                        # a run, and this delivery did not run it either (a stop, a pause): the copy
                        # keeps the attempts its envelope had, or its next delivery would read them
                        # as used and dead-letter it unrun
                        used = min(used, d.envelope.attempt)
                    # the copy first: if the ack fails afterwards, a duplicate beats a loss
                    copy = d.copy_after(decision, used)
                    await self.send_at(h.physical, copy, due_at(decision, now))
                with _boundary("acknowledging a message"):
                    await h.message.ack()
            except BaseException:
                # no lease lapses on RabbitMQ: unless a later try completes it, the message goes back
                # to the broker, or it would sit unacked on this open channel until the process ends
                # (a try cancelled half-way too: its consumer would count it in flight for ever)
                self._give_back_later(h)
                raise
            self._resolved(h)

    def _resolved(self, h: _Handle) -> None:
        """Nothing more to do for ``h``: no longer in flight (counted once, however many tries)."""
        if h.done:
            return
        h.done = True
        if h.timer is not None and h.timer is not asyncio.current_task():
            h.timer.cancel()
        c = self._consumers.get(h.physical)
        if c is not None:
            c.in_flight = max(0, c.in_flight - 1)

    def _give_back_later(self, h: _Handle) -> None:
        if h.timer is None and not h.done:
            h.timer = asyncio.create_task(self._give_back(h), name="queueing-rabbitmq-give-back")
            self._give_backs.add(h.timer)
            h.timer.add_done_callback(self._give_backs.discard)

    async def _give_back(self, h: _Handle) -> None:
        """``give_back_after`` seconds after a settlement's first failed try: if no try completed it
        meanwhile, nack it with requeue so the broker delivers it again (a lapsed lease's part)."""
        await asyncio.sleep(self.give_back_after)
        async with h.lock:  # a try under way finishes first (and may complete it)
            if h.done:
                return
            h.given_back = True  # from here every try of its settlement is refused
            self._resolved(h)
            if _stale(h.message):
                return  # its channel closed: the broker has it back already
            try:
                await h.message.nack(requeue=True)
            except Exception as exc:  # a closed channel returns it all the same
                log.warning("could not give a message back to %s: %s", h.physical, first_line(exc))
                return
        log.warning(
            "gave a message back to %s: its settlement did not complete within %.0fs; it is delivered again",
            h.physical,
            self.give_back_after,
            extra={"message_id": h.message.message_id},
        )

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        results = await asyncio.gather(*(self._settle_one(s) for s in settlements), return_exceptions=True)
        settled_each(settlements, results, "RabbitMQ")

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        return []  # no lease: a message stays with its consumer until acked or the channel closes

    # -- ops ---------------------------------------------------------------------------------------
    async def depth(self, physical: str, *, dead: bool = False) -> int:
        """Ready messages in a queue or its dead-letter queue (not those held by consumers)."""
        waiting, _ = await self._waiting_and_consumers(self.dead_letter_name(physical) if dead else physical)
        return waiting

    async def native_counts(self) -> dict[str, dict[str, int]]:
        """Ready messages, dead letters and delayed messages per queue, from the broker and the store."""
        if self._app is None:
            return {}
        delayed = await self.delayed.counts()
        out: dict[str, dict[str, int]] = {}
        for sub in self._app.subscriptions():
            physical = self.physical(sub.queue)
            try:
                out[sub.queue] = {
                    "ready": await self.depth(physical),
                    "dead_lettered": await self.depth(physical, dead=True),
                    "delayed": delayed.get(physical, 0),
                }
            except ProviderUnavailable:
                # the broker itself unreachable is no "not declared": the counts are unknown, and
                # `GET health` / `GET stats` must answer 503 rather than all green without them
                raise
            except ProviderError as exc:  # not declared (auto_declare off): no counts, not an error
                log.debug("no broker counts for %s: %s", physical, exc)
        return out

    @contextlib.asynccontextmanager
    async def _dead_letter_pages(self, queue: str) -> AsyncIterator[_DeadLetterPages]:
        """The dead-letter queue on a channel of its own: letters got and not acked stay with that
        channel (so the next get returns the ones after them) and go back, in order, when it closes."""
        physical = self.physical(queue)
        channel = await self._connected().channel(publisher_confirms=False)
        try:
            with _boundary(f"reading dead letters of {physical}"):
                dead = self.dead_letter_name(physical)
                dlq = await channel.declare_queue(dead, durable=True)
                pages = _DeadLetterPages(dlq, self.publish_timeout)
                await pages.register()  # before the first read: see _DeadLetterPages.total
                yield pages
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _send_now(self, queue: str, envelope: Envelope) -> None:
        await self.send_at(self.physical(queue), envelope, None)

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        raise InvalidOperation(
            "a RabbitMQ delivery belongs to the consumer channel that holds it: only that consumer "
            "can release it; it returns to the queue by itself if that consumer goes away"
        )

    async def _waiting_and_consumers(self, name: str) -> tuple[int, int]:
        """The letters waiting in a queue and its consumers, in one answer of the broker's."""
        # a passive declare of a missing queue closes its channel: one of its own (and the channel
        # itself asked: aio-pika's robust channel answers a passive declare of a queue it declared
        # before from its own memory, with the counts of that first answer)
        channel = await self._connected().channel(publisher_confirms=False)
        try:
            with _boundary(f"counting the messages of {name}"):
                ok = await (await channel.get_underlay_channel()).queue_declare(name, passive=True)
            return ok.message_count or 0, ok.consumer_count or 0
        finally:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _purge_whole(self, queue: str) -> WholeQueuePurge:
        """Both queues purged. AMQP's purge leaves the letters a channel holds unacked (another
        operator's scan of the dead letters), and those must keep their history: so every dead
        letter's history goes only when, after the purge, none waits and no reader holds any (every
        reader is a consumer of the queue: see _DeadLetterPages); otherwise none does (an empty set),
        and a repeat of the purge, once alone, lets the history of the letters it purged go. It also
        leaves the live queue's deliveries a worker's consumer holds: the answer says how many it took
        and whether a consumer was there (see :class:`WholeQueuePurge`)."""
        assert self._admin is not None
        physical = self.physical(queue)
        dead = self.dead_letter_name(physical)
        await self._declare(physical)
        purged: dict[str, int] = {}
        with _boundary(f"purging {physical}"):
            for name, args in ((physical, self.queue_arguments(physical)), (dead, None)):
                q = await self._admin.declare_queue(name, durable=True, arguments=args, robust=False)
                ok = await q.purge()
                purged[name] = ok.message_count or 0
        dead_gone = await self._waiting_and_consumers(dead) == (0, 0)
        return WholeQueuePurge(
            dead=None if dead_gone else set(),
            purged=purged[physical],
            live_all_gone=await self._waiting_and_consumers(physical) == (0, 0),
        )
