"""Idempotent types on the transports that can neither find nor edit a queued message (Storage Queues,
Service Bus, RabbitMQ, SQS, in-process). The SQL provider does this in its messages table instead.

The control store keeps one document per (type, identity)::

    {"waiting": [message id, tracking id, body hash],   the newest version sent
     "superseded": {older id: newer id, ...},           versions replaced before they ran (bounded)
     "replaced": [older id, ...],                       every version replaced, finished or not (bounded)
     "succeeded": [message id, the one before],         the last versions that succeeded
     "started": message id}                             the newest version, once a host began it

An enqueue reads it. If the newest version has the same JSON and has not started (no host wrote its
start marker, its history says it waits, and no cancellation of it stands in the control store), is due
no later than the new one asks to run, and expires no sooner than the new one would, the enqueue
writes the unchanged document back by compare-and-set and, if that succeeds, sends nothing
(``discarded``): a host that begins the version writes the marker by compare-and-set too, so either
the discard or the start comes first, and a requested run is never lost. Otherwise the new version is
sent, and only then is the document pointed at it, naming the one it replaced as superseded: a crash
or a store failure between the two leaves both to run (a duplicate), never neither. A host that
receives a superseded message settles it ``Cancelled`` with the reason ``superseded by <id>`` without
running it; a version already running when it was replaced runs to its end. Two hosts enqueueing the
same identity at once both send; the compare-and-set on the document orders them, so one of the two is
superseded by the other (or, if it was received first, both run once). A send replayed under an id the
document names as an older version (a schedule's tick sending again after a crash, or one message
enqueued twice) sends nothing: it would supersede a newer request with an older one.
``ctx.previous`` is the body, from the history, of the last version that succeeded.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, runtime_checkable
from uuid import UUID

from .clock import Clock, as_utc, utcnow
from .control.base import ControlStore
from .control.identities import KeepsIdentities
from .messages import MessageStatus, QueueMessage, read_body
from .producer import IdempotentOutcome, identity_of, outlasts

if TYPE_CHECKING:
    from .app import QueueingApp, Subscription
    from .envelope import Envelope
    from .tracking import Tracker
    from .transport import Provider, Settlement

log = logging.getLogger("queueing.idempotent")

#: superseded versions remembered per identity; an older one pushed out runs if it is still queued
#: (a duplicate, never a loss). Many versions replaced faster than a host receives them are the case.
MAX_SUPERSEDED = 64
#: the document's key for the versions a newer one replaced, finished or not, oldest first (at most
#: MAX_REPLACED): a replay of one of their sends is the older request it is (``_older``). Apart from
#: ``superseded``, which holds only those left to settle, so that finished ones take none of its room
REPLACED = "replaced"
MAX_REPLACED = 64
#: compare-and-set rounds; each round one writer wins and the others read again
_CAS_TRIES = 20
_WAITING = frozenset(s.value for s in MessageStatus.runnable())
#: the waiting statuses whose next run is at a time of the message's own (its delay, its retry); a
#: message held for another reason (paused, an open circuit, no handler yet) is looked at again soon,
#: and an identical enqueue would be held the same way
_TIMED = frozenset(s.value for s in (MessageStatus.PENDING, MessageStatus.SLEEPING, MessageStatus.FAILED))
_FINAL = frozenset(s.value for s in MessageStatus.terminal())
T = TypeVar("T")


class _Standing(NamedTuple):
    """A waiting version an enqueue of the same JSON may be discarded against."""

    #: when it expires (None: never), its life as an earlier discard made it longer included
    expires: datetime | None
    #: when it expires by its own envelope
    own: datetime | None
    #: when a host runs it next, when that is a time of its own (its delay, its retry): None when it is
    #: due now or held for another reason
    due: datetime | None


class _Mark(Enum):
    MARK = "mark"


#: what a look at an identity's document answers when the message must be marked started first
MARK = _Mark.MARK


@runtime_checkable
class SendsCopies(Protocol):
    """A transport that drops a message whose id it has seen (Service Bus with duplicate detection, as
    the queues of idempotent types have it) and can send one under a transport id of its own."""

    async def send_copy(self, queue: str, env: Envelope, at: datetime | None) -> None: ...


def _names(doc: dict[str, Any], message_id: UUID) -> bool:
    """Whether the identity's document names ``message_id`` (it was sent before)."""
    mid = str(message_id)
    return (
        (doc.get("waiting") or [None])[0] == mid
        or mid in (doc.get(REPLACED) or [])
        or mid in (doc.get("superseded") or {})
        or mid in (doc.get("superseded") or {}).values()
        or doc.get("started") == mid
        or mid in (doc.get("succeeded") or [])
    )


