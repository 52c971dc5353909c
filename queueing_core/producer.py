"""The producer API: enqueue, enqueue_many, enqueue_and_wait."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable
from uuid import UUID

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError
from typing_extensions import Unpack

from .clock import Clock, as_utc, utcnow
from .decisions import LATEST
from .decisions import _in_utc as kept_time
from .envelope import Envelope
from .errors import InvalidArgument, MessageTooLarge, NotSupported
from .hooks import Event, Observation
from .messages import NOT_UTF8, TOO_DEEP, MessageStatus, QueueMessage, encodable, too_deep
from .middleware import EnqueueNext, compose_enqueue, same_middleware
from .options import QueueOptions
from .tracking.base import MessageRecord, record_from_envelope

if TYPE_CHECKING:
    from .app import QueueingApp
    from .tracking.backlog import HistoryWriter
    from .transport import Provider


class EnqueueOptions(TypedDict, total=False):
    """Per-enqueue options. ``delay``/``not_before`` make the message Sleeping until then;
    ``ttl``/``expires_at`` override the queue's expiration. ``not_before``/``expires_at`` are
    timezone-aware (a naive time is refused); a time past ``decisions.LATEST`` is kept as it."""

    delay: timedelta | float | None
    not_before: datetime | None
    ttl: timedelta | float | None
    expires_at: datetime | None
    correlation_id: str | None
    headers: dict[str, str] | None
    tracking_id: UUID | None


@dataclass(frozen=True, slots=True)
class EnqueueReceipt:
    message_id: UUID
    tracking_id: UUID
    type: str
    queue: str
    status: str
    not_before: datetime | None
    expires_at: datetime | None
    #: ``enqueued``; for idempotent types also ``discarded`` (nothing was written: the waiting message
    #: of its identity has the same JSON, or, off SQL, this message id was sent before and a newer
    #: version has replaced it since) or ``replaced`` (the waiting message took the new body). On SQL
    #: also ``duplicate``: a message of this id is stored already (sent before, maybe finished), and
    #: nothing was written (the other transports cannot tell, and say ``enqueued``). When not
    #: ``enqueued``, the ids are the waiting (newest) message's (a duplicate's: this request's); the
    #: status and times are this request's, not read back from that message.
    outcome: str = "enqueued"
    #: transports that cannot edit a queued message (all but SQL): the waiting version this one
    #: superseded; it is settled Cancelled, "superseded by" this one, without running
    supersedes: UUID | None = None


@dataclass(frozen=True, slots=True)
class IdempotentOutcome:
    outcome: str  # enqueued | discarded | replaced | duplicate (see EnqueueReceipt.outcome)
    message_id: UUID
    tracking_id: UUID
    #: the waiting version this one superseded (transports that cannot edit a queued message)
    supersedes: UUID | None = None


def outlasts(waiting: datetime | None, new: datetime | None) -> bool:
    """Whether a waiting version that expires at ``waiting`` may stand for a new one of the same JSON
    that expires at ``new`` (None: never): only if it expires no sooner. One that expires sooner (or
    has expired and waits to be settled so) would leave the new run requested unrun."""
    return waiting is None or (new is not None and as_utc(waiting) >= as_utc(new))


@runtime_checkable
class SendsIdempotent(Protocol):
    """A provider that can find the waiting message of an identity and hold back or replace it."""

    async def send_idempotent(
        self, envelopes: Sequence[Envelope], identities: Sequence[str]
    ) -> list[IdempotentOutcome]: ...


#: the receipt's outcome for a message whose id the transport holds already (nothing was written)
DUPLICATE = "duplicate"


@runtime_checkable
class SendsNew(Protocol):
    """A provider that says which envelopes of a send it stored: one whose message id it holds already
    adds nothing (SQL: the insert skips it), and must not be told enqueued, announced or recorded."""

    async def send_new(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> list[bool]: ...


@runtime_checkable
class LimitsExpiry(Protocol):
    """A provider whose queues cap how long a message may live (Service Bus caps it at the queue's
    time to live): it refuses one that would outlast its queue before anything is sent."""

    def check_expiry(self, app: QueueingApp, envelopes: Sequence[Envelope], now: datetime) -> None: ...


def identity_of(options: QueueOptions, message: QueueMessage, *, sending: bool = False) -> str:
    """An idempotent message's identity key: its ``identity`` field, or the function's value, as text.
    ``sending``: refuse None, which every message without a value would share as one identity (each
    would supersede or be discarded against another's); a message stored before is keyed as it was."""
    key = options.identity
    value = key(message) if callable(key) else getattr(message, key or "")
    if sending and value is None:
        raise InvalidArgument(
            "identity",
            "is None: an idempotent message is keyed by its identity, and every message without one "
            "would share the key 'None'; give it a value, or send it as a type that is not idempotent",
        )
    text = str(value)
    if not text or len(text) > MAX_IDENTITY:
        raise InvalidArgument("identity", f"must be 1 to {MAX_IDENTITY} characters, not {len(text)}")
    return text


MAX_IDENTITY = 256


def identities_of(app: QueueingApp, messages: Sequence[QueueMessage]) -> list[str | None]:
    """The identity of each message of an idempotent type (None for the others; empty if none is):
    what every way of sending (enqueue, the outbox, a schedule's tick) finds the waiting message by."""
    keys: list[str | None] = []
    idempotent: dict[type[QueueMessage], QueueOptions | None] = {}
    for m in messages:
        if type(m) not in idempotent:
            opts = app.options_for(type(m))
            idempotent[type(m)] = opts if opts.idempotent else None
        opts_or_none = idempotent[type(m)]
        keys.append(identity_of(opts_or_none, m, sending=True) if opts_or_none is not None else None)
    return keys if any(k is not None for k in keys) else []


def _when(
    now: datetime, relative: timedelta | float | None, absolute: datetime | None, what: tuple[str, str]
) -> datetime | None:
    if relative is not None and absolute is not None:
        raise InvalidArgument(what[0], f"pass either {what[0]}= or {what[1]}=, not both")
    if absolute is not None:
        if not isinstance(absolute, datetime):
            raise InvalidArgument(what[1], f"must be a datetime, not {type(absolute).__name__}")
        if absolute.utcoffset() is None:
            # Python reads a naive time as local (``astimezone``, ``timestamp``), this kit read it as UTC:
            # "in two hours" as ``datetime.now() + ...`` came due hours early or late, without a word
            raise InvalidArgument(
                what[1],
                "has no time zone: give a timezone-aware datetime "
                "(e.g. datetime.now(UTC) + timedelta(hours=2))",
            )
        return kept_time(absolute)  # in UTC, and no later than LATEST (see there)
    if relative is None:
        return None
    if isinstance(relative, datetime):
        raise InvalidArgument(what[0], f"is a time, not a length of time: pass {what[1]}= for a time")
    if isinstance(relative, timedelta):
        delta = relative
    else:
        try:
            delta = timedelta(seconds=relative)
        except (OverflowError, ValueError):  # NaN, infinity, beyond 999,999,999 days
            raise InvalidArgument(what[0], f"{relative!r} is not a usable number of seconds") from None
    if delta < timedelta(0):
        raise InvalidArgument(what[0], "must not be negative")
    try:
        return min(now + delta, LATEST)
    except OverflowError:
        raise InvalidArgument(what[0], "puts the time past the year 9999") from None


def build_envelope(
    app: QueueingApp, message: QueueMessage, now: datetime, **options: Unpack[EnqueueOptions]
) -> Envelope:
    """The envelope ``enqueue`` would send (pure; raises :class:`InvalidArgument`, a ``ValueError``, for
    timing that contradicts itself)."""
    mtype = type(message)
    sub = app.subscription(mtype.type_name())
    if sub is None or sub.message_type is not mtype:
        # producing a type registers it, so the ops API knows its queue; and another class under a
        # registered type name is refused as registering it is: its messages went to the registered
        # type's queue (dead-lettered there, its body not that model's) or to a queue nobody consumes
        app.produced(mtype)
    qopts = app.options_for(mtype)
    due = _when(now, options.get("delay"), options.get("not_before"), ("delay", "not_before"))
    expiry = _when(now, options.get("ttl"), options.get("expires_at"), ("ttl", "expires_at"))
    if expiry is None and qopts.expiration is not None:
        try:
            # (capped as every time the kit keeps: one late in 9999 failed each read on PostgreSQL)
            expiry = min(message.created_at + qopts.expiration, LATEST)
        except OverflowError:
            raise InvalidArgument("created_at", "is too late to add the queue's expiration to") from None
    if expiry is not None and expiry <= now:
        raise InvalidArgument(
            "expires_at", f"the message would expire at {expiry.isoformat()}, which is not in the future"
        )
    if due is not None and due <= now:
        due = None
    # Processing expires a message at its expiry, so one due then or later could never run. Refused
    # here, where every way of enqueueing passes (code, the CLI, the ops API, the outbox), before any
    # write: it is always the caller's mistake, and a silent accept only shows up hours later.
    if due is not None and expiry is not None and due >= expiry:
        raise InvalidArgument(
            "delay" if options.get("delay") is not None else "not_before",
            f"the message would be due at {due.isoformat()} (not_before), at or after it expires at "
            f"{expiry.isoformat()} (expires_at), so it could never run; shorten the delay or give it "
            "a later expiry (ttl= or expires_at=)",
        )
    try:
        return _envelope(mtype, message, due, expiry, options)
    except ValidationError as exc:  # e.g. a correlation id over 256 characters, or not Unicode text
        raise _invalid(exc) from None


def _invalid(exc: ValidationError, after: str = "") -> InvalidArgument:
    error = exc.errors(include_url=False)[0]
    return InvalidArgument(".".join(map(str, error["loc"])) or "message", error["msg"] + after)


async def through_middleware(chain: EnqueueNext, envelopes: Sequence[Envelope]) -> list[Envelope]:
    """Envelopes through the enqueue middleware, each it changed validated again, before anything is
    sent: ``model_copy(update=...)`` (how middleware stamps a header) skips validation, and a header
    that is not text (None from a lookup, an int) was sent, then every copy was dead-lettered as a
    malformed envelope unrun. One it passed on unchanged costs nothing more."""
    out = []
    for env in envelopes:
        after = await chain(env)
        if after is not env:
            if not isinstance(after, Envelope):
                raise InvalidArgument(
                    "envelope",
                    f"enqueue middleware returned {type(after).__name__}, not an envelope "
                    "(end it with `return await call_next(envelope)`)",
                )
            try:
                after = Envelope.model_validate(dict(after))  # its fields as they are: no dump first
            except ValidationError as exc:
                raise _invalid(exc, " (as enqueue middleware left the envelope)") from None
        out.append(after)
    return out


def _envelope(
    mtype: type[QueueMessage],
    message: QueueMessage,
    due: datetime | None,
    expiry: datetime | None,
    options: EnqueueOptions,
) -> Envelope:
    return Envelope(
        type=mtype.type_name(),
        queue=mtype.queue_options().name or mtype.type_name(),
        message_id=message.message_id,
        # (its own message id unless given: a message sent again for the same work may carry the first's)
        tracking_id=options.get("tracking_id") or message.message_id,
        correlation_id=options.get("correlation_id") or message.correlation_id,
        attempt=0,
        created_at=message.created_at,
        not_before=due,
        expires_at=expiry,
        headers={**message.properties, **(options.get("headers") or {})},
        body=message.body(),
    )


#: the JSON escape of U+0000 after an even number of backslashes (so not an escaped backslash + "u0000")
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


def check_sendable(envelopes: Sequence[Envelope], limit: int | None, transport: str) -> None:
    """Refuse, before anything is sent, an envelope over the transport's size limit, one that cannot be
    encoded, and one whose text holds U+0000: PostgreSQL stores neither JSON nor text with it, and the
    kit refuses it on every transport so that a message behaves the same wherever it goes."""
    for env in envelopes:
        try:
            data = env.encode()
        except PydanticSerializationError as exc:
            # nested past pydantic-core's limit (a body QueueMessage.body() bounds, that enqueue
            # middleware deepened), or text that is not Unicode: a lone surrogate from "\ud800"
            raise InvalidArgument("message", TOO_DEEP if too_deep(exc) else NOT_UTF8) from None
        if not all(map(encodable, env.headers)):  # (encoded above as U+FFFD, not refused)
            raise InvalidArgument("message", f"a header's name {NOT_UTF8} (a lone surrogate)")
        if limit is not None and len(data) > limit:
            raise MessageTooLarge(len(data), limit, transport)
        if b"\\u0000" in data and _NUL_ESCAPE.search(data):
            raise InvalidArgument(
                "message", "holds the character U+0000 (body, headers or correlation id): no store keeps it"
            )


class Producer:
    def __init__(
        self,
        app: QueueingApp,
        provider: Provider,
        *,
        history: HistoryWriter | None = None,
        clock: Clock = utcnow,
        opener: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.app = app
        self.provider = provider
        self.history = history
        self.clock = clock
        self._opener = opener  # opens the provider on first use, so producer-only apps need no start-up call
        #: sends idempotent types where the provider cannot (the runtime sets it when its control store
        #: keeps identities; see queueing_core.idempotency)
        self.identities: SendsIdempotent | None = None
        self._chain_middleware = list(app.enqueue_middleware)
        self._chain = compose_enqueue(self._chain_middleware)

    def envelope_for(
        self, message: QueueMessage, *, now: datetime | None = None, **options: Unpack[EnqueueOptions]
    ) -> Envelope:
        return build_envelope(self.app, message, now or self.clock(), **options)

    async def prepare(self, envelopes: Sequence[Envelope]) -> list[Envelope]:
        """Envelopes through the enqueue middleware and the size checks, ready for the transport."""
        if not same_middleware(self._chain_middleware, self.app.enqueue_middleware):  # changed since
            self._chain_middleware = list(self.app.enqueue_middleware)
            self._chain = compose_enqueue(self._chain_middleware)
        out = await through_middleware(self._chain, envelopes) if self._chain_middleware else list(envelopes)
        check_sendable(out, self.provider.capabilities.max_message_bytes, self.provider.transport.value)
        if isinstance(self.provider, LimitsExpiry):
            # here, before an idempotent type's identity is looked up or anything is sent
            self.provider.check_expiry(self.app, out, self.clock())
        return out

    def _status(self, env: Envelope) -> str:
        if env.not_before is not None:
            return MessageStatus.SLEEPING
        sub = self.app.subscription(env.type)
        return sub.options.default_status if sub else MessageStatus.PENDING

    async def _send(
        self, envelopes: Sequence[Envelope], *, wait: bool, identities: Sequence[str | None] = ()
    ) -> list[EnqueueReceipt]:
        return await self.send_prepared(await self.prepare(envelopes), wait=wait, identities=identities)

    async def send_prepared(
        self, ready: Sequence[Envelope], *, wait: bool = True, identities: Sequence[str | None] = ()
    ) -> list[EnqueueReceipt]:
        """Send envelopes from :meth:`prepare` (an idempotent type's through the provider's own
        find-or-replace), then record and announce them."""
        if self._opener is not None:
            await self._opener()
        keyed = [i for i, key in enumerate(identities) if key is not None]
        outcomes: dict[int, IdempotentOutcome] = {}
        if keyed:
            sender = self.provider if isinstance(self.provider, SendsIdempotent) else self.identities
            if sender is None:
                raise NotSupported(
                    f"{ready[keyed[0]].type} is idempotent, and {self.provider.transport.value} cannot find "
                    "the waiting message of an identity, nor does this runtime's control store keep "
                    "identities for it; use the SQL provider or a control store of the kit"
                )
            found = await sender.send_idempotent(
                [ready[i] for i in keyed], [str(identities[i]) for i in keyed]
            )
            outcomes = dict(zip(keyed, found, strict=True))
        plain = [i for i in range(len(ready)) if i not in outcomes]
        if plain:
            envs = [ready[i] for i in plain]
            if isinstance(self.provider, SendsNew):
                stored = await self.provider.send_new(envs, wait=wait)
                for i, env, new in zip(plain, envs, stored, strict=True):
                    if not new:  # (told enqueued and announced, though the transport wrote nothing)
                        outcomes[i] = IdempotentOutcome(DUPLICATE, env.message_id, env.tracking_id)
            else:
                await self.provider.send(envs, wait=wait)
        return await self.sent(ready, outcomes)

    async def sent(
        self, ready: Sequence[Envelope], outcomes: Mapping[int, IdempotentOutcome] | None = None
    ) -> list[EnqueueReceipt]:
        """History and the ``enqueued`` hooks for envelopes the transport has accepted (a store that
        writes them itself, as a schedule's tick on SQL does, calls this after its commit)."""
        found = outcomes or {}
        receipts = []
        for i, e in enumerate(ready):
            o = found.get(i)
            receipts.append(
                EnqueueReceipt(
                    o.message_id if o else e.message_id,
                    o.tracking_id if o else e.tracking_id,
                    e.type,
                    e.queue,
                    self._status(e),
                    e.not_before,
                    e.expires_at,
                    o.outcome if o else "enqueued",
                    o.supersedes if o else None,
                )
            )
        if self.history is not None and not self.provider.capabilities.durable_history:
            now = self.clock()
            # a discarded, replaced or duplicate envelope wrote no new message: its receipt names the
            # waiting (or stored) one
            records: list[MessageRecord] = [
                record_from_envelope(e, r.status, now)
                for e, r in zip(ready, receipts, strict=True)
                if r.outcome == "enqueued"
            ]
            # The send stands once the transport has it: a history store that fails now must not make
            # the caller send again (a duplicate). The record is kept and written when the store is back.
            await self.history.write(records)
        hooks = self.app.hooks
        if hooks.wants(Event.ENQUEUED):
            # what the transport now holds as a new message: not an idempotent enqueue discarded against
            # the waiting version, nor one that replaced that version's body (it was told when it went in),
            # nor a message id the transport held already
            for env, r in zip(ready, receipts, strict=True):
                if r.outcome == "enqueued":
                    await hooks.emit(Observation(Event.ENQUEUED, env, env.queue))
        return receipts

    async def enqueue(self, message: QueueMessage, **options: Unpack[EnqueueOptions]) -> EnqueueReceipt:
        """Enqueue one message."""
        return (await self.enqueue_many([message], **options))[0]

    async def enqueue_and_wait(
        self, message: QueueMessage, **options: Unpack[EnqueueOptions]
    ) -> EnqueueReceipt:
        """Return only once the transport has durably accepted the message."""
        return (await self.enqueue_many([message], wait=True, **options))[0]

    async def enqueue_many(
        self, messages: Iterable[QueueMessage], *, wait: bool = False, **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """Enqueue many in one batch on the wire / one statement in SQL; shared options apply to all."""
        now = self.clock()
        batch = list(messages)
        envs = [self.envelope_for(m, now=now, **options) for m in batch]
        return await self._send(envs, wait=wait, identities=identities_of(self.app, batch)) if envs else []