def _marked(superseded: dict[str, str], older: str, newer: str) -> dict[str, str]:
    """``superseded`` with ``older`` marked superseded by ``newer`` as its newest entry, the oldest
    dropped beyond MAX_SUPERSEDED (insertion order is age)."""
    marks = {k: v for k, v in superseded.items() if k != older}
    marks[older] = newer
    return dict(list(marks.items())[-MAX_SUPERSEDED:])


def _older(doc: dict[str, Any], message_id: UUID) -> bool:
    """Whether the document shows ``message_id`` replaced by a version pointed at after it: among the
    replaced or the superseded, or marked started (only ever while it was the newest; a document of an
    earlier version of the kit has no list of the replaced) with another version the newest now. Not a
    version named only among those that succeeded, nor as the one a superseded version was replaced
    by: a run whose pointing never landed (a crash after its send, two sends pointed in the other
    order) may have succeeded while an older version stayed the newest."""
    mid = str(message_id)
    if (doc.get("waiting") or [None])[0] == mid:
        return False
    return (
        mid in (doc.get(REPLACED) or []) or mid in (doc.get("superseded") or {}) or doc.get("started") == mid
    )


#: the document's key for the waiting version's life made longer by an enqueue discarded against it:
#: [its message id, the discarded one's expiry (ISO 8601) or None for never]
LASTS = "lasts"


def _lasts(doc: dict[str, Any], message_id: UUID, expires_at: datetime | None) -> datetime | None:
    """When ``message_id`` expires: ``expires_at``, unless the document made its life longer."""
    lasts = doc.get(LASTS)
    if not lasts or lasts[0] != str(message_id):
        return expires_at
    return None if lasts[1] is None else datetime.fromisoformat(lasts[1])


def body_hash(body: dict[str, Any]) -> str:
    """The JSON body's digest: equal for equal JSON, whatever the key order."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def superseded_reason(by: UUID) -> str:
    return f"superseded by {by}"


class IdentityGuard:
    """Send, supersede, recognise and remember the versions of idempotent messages through a control
    store that keeps identity documents."""

    def __init__(
        self,
        app: QueueingApp,
        store: KeepsIdentities,
        tracker: Tracker,
        provider: Provider,
        clock: Clock = utcnow,
    ) -> None:
        self.app = app
        self.store = store
        self.tracker = tracker
        self.provider = provider
        self.clock = clock

    # -- enqueue ----------------------------------------------------------------------------------
    async def send_idempotent(
        self, envelopes: Sequence[Envelope], identities: Sequence[str]
    ) -> list[IdempotentOutcome]:
        out: list[IdempotentOutcome] = []
        # sent by this call: waiting, though their history is not written yet
        sent: dict[UUID, Envelope] = {}
        for env, key in zip(envelopes, identities, strict=True):
            outcome = await self._send_one(env, key, sent)
            if outcome.outcome == "enqueued":
                sent[env.message_id] = env
            out.append(outcome)
        return out

    async def _send_one(self, env: Envelope, key: str, sent: dict[UUID, Envelope]) -> IdempotentOutcome:
        digest = body_hash(env.body)
        found = await self.store.identity_doc(env.type, key)
        for _ in range(_CAS_TRIES):
            if found is None:
                break
            doc = found[0]
            waiting = doc.get("waiting")
            if not (waiting and waiting[2] == digest):
                break
            standing = await self._waits(doc, UUID(waiting[0]), sent)
            if standing is None:
                break
            expiry, own = standing.expires, standing.own
            if standing.due is not None and waiting[0] != str(env.message_id):
                asked = env.not_before or self.clock()
                if as_utc(standing.due) > as_utc(asked):
                    # it runs later than this one asks to (its delay, its retry): a queued message
                    # cannot be brought forward, so this one is sent, superseding it (the run asked
                    # for comes when asked; a duplicate at worst, never a late run). It stands for
                    # both requests, so it lives as long as the one it supersedes: sent with its own
                    # shorter life, it could expire unrun, and the superseded one was then settled
                    # unrun too (found in review)
                    if not outlasts(env.expires_at, expiry):
                        env = env.model_copy(update={"expires_at": expiry})
                    break
            grace: timedelta | None = getattr(self.provider, "drops_expired_after", None)
            if own is not None and grace is not None and not outlasts(own + grace, env.expires_at):
                # the transport drops the waiting message that long after its own expiry (a time to
                # live of its own): it cannot live as long as this one, which is sent, superseding it
                break
            if not outlasts(expiry, env.expires_at):
                # it would expire before this one: its life is made this one's (a host that finds it
                # expired looks here before it settles it so), so the run asked for now still comes
                until = None if env.expires_at is None else env.expires_at.isoformat()
                doc = {**doc, LASTS: [waiting[0], until]}
            # discard only if the document is still the one read: a host that began (or expired) the
            # waiting version meanwhile wrote its start marker (the token changed), and then this run
            # is needed
            if await self.store.put_identity_doc(env.type, key, doc, found[1]):
                return IdempotentOutcome("discarded", UUID(waiting[0]), UUID(waiting[1]))
            found = await self.store.identity_doc(env.type, key)
        if found is not None and _older(found[0], env.message_id):
            # sent before under this id, and a newer version has come since (a schedule's tick
            # replaying its send after a crash, one message enqueued twice): that send landed (the
            # document names a version only once it is queued), and sent again it would supersede the
            # newer version with an older request. Nothing is sent; the receipt names the version
            # that covers it, as a discard's does. (A version replaced more than MAX_REPLACED
            # versions ago is no longer named, and is sent again as a new one: docs/concepts/jobs.md)
            waiting = found[0].get("waiting") or [str(env.message_id), str(env.tracking_id)]
            return IdempotentOutcome("discarded", UUID(waiting[0]), UUID(waiting[1]))
        # the newest version is durably queued before any older one is marked superseded
        if found is not None and _names(found[0], env.message_id) and isinstance(self.provider, SendsCopies):
            # sent before under this id: still the newest version, begun by a host or with another
            # body (a tick's messages are made again), or one the document names only among the
            # succeeded. A transport that drops a message id it has seen (Service Bus's duplicate
            # detection) would drop what the sender asked to go again: a copy goes under a transport
            # id of its own; the envelope, and so the message id, are the same
            await self.provider.send_copy(env.queue, env, env.not_before)
        else:
            await self.provider.send([env], wait=True)
        replaced = await self._point_at(env, key, digest, found, sent)
        return IdempotentOutcome("enqueued", env.message_id, env.tracking_id, supersedes=replaced)

    async def _point_at(
        self,
        env: Envelope,
        key: str,
        digest: str,
        found: tuple[dict[str, Any], object] | None,
        sent: Mapping[UUID, Envelope],
    ) -> UUID | None:
        """Make ``env`` the identity's newest version and mark the one it replaces superseded. A failure
        here is logged, not raised: the message is sent, and raising would make the caller send again."""
        mid = str(env.message_id)
        try:
            for _ in range(_CAS_TRIES):
                doc, token = found if found is not None else ({}, None)
                old = doc.get("waiting")
                superseded: dict[str, str] = dict(doc.get("superseded") or {})
                replaced = None
                if found is not None and old and _older(doc, env.message_id):
                    # a replay of this id (sent while it was the newest) raced a newer version, pointed
                    # at meanwhile: that one stays the newest, and the copy just sent is marked
                    # superseded by it (it may have finished before: its history cannot tell)
                    if superseded.get(mid) == old[0]:
                        return None
                    new = {**doc, "superseded": _marked(superseded, mid, old[0])}
                else:
                    # the same id sent again while it is the newest version is not superseded by itself
                    # (its start marker stays: a copy may have begun already, and an identical enqueue
                    # discarded against it then would lose its run)
                    superseded.pop(mid, None)
                    earlier = [i for i in (doc.get(REPLACED) or []) if i != mid]
                    if old and old[0] != mid:
                        earlier = [*(i for i in earlier if i != old[0]), old[0]][-MAX_REPLACED:]
                        if await self._may_run(UUID(old[0]), sent):
                            replaced = UUID(old[0])
                            superseded = _marked(superseded, old[0], mid)
                    new = {
                        **doc,
                        "waiting": [mid, str(env.tracking_id), digest],
                        "superseded": superseded,
                        REPLACED: earlier,
                    }
                if await self.store.put_identity_doc(env.type, key, new, token):
                    return replaced
                found = await self.store.identity_doc(env.type, key)
            log.warning(
                "identity %r of %s kept changing: message %s was sent, an older version may run too",
                key,
                env.type,
                env.message_id,
            )
        except Exception as exc:
            log.warning(
                "message %s was sent, but the document of identity %r of %s could not be written (%s): "
                "the version it replaces, or this copy if a newer version came meanwhile, may run too",
                env.message_id,
                key,
                env.type,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
        return None

    async def _waits(
        self, doc: dict[str, Any], message_id: UUID, sent: Mapping[UUID, Envelope]
    ) -> _Standing | None:
        """The waiting version as it stands, if no host has begun this message: its start marker is not
        in the document, and it was sent by this call, or the history says it waits and no cancellation
        of it stands in the control store (a cancel writes its request before the history: one whose
        history write failed, or has not come yet, still has the message settled Cancelled unrun). None
        otherwise: an unreadable history or control store says no too (sending again is a duplicate at
        worst)."""
        if doc.get("started") == str(message_id):
            return None
        if message_id in sent:
            env = sent[message_id]
            return _Standing(_lasts(doc, message_id, env.expires_at), env.expires_at, env.not_before)
        try:
            rec = await self.tracker.get(message_id)
        except Exception as exc:
            log.warning("could not read the history of %s (%s): sending the new version", message_id, exc)
            return None
        if rec is None or rec.status not in _WAITING:
            return None
        if await self._cancelling(message_id):
            return None
        due = rec.not_before if rec.status in _TIMED else None
        return _Standing(_lasts(doc, message_id, rec.expires_at), rec.expires_at, due)

    async def _cancelling(self, message_id: UUID) -> bool:
        """Whether a cancellation of this message stands (as a host that receives it reads the control
        store: it is then settled Cancelled without running), or the store cannot say."""
        if not isinstance(self.store, ControlStore):
            return False  # a store that keeps identities only: it holds no requests
        try:
            return message_id in (await self.store.state()).cancelled
        except Exception as exc:
            log.warning(
                "could not read the cancellation requests (%s): %s is taken as cancelled, and the new "
                "version sent",
                exc,
                message_id,
            )
            return True

    async def _may_run(self, message_id: UUID, sent: Mapping[UUID, Envelope]) -> bool:
        """Worth marking superseded: not known to be finished."""
        if message_id in sent:
            return True
        try:
            rec = await self.tracker.get(message_id)
        except Exception:
            return True
        return rec is None or rec.status not in _FINAL

    # -- processing -------------------------------------------------------------------------------
    async def check_start(self, sub: Subscription, message: QueueMessage) -> UUID | None:
        """The newer version that superseded this message, if one did; otherwise, when it is its
        identity's newest version, mark it started in the document (compare-and-set), so an enqueue
        of the same JSON from now on is sent rather than discarded. A store that cannot be read or
        written runs the message (a duplicate run beats a lost one)."""
        mid = str(message.message_id)

        def look(doc: dict[str, Any] | None) -> UUID | _Mark | None:
            if doc is None:
                return None
            newest = (doc.get("waiting") or [None])[0] == mid
            by = (doc.get("superseded") or {}).get(mid)
            if by and not newest:  # a document naming the newest superseded too is damaged: run it
                return UUID(by)
            return MARK if newest and doc.get("started") != mid else None

        return await self._mark_started(sub, message, look, marked=None, unknown=None)

    async def expires(
        self, sub: Subscription, message: QueueMessage, expires_at: datetime, now: datetime
    ) -> bool:
        """Whether a message found past its expiry expires now: not if an enqueue discarded against it
        made its life longer (until after ``now``). Before it expires, the identity's newest version
        is marked started (compare-and-set), as a run would be: an enqueue that reads it from then on
        sends its own message, so an extension and an expiry are ordered and neither is lost. A store
        that cannot be read or written runs it: it may have been made to live longer (a duplicate run
        beats a lost one)."""
        mid = str(message.message_id)

        def look(doc: dict[str, Any] | None) -> bool | _Mark:
            if doc is None:
                return True
            until = _lasts(doc, message.message_id, expires_at)
            if until is None or as_utc(until) > now:
                return False
            return MARK if (doc.get("waiting") or [None])[0] == mid and doc.get("started") != mid else True

        return await self._mark_started(sub, message, look, marked=True, unknown=False)

    async def _mark_started(
        self,
        sub: Subscription,
        message: QueueMessage,
        look: Callable[[dict[str, Any] | None], T | _Mark],
        *,
        marked: T,
        unknown: T,
    ) -> T:
        """The identity's document read and judged by ``look``: its answer, or, where it says
        :data:`MARK`, the message marked started in the document by compare-and-set (read again while
        another writer wins) and then ``marked``. ``unknown`` when the store cannot be read or written,
        or the document kept changing: the message then runs."""
        type_name, key, mid = sub.type_name, identity_of(sub.options, message), str(message.message_id)
        try:
            for _ in range(_CAS_TRIES):
                found = await self.store.identity_doc(type_name, key)
                verdict = look(found[0] if found is not None else None)
                if verdict is not MARK:
                    return verdict
                assert found is not None
                doc, token = found
                if await self.store.put_identity_doc(type_name, key, {**doc, "started": mid}, token):
                    return marked
            log.warning("identity %r of %s kept changing: running %s", key, type_name, mid)
        except Exception as exc:
            log.warning("could not read or mark the identity of %s (%s): running it", mid, exc)
        return unknown

    async def reinstate(self, sub: Subscription, envelope: Envelope) -> None:
        """An operator retries a superseded version: it is no longer superseded, so it runs (before
        it is sent again, or a host could settle it superseded once more). A body that no longer reads
        as its model (the model was made stricter since, or it was dead-lettered for its body) or that
        its identity cannot key is left as it is: no key, so nothing can have superseded it under one;
        its copy is sent, and a worker reads it as this does and dead-letters it again with its reason
        (nothing lost, and the operator's retry not refused for what the worker explains)."""
        from .decisions import DeadLetter
        from .pipeline import read_message

        mid = str(envelope.message_id)
        message = read_message(sub, envelope)
        if isinstance(message, DeadLetter):
            # (without the reason: it quotes the body's values, which the log must not hold)
            log.warning(
                "%s of %s does not read as its model or has no identity: retried as it is", mid, sub.type_name
            )
            return
        key = identity_of(sub.options, message)
        for _ in range(_CAS_TRIES):
            found = await self.store.identity_doc(sub.type_name, key)
            if found is None or mid not in (found[0].get("superseded") or {}):
                return
            doc, token = found
            superseded = {k: v for k, v in doc["superseded"].items() if k != mid}
            if await self.store.put_identity_doc(
                sub.type_name, key, {**doc, "superseded": superseded}, token
            ):
                return
        raise RuntimeError(f"identity {key!r} of {sub.type_name} kept changing")

    async def previous(self, sub: Subscription, message: QueueMessage) -> QueueMessage | None:
        """The last version of this identity that succeeded (another message than this one), as the
        history keeps it; None when there is none or the history no longer has it."""
        found = await self.store.identity_doc(sub.type_name, identity_of(sub.options, message))
        ids = [i for i in (found[0].get("succeeded") or []) if i] if found else []
        last = next((UUID(i) for i in ids if i != str(message.message_id)), None)
        rec = await self.tracker.get(last) if last is not None else None
        if rec is None or rec.body is None:
            return None
        return read_body(sub.message_type, rec.body)

    async def note_settled(self, settlements: Sequence[Settlement]) -> None:
        """Remember each idempotent message that succeeded, for its identity's next ``ctx.previous``.
        Best effort: a failure is logged and ``ctx.previous`` shows the version before."""
        from .decisions import Complete
        from .pipeline import decode_message

        for s in settlements:
            d, env = s.delivery, s.delivery.envelope
            if env is None or d.refused or d.duplicate:
                continue
            if not isinstance(s.decision, Complete) or s.decision.cancelled:
                continue
            sub = self.app.subscription(env.type)
            if sub is None or not sub.options.idempotent:
                continue
            try:
                await self._succeeded(env.type, identity_of(sub.options, decode_message(sub, env)), env)
            except Exception as exc:
                log.warning("could not remember %s as its identity's last success: %s", env.message_id, exc)

    async def _succeeded(self, type_name: str, key: str, env: Envelope) -> None:
        mid = str(env.message_id)
        for _ in range(_CAS_TRIES):
            found = await self.store.identity_doc(type_name, key)
            doc, token = found if found is not None else ({}, None)
            last = [i for i in (doc.get("succeeded") or []) if i]
            if last and last[0] == mid:
                return
            superseded = {k: v for k, v in (doc.get("superseded") or {}).items() if k != mid}
            new = {**doc, "succeeded": [mid, *last[:1]], "superseded": superseded}
            if await self.store.put_identity_doc(type_name, key, new, token):
                return
        raise RuntimeError(f"identity {key!r} of {type_name} kept changing")
