"""The operations service: one contract for every provider.

Reads go through the runtime's tracker (the SQL table itself, or a durable tracker for the cloud
transports), pause and circuit actions through its control store, and the few state-changing
actions through the provider's :class:`OpsActions`. Which states an action accepts is decided here,
once; the provider's statement re-checks the state atomically, so a race loses cleanly (409).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, runtime_checkable
from uuid import UUID

from pydantic import ValidationError

from .. import jobs
from ..app import Subscription
from ..clock import Clock, as_utc, utcnow
from ..envelope import Envelope
from ..errors import InvalidArgument, InvalidOperation, MessageNotFound, NotSupported, first_line
from ..messages import MessageStatus, QueueMessage, read_body
from ..options import Health
from ..producer import EnqueueOptions
from ..providers.dead_letters import is_whole_queue, whole_queue
from ..runtime import Runtime
from ..storable import HEADERS_CUT_SHORT, is_cut_short
from ..tracking import MessageQuery, MessageRecord, Removed, Reopen, nothing_to_reopen, record_change
from ..tracking.base import (
    ChangesIfUnchanged,
    Listed,
    before_reopening,
    is_cancel_request,
    reopened,
    reopening,
)
from .models import (
    ActionResult,
    CircuitInfo,
    EnqueuedMessage,
    HealthReport,
    MessageContent,
    MessageDetail,
    MessagePage,
    MessageStats,
    MessageSummary,
    PauseResult,
    PurgeResult,
    QueueSummary,
    ScheduleInfo,
    StatusUpdate,
    StatusUpdateResult,
    SubscriptionInfo,
    Summary,
)

log = logging.getLogger(__name__)


def _same(current: MessageRecord | None, seen: MessageRecord) -> bool:
    """The stored record is still the one read (no write since)."""
    return current is not None and (current.status, current.attempt, current.updated_at) == (
        seen.status,
        seen.attempt,
        seen.updated_at,
    )


class _ChangedMeanwhile(InvalidOperation):
    """The record a retry read changed before the retry wrote its own (another retry, a late record):
    the retry wrote nothing and sent nothing."""


S = MessageStatus
#: what retry accepts: finished badly, waiting for a retry or a time, or held by an operator's status
RETRYABLE = {S.DEAD_LETTERED, S.FAILED, S.EXPIRED, S.ABANDONED, S.CANCELLED, S.SLEEPING}
#: kit statuses an operator may set by a body match (the others carry meaning only the kit gives)
SETTABLE = frozenset({S.PENDING.value, S.CANCELLED.value})
ARCHIVABLE = {S.SUCCEEDED, S.DEAD_LETTERED, S.EXPIRED, S.CANCELLED, S.ABANDONED}
#: a record as a purge holds it: only its ids, queue and status are read (and whether it is a cancel
#: request, by its description: see ``light``)
LIGHT: dict[str, Any] = {
    "body": None,
    "raw": None,
    "result": None,
    "progress": None,
    "headers": {},
    "description": None,
}


def light(r: MessageRecord) -> MessageRecord:
    """``r`` as a purge holds it (:data:`LIGHT`). A cancel request keeps its description, which says
    so: its message still waits on its transport (without it, a purge took the message for finished,
    and deleted its history, and counted it out of what a worker may hold)."""
    return r.model_copy(update=LIGHT if not is_cancel_request(r) else {**LIGHT, "description": r.description})


WAITING = (S.PENDING.value, S.FAILED.value, S.SLEEPING.value, S.WAITING_FOR_HANDLER.value, S.PAUSED.value)
KNOWN = frozenset(s.value for s in MessageStatus)
_ORDER = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.UNHEALTHY: 2}


class BodyInvalid(InvalidArgument):
    """Bodies enqueued over HTTP that do not validate; ``errors`` lists pydantic's errors per item."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("body", "the message body does not match the queue's message model")
        self.errors = errors


class UnknownQueue(MessageNotFound):
    pass


@runtime_checkable
class UpdatesStatusWhere(Protocol):
    """A provider that can select its messages by a body property (the SQL provider)."""

    async def ops_update_status_where(
        self,
        queue: str,
        steps: Sequence[str | int],
        op: str,
        value: str | int | float | bool | None,
        new_status: str,
        only: Sequence[str] | None,
        now: datetime,
    ) -> int: ...


@runtime_checkable
class OpsActions(Protocol):
    """State changes a provider carries out for the ops service. Each returns False when the message
    was no longer in the state the service checked (someone else acted first)."""

    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        """Run the message again from ``envelope``; send the copy inside ``reopen`` (entered after the
        last refusal, it records Pending in a separate history before the message can run, and puts it
        back if the send fails; see :data:`~queueing_core.tracking.Reopen`). The copy is sent before
        the original is removed: a failure part-way leaves two copies (or the original), never none."""
        ...

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool: ...

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool: ...

    async def ops_held(self, record: MessageRecord) -> str | None:
        """The state the transport holds ``record``'s message in where only an operator's retry moves
        it on (an interrupted retry left it dead-lettered though its history moved on), else None."""
        ...


@runtime_checkable
class PurgesWithHistory(Protocol):
    """A purge where the transport and its history are one (the SQL provider)."""

    async def ops_purge(self, query: MessageQuery) -> tuple[int, int]:
        """Delete what matches; returns how many were deleted and how many were skipped because a
        worker holds them."""
        ...


@runtime_checkable
class RemovesMessages(Protocol):
    """A purge on a transport with a separate history."""

    async def ops_remove(self, query: MessageQuery, records: Sequence[MessageRecord]) -> set[UUID]:
        """Take the messages of ``records`` (the history's matches) off the transport as far as it
        can; returns the ids the transport no longer holds (removed now, or dead letters it does not
        hold at all): only their history is deleted."""
        ...


def summary_of(r: MessageRecord) -> MessageSummary:
    """What the views show of ``r``; a damaged record's stand-ins show as null."""
    return MessageSummary(
        message_id=r.message_id if r.readable("message_id") else None,
        tracking_id=r.tracking_id if r.readable("tracking_id") else None,
        type=r.type,
        queue=r.queue,
        status=r.status,
        attempt=r.attempt,
        correlation_id=r.correlation_id,
        created_at=r.created_at if r.readable("created_at") else None,
        updated_at=r.updated_at if r.readable("updated_at") else None,
        not_before=r.not_before,
        archived=r.archived,
        reason=r.reason,
        malformed=r.malformed,
        stored=r.stored,
    )


class OpsService:
    def __init__(self, runtime: Runtime, *, clock: Clock = utcnow) -> None:
        self.runtime = runtime
        self.app = runtime.app
        self.clock = clock
        provider = runtime.provider
        if not isinstance(provider, OpsActions):
            raise TypeError(f"{type(provider).__name__} does not implement the ops actions")
        self.actions: OpsActions = provider

    # -- lookups -------------------------------------------------------------------------------------
    def queue(self, name: str) -> Subscription:
        sub = self.app.by_queue().get(name)
        if sub is None:
            raise UnknownQueue(f"no queue named {name!r} in app {self.app.name!r}")
        return sub

    def message_type(self, name: str) -> Subscription:
        sub = self.app.subscription(name)
        if sub is None:
            raise MessageNotFound(f"no message type named {name!r} in app {self.app.name!r}")
        return sub

    async def record(self, message_id: UUID) -> MessageRecord:
        rec = await self.runtime.tracker.get(message_id)
        if rec is None:
            raise MessageNotFound(f"no message {message_id}")
        return rec

    # -- reading -------------------------------------------------------------------------------------
    def health_of(self, sub: Subscription, counts: dict[str, int], circuit: CircuitInfo | None) -> Health:
        errors = counts.get(S.DEAD_LETTERED, 0) + counts.get(S.ABANDONED, 0)
        health = sub.options.health_when_errors if errors else Health.HEALTHY
        if circuit is not None and circuit.state != "closed" and _ORDER[health] < _ORDER[Health.DEGRADED]:
            health = Health.DEGRADED
        return health

    async def summary(self) -> Summary:
        counts = await self.runtime.tracker.counts()
        state = await self.runtime.control.state()
        native = getattr(self.runtime.provider, "native_counts", None)
        transport: dict[str, dict[str, int]] = await native() if native is not None else {}
        by_queue: dict[str, dict[str, int]] = defaultdict(dict)
        for (queue, status), n in counts.items():
            by_queue[queue][status] = n
        queues: list[QueueSummary] = []
        totals: dict[str, int] = defaultdict(int)
        for sub in self.app.subscriptions():
            c = by_queue.pop(sub.queue, {})
            for status, n in c.items():
                totals[status] += n
            circuit = None
            if sub.options.circuit_breaker is not None:
                cs = state.circuit(sub.type_name)
                circuit = CircuitInfo(
                    state=cs.state, consecutive_failures=cs.consecutive_failures, open_until=cs.open_until
                )
            queues.append(
                QueueSummary(
                    queue=sub.queue,
                    type=sub.type_name,
                    category=sub.options.category,
                    has_handler=sub.handler is not None,
                    paused=sub.queue in state.paused_queues,
                    type_paused=sub.type_name in state.paused_types,
                    circuit=circuit,
                    counts=c,
                    total=sum(c.values()),
                    health=self.health_of(sub, c, circuit),
                    transport_counts=transport.get(sub.queue),
                )
            )
        return Summary(
            provider=self.runtime.provider.transport.value,
            generated_at=self.clock(),
            queues=queues,
            totals=dict(totals),
            other_queues=dict(by_queue),
            notes=[n for n in (getattr(self.runtime.provider, "counts_note", None),) if n],
        )

    def subscriptions(self) -> list[SubscriptionInfo]:
        out = []
        for sub in self.app.subscriptions():
            o = sub.options
            example = _example_body(sub.message_type)
            out.append(
                SubscriptionInfo(
                    type=sub.type_name,
                    queue=sub.queue,
                    physical_queue=sub.physical_queue(self.app.naming, self.runtime.provider.transport),
                    category=o.category,
                    handler=sub.handler.origin.split(" (")[0] if sub.handler else None,
                    max_attempts=o.max_attempts,
                    max_concurrency=o.max_concurrency,
                    lease_seconds=o.lease_duration.total_seconds(),
                    time_limit_seconds=o.time_limit.total_seconds() if o.time_limit else None,
                    expiration_seconds=o.expiration.total_seconds() if o.expiration else None,
                    ordered=o.ordered,
                    default_status=o.default_status,
                    circuit_breaker=o.circuit_breaker.model_dump(mode="json") if o.circuit_breaker else None,
                    example=example,
                    json_schema=_body_schema(sub),
                )
            )
        return out

    # -- filters -------------------------------------------------------------------------------------
    @property
    def custom_statuses(self) -> bool:
        """Custom statuses live in the SQL provider's own rows: an operator sets them there, and a
        queue's ``default_status`` holds new messages in one. Other providers' history holds only what
        the kit writes."""
        return self._durable

    def known_statuses(self) -> frozenset[str]:
        """The kit's statuses, ``Archived`` (a filter on the flag) and every queue's default status."""
        return KNOWN | {sub.options.default_status for sub in self.app.subscriptions()}

    async def check_filters(self, query: MessageQuery, *, purging: bool = False) -> None:
        """Refuse a status nothing can have (422). A listing on SQL takes any custom status; a purge
        takes one only if some message has it, so a misspelt status is an error, not "deleted 0".
        A purge names a queue of the app (404 otherwise): off SQL it empties the broker's queue of that
        name, which may belong to another application or be created by asking for it. On SQL a queue
        the app no longer has is taken while some message still names it (its rows are only rows).
        A purge's type, likewise, is one of the app's or one some message has (404 otherwise): a
        misspelt type is an error, not "deleted 0", as a misspelt queue is."""
        if purging and query.queue is not None and query.queue not in self.app.by_queue():
            named = (
                isinstance(self.actions, PurgesWithHistory)
                and (await self.runtime.tracker.query(MessageQuery(queue=query.queue), limit=1)).items
            )
            if not named:
                self.queue(query.queue)
        if purging and query.type is not None and self.app.subscription(query.type) is None:
            # (a type the app no longer has is purged message by message, as its records name it)
            named = (await self.runtime.tracker.query(MessageQuery(type=query.type), limit=1)).items
            if not named:
                self.message_type(query.type)
        known = self.known_statuses()
        for status in query.status or ():
            if status in known:
                continue
            if self.custom_statuses and not purging:
                continue
            if self.custom_statuses:
                found = await self.runtime.tracker.query(MessageQuery(status=(status,)), limit=1)
                if found.items:
                    continue
                why = "no message has it, and it is not one of"
            else:
                why = f"{self.runtime.provider.transport.value} keeps only these statuses:"
            raise InvalidArgument("status", f"{status!r}: {why} {', '.join(sorted(known))}")

    async def list_messages(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> MessagePage:
        await self.check_filters(query)
        page = await self.runtime.tracker.query(query, limit=limit, cursor=cursor)
        return MessagePage(items=[summary_of(r) for r in page.items], next_cursor=page.next_cursor)

    async def message(self, message_id: UUID) -> MessageDetail:
        return self.detail_of(await self.record(message_id))

    @staticmethod
    def detail_of(r: MessageRecord) -> MessageDetail:
        return MessageDetail(
            **summary_of(r).model_dump(),
            expires_at=r.expires_at,
            locked_by=r.locked_by,
            locked_until=r.locked_until,
            last_error=r.last_error,
            description=r.description,
            archived_at=r.archived_at,
            headers=r.headers,
            result=r.result,
            progress=r.progress,
            duplicates=r.duplicates or 0,
        )

    async def content(self, message_id: UUID) -> MessageContent:
        r = await self.record(message_id)
        return MessageContent(message_id=r.message_id, type=r.type, body=r.body, raw=r.raw, headers=r.headers)

    async def message_stats(self, queue: str | None = None) -> MessageStats:
        by_queue: dict[str, dict[str, int]] = defaultdict(dict)
        by_status: dict[str, int] = defaultdict(int)
        for (q, status), n in (await self.runtime.tracker.counts()).items():
            if queue is not None and q != queue:
                continue
            by_queue[q][status] = n
            by_status[status] += n
        return MessageStats(total=sum(by_status.values()), by_status=dict(by_status), by_queue=dict(by_queue))

    async def waiting(self, take: int = 50, queue: str | None = None) -> list[MessageSummary]:
        page = await self.runtime.tracker.query(
            MessageQuery(status=WAITING, archived=False, queue=queue), limit=take
        )
        return [summary_of(r) for r in page.items]

    async def health(self) -> HealthReport:
        summary = await self.summary()
        queues = {q.queue: q.health for q in summary.queues}
        reasons = {q.queue: _reason(q) for q in summary.queues if q.health is not Health.HEALTHY}
        worst = max(queues.values(), key=lambda h: _ORDER[h], default=Health.HEALTHY)
        # history the store has not taken yet: the messages are fine, what the API shows is behind
        backlog = self.runtime.history.backlog
        if backlog and _ORDER[worst] < _ORDER[Health.DEGRADED]:
            worst = Health.DEGRADED
        return HealthReport(status=worst, queues=queues, reasons=reasons, history_backlog=backlog)

    # -- acting --------------------------------------------------------------------------------------
    @property
    def _durable(self) -> bool:
        return self.runtime.provider.capabilities.durable_history

    async def _track(self, r: MessageRecord, **changes: Any) -> None:
        """Record an action in the history of providers whose tracker is separate (the SQL provider's
        statement already did)."""
        if not self._durable:
            await record_change(self.runtime.tracker, r, {**changes, "updated_at": self.clock()})

    async def _withdraw_again(self, pending: MessageRecord) -> None:
        """Once this retry's record is written: a cancel request found now is withdrawn too (one that
        a retry beside this one put back with the record this one has just replaced, which it read
        before this retry looked), unless the history shows a cancel made since this retry's record
        (the operator cancelled the retry: it then sends nothing)."""
        control = self.runtime.control
        control.invalidate()
        if pending.message_id not in (await control.state()).cancelled:
            return
        await control.set_cancel(pending.message_id, False, pending.updated_at)
        if not await self._unchanged(pending):
            await control.set_cancel(pending.message_id, True, pending.updated_at)
            raise _ChangedMeanwhile(f"message {pending.message_id} changed while retrying it; look again")

    async def _put_request_back(self, seen: MessageRecord, restored: bool, now: datetime) -> None:
        """A retry that did not go ahead puts back the cancel request it withdrew: where the history
        shows the message as the retry found it (or was put back so), or a cancel made meanwhile; not
        where a retry beside it went ahead, whose copy must run. Never in place of the retry's own
        error: a store that fails here is logged."""
        control = self.runtime.control
        try:
            current = await self.runtime.tracker.get(seen.message_id)
            if not (restored or _same(current, seen) or (current is not None and is_cancel_request(current))):
                return
            await control.set_cancel(seen.message_id, True, now)
            current = await self.runtime.tracker.get(seen.message_id)
            if current is not None and not _same(current, seen) and not is_cancel_request(current):
                # another retry went ahead meanwhile (it read the record put back): its copy runs
                await control.set_cancel(seen.message_id, False, now)
        except Exception as exc:
            log.warning(
                "could not put back the cancel request of %s after its retry failed: %s; cancel it again "
                "if it must not run",
                seen.message_id,
                first_line(exc),
            )

    async def _reopen(self, seen: MessageRecord, pending: MessageRecord) -> None:
        """The retry's record (``pending``) in place of the one it read (``seen``), unless that changed
        meanwhile: of two retries of one message that read the same record, one goes ahead, the other
        is refused before it sends a copy (its put-back could otherwise write the record it read over
        the copy the first one sent)."""
        tracker = self.runtime.tracker
        if not isinstance(tracker, ChangesIfUnchanged):
            await tracker.reopen(pending)
            return
        if not await tracker.change_if_unchanged(seen, reopening(pending.updated_at, pending.expires_at)):
            raise _ChangedMeanwhile(f"message {seen.message_id} changed while retrying it; look again")

    async def _put_back(self, pending: MessageRecord, seen: MessageRecord) -> bool:
        """A retry's copy was not sent (the transport refused it, or was unreachable), and the original
        stays where it was (handed back, held by a reader that died, or never in the transport): so
        does its history (as ``seen``, read before the retry), not waiting as a copy that does not
        exist; a dead-letter list then still lists it, and a new retry can run it. Only while the
        history still shows this retry's record (``pending``): another retry that went ahead since
        wrote its own (it read this one's, by compare-and-set as this one did), and a copy of this
        one's that did reach its queue (the send's answer was lost) and ran wrote its run's, which
        stand; one that has not run yet is recorded by its run, whose records are newer than the one
        put back. True when it was put back."""
        tracker = self.runtime.tracker
        if not isinstance(tracker, ChangesIfUnchanged):  # (every tracker of a transport that copies)
            return False
        try:
            if await tracker.change_if_unchanged(pending, before_reopening(seen)):
                return True
            log.info("the history of %s is not its retry's record: left as it is", seen.message_id)
        except Exception as exc:
            log.warning(
                "could not put the history of %s back to %s after its retry failed: %s; it may show it "
                "Pending though no copy was sent: a new retry goes ahead while its dead letter is held, "
                "else enqueue its work again",
                seen.message_id,
                seen.status,
                first_line(exc),
            )
        return False

    async def _unchanged(self, seen: MessageRecord) -> bool:
        return _same(await self.runtime.tracker.get(seen.message_id), seen)

    def _refuse(self, r: MessageRecord, action: str, why: str) -> InvalidOperation:
        return InvalidOperation(f"cannot {action} message {r.message_id}: it is {r.status}{why}")

    async def retry(self, message_id: UUID) -> ActionResult:
        r = await self.record(message_id)
        seen = r
        if r.archived:
            raise InvalidOperation(f"cannot retry message {r.message_id}: it is archived")
        if r.status not in RETRYABLE and not self._durable:
            # an earlier retry stopped part-way (before or after its copy left): the transport still
            # holds the original where only a retry moves it on, so this retry goes ahead (at worst
            # the message runs twice; left alone it would never leave the dead-letter queue)
            held = await self.actions.ops_held(r)
            if held is not None:
                r = r.model_copy(update={"status": held})
        if r.status in KNOWN and r.status not in RETRYABLE:
            why = {
                S.SUCCEEDED: "; it already succeeded (enqueue a new message to run the work again)",
                S.LEASED: f"; a worker ({r.locked_by}) is processing it",
            }.get(MessageStatus(r.status), "; it is already waiting to be processed")
            raise self._refuse(r, "retry", why)
        if r.malformed is not None:
            raise InvalidOperation(
                f"cannot retry message {r.message_id}: its stored row is damaged ({r.malformed}); "
                "archive or purge it, and enqueue its work again if it is still wanted"
            )
        if r.body is None:
            raise InvalidOperation(
                f"cannot retry message {r.message_id}: its body could not be decoded; purge it"
            )
        kept_in_part = [
            what
            for what, cut in (("body", is_cut_short(r.body)), ("headers", HEADERS_CUT_SHORT in r.headers))
            if cut
        ]
        if kept_in_part and not self._durable:
            # a retry sends the message again from its history, and removes a dead letter after: the
            # marker in place of the body would replace the only whole copy, and the message be lost
            raise InvalidOperation(
                f"cannot retry message {r.message_id}: its history keeps its {' and '.join(kept_in_part)} "
                "only in part (too large for a history record), and a retry sends the message again "
                "from its history; the transport (its queue or dead-letter queue) still holds it whole: "
                "resubmit it from there"
            )
        # strictly later than the record it read: the put-back tells this retry's record from one
        # written after it at the same instant (another retry's that read this one's, a coarse clock)
        now = max(self.clock(), as_utc(seen.updated_at) + timedelta(microseconds=1))
        sub = self.app.subscription(r.type)
        expiration = sub.options.expiration if sub is not None else None
        envelope = Envelope(
            type=r.type,
            queue=r.queue,
            message_id=r.message_id,
            tracking_id=r.tracking_id,
            correlation_id=r.correlation_id,
            attempt=0,
            created_at=r.created_at,
            not_before=None,
            expires_at=now + expiration if expiration is not None else None,
            headers=r.headers,
            body=r.body,
        )
        pending = reopened(r, now, envelope.expires_at)
        restored = False

        @contextlib.asynccontextmanager
        async def reopen() -> AsyncIterator[None]:
            nonlocal restored
            try:
                await self._reopen(seen, pending)  # (its answer lost too: the put-back sees it)
                await self._withdraw_again(pending)
                yield  # (the copy's send)
            except _ChangedMeanwhile:
                raise  # (nothing of this retry's stands: nothing to put back)
            except (Exception, asyncio.CancelledError):  # (a send cancelled part-way too)
                restored = await self._put_back(pending, seen)
                raise

        # an earlier cancel request would cancel the new run: withdrawn whatever the message ended as
        # (a request that missed its run, which then dead-lettered, is kept for a day otherwise), and
        # before the copy, which may run at once; put back when the retry does not go ahead
        control = self.runtime.control
        control.invalidate()
        requested = r.message_id in (await control.state()).cancelled
        if requested:
            await control.set_cancel(r.message_id, False, now)
        try:
            identities = self.runtime.identities
            if identities is not None and sub is not None and sub.options.idempotent:
                # whatever it ended as (a superseded version that failed its last attempt while running
                # included): the operator wants it run, so it must not be settled superseded
                await identities.reinstate(sub, envelope)
            retried = await self.actions.ops_retry(
                r, envelope, now, nothing_to_reopen if self._durable else reopen
            )
            if not retried:
                raise InvalidOperation(f"message {r.message_id} changed while retrying it; look again")
        except BaseException:
            # put back only while the message's history shows it as this retry found it (or was put
            # back so, its copy not sent): a retry beside this one that won the change (or this one's
            # own copy, left part-way) withdrew the request for the run it started, which putting it
            # back would cancel before it ran. (A copy whose send's answer was lost after it landed
            # is cancelled by it too: the message stays where it was, as the history says.)
            if requested:
                await self._put_request_back(seen, restored, now)
            raise
        return ActionResult(
            message_id=r.message_id,
            status=S.PENDING,
            detail=f"retry scheduled with fresh attempts (was {r.status})",
        )

    async def cancel(self, tracking_id: UUID) -> ActionResult:
        """Cancel by message id (or tracking id): the message with that id, else the newest with that
        tracking id; see :func:`queueing_core.jobs.cancel`."""
        done = await jobs.cancel(self.runtime, tracking_id, newest=False)
        return ActionResult(message_id=done.message_id, status=done.status, detail=done.detail)

    async def update_status_where(self, queue: str, change: StatusUpdate) -> StatusUpdateResult:
        """Set a status on the queue's messages whose body matches ``change.where`` (none that a
        worker holds, none archived). Custom statuses hold messages out of processing; Pending puts
        them back; Cancelled ends them."""
        sub = self.queue(queue)
        provider = self.runtime.provider
        if not isinstance(provider, UpdatesStatusWhere):
            raise NotSupported(
                f"{provider.transport.value} cannot select messages by their body: updating the status "
                "where a body property matches needs the SQL provider"
            )
        if change.set in KNOWN and change.set not in SETTABLE:
            raise InvalidOperation(
                f"cannot set {change.set!r}: it is a status the kit sets itself; set a custom status, "
                + " or ".join(sorted(SETTABLE))
            )
        if change.status:
            await self.check_filters(MessageQuery(status=tuple(change.status)))
        w = change.where
        n = await provider.ops_update_status_where(
            sub.queue, w.steps(), w.op, w.value, change.set, change.status, self.clock()
        )
        return StatusUpdateResult(queue=sub.queue, status=change.set, updated=n)

    async def release_lease(self, message_id: UUID) -> ActionResult:
        r = await self.record(message_id)
        if r.status != S.LEASED:
            raise self._refuse(r, "release the lease of", ", not Leased")
        if not await self.actions.ops_release(r, self.clock()):
            raise InvalidOperation(f"message {r.message_id} was settled while releasing it; look again")
        await self._track(r, status=S.PENDING.value, locked_by=None, locked_until=None)
        return ActionResult(
            message_id=r.message_id,
            status=S.PENDING,
            detail=f"lease of {r.locked_by} released; the worker may still be running it",
        )

    async def archive(self, message_id: UUID) -> ActionResult:
        r = await self.record(message_id)
        if r.archived:
            raise InvalidOperation(f"message {r.message_id} is already archived")
        if r.status not in ARCHIVABLE:
            why = (
                f"; a worker ({r.locked_by}) is processing it"
                if r.status == S.LEASED
                else "; only finished messages can be archived"
            )
            raise self._refuse(r, "archive", why)
        now = self.clock()
        if not await self.actions.ops_archive(r, now):
            raise InvalidOperation(f"message {r.message_id} changed while archiving it; look again")
        await self._track(r, archived=True, archived_at=now)
        return ActionResult(message_id=r.message_id, status=r.status, detail="archived")

    async def purge(self, query: MessageQuery, *, whole: bool = False) -> PurgeResult:
        """Delete what matches ``query``, message by message: never what a worker holds, and off SQL
        not what waits in a live queue (no transport takes one out by id). ``whole`` (the operator
        asked for exactly that; ``query`` names the queue alone, else :class:`InvalidArgument`): the
        transport empties the queue itself, its dead letters and delayed messages too, those with no
        history included, and, where its purge takes them (``purge_takes_held``), those a worker
        holds, whose run's outcome is then refused. (On SQL, where every message is a row taken by
        its id and held ones stay, it deletes the same as without.)"""
        if whole:
            query = whole_queue(query)
        await self.check_filters(query, purging=True)
        actions = self.actions
        if isinstance(actions, PurgesWithHistory):
            deleted, skipped = await actions.ops_purge(query)
            return PurgeResult(deleted=deleted, skipped_leased=skipped)
        assert isinstance(actions, RemovesMessages)
        records: list[MessageRecord] = []
        leased = 0
        # the messages workers hold are left to them, except where clearing a queue removes them too
        takes_held = is_whole_queue(query) and self.runtime.provider.capabilities.purge_takes_held
        cursor: str | None = None
        while True:  # the tracker's matches, so the provider can drop their queued copies
            page = await self.runtime.tracker.query(query, limit=500, cursor=cursor)
            # held while the transport is read through, perhaps a million of them: without what the
            # removal never reads (bodies, raw text, results can be 64 KB each)
            kept = [r for r in page.items if takes_held or r.status != S.LEASED]
            records += [light(r) for r in kept]
            leased += len(page.items) - len(kept)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        # a row damaged outside the kit whose message id does not read names nothing the transport
        # could be asked for: it is not passed on, and its history goes by its stored id text (a
        # message the transport still holds writes its history again when it runs)
        removed = await actions.ops_remove(query, [r for r in records if r.readable("message_id")])
        # the history is a record: only messages the transport no longer holds leave it, by their ids.
        # Never by the filter alone: a message that matched it after the listing was read (a dead
        # letter written meanwhile) would lose its history while the transport still holds it, and a
        # dead letter that no listing shows can never be retried
        # a message that finished (succeeded, or cancelled by the host that received it) is nowhere on
        # the transport: its history is all there is of it, and goes (a purge of them deleted nothing)
        gone = [
            r
            for r in records
            if r.readable("message_id")
            and (
                r.message_id in removed
                or r.status == S.SUCCEEDED
                or (r.status == S.CANCELLED and not is_cancel_request(r))
            )
        ]
        damaged: list[UUID | str] = [
            r.stored["message_id"]
            for r in records
            if not r.readable("message_id") and r.stored and "message_id" in r.stored
        ]
        deleted = await self._delete_as_listed(query, gone, damaged)
        forgotten = removed.forgotten if isinstance(removed, Removed) else 0
        # (those a worker had already received, which the transport's purge of the whole queue left)
        held = min(removed.held, deleted) if isinstance(removed, Removed) else 0
        # (the messages a worker holds and the purge left, as on SQL, and those the transport may still
        # hold and could not remove: waiting in a live queue, a dead letter another reader held, one
        # retried while the purge ran; said so, not hidden in a 0. A delayed one whose history went
        # with its row is not left)
        left = len(records) - deleted - forgotten + held
        return PurgeResult(
            deleted=deleted + forgotten - held, skipped_leased=leased, left_waiting=max(0, left)
        )

    async def _delete_as_listed(
        self, query: MessageQuery, gone: list[MessageRecord], damaged: list[UUID | str]
    ) -> int:
        """Delete the history of ``gone`` only while each record is still as the purge listed it (its
        status and time): one an operator retried while the purge ran is Pending, its copy on its way
        (the letter the purge looked for had left), and keeps its history; deleted, the copy ran with
        none, and could not be cancelled meanwhile (found in review). Each as listed, not by the set of
        listed statuses (a purge that also listed Pending messages took the retried one too), nor by
        its status alone (the retried copy dead-lettered again before the delete said DeadLettered
        once more, and its new letter was left with no history: later reviews). One statement, as
        before. A damaged row (its id, status or time does not read) goes by its stored id, as listed,
        however it reads now."""
        listed: dict[UUID | str, Listed | None] = {
            r.message_id: (r.status, r.updated_at)
            if r.readable("status") and r.readable("updated_at")
            else None
            for r in gone
        }
        listed.update(dict.fromkeys(damaged))
        if not listed:
            return 0
        return await self.runtime.tracker.delete(query, only=listed)

    async def set_paused(self, kind: str, name: str, paused: bool) -> PauseResult:
        if kind == "queue":
            self.queue(name)
        else:
            self.message_type(name)
        await self.runtime.control.set_paused("queue" if kind == "queue" else "type", name, paused)
        return PauseResult(kind="queue" if kind == "queue" else "type", name=name, paused=paused)

    async def prometheus(self) -> str:
        """The counts of :meth:`summary` and this process's handled messages and lag, in the
        Prometheus text format."""
        from .prometheus import render

        return render(await self.summary(), self.runtime.throughput)

    async def schedules(self) -> list[ScheduleInfo]:
        from ..scheduler import describe, tick_store_for

        schedules = list(self.app.schedules)
        if not schedules:
            return []
        last = await tick_store_for(self.runtime).last_ticks([s.name for s in schedules])
        paused = (await self.runtime.control.state()).paused_schedules
        now = self.clock()
        return [ScheduleInfo(**describe(s, last.get(s.name), s.name in paused, now)) for s in schedules]

    async def set_schedule_paused(self, name: str, paused: bool) -> PauseResult:
        """A paused schedule's ticks pass without a message (and are not replayed on resume)."""
        if self.app.schedules.get(name) is None:
            raise MessageNotFound(f"no schedule named {name!r} in app {self.app.name!r}")
        await self.runtime.control.set_paused("schedule", name, paused)
        return PauseResult(kind="schedule", name=name, paused=paused)

    async def reset_circuit(self, type_name: str) -> None:
        self.message_type(type_name)
        await self.runtime.control.reset_circuit(type_name)

    async def enqueue(
        self, queue: str, bodies: Sequence[dict[str, Any]], **options: Any
    ) -> list[EnqueuedMessage]:
        """Validate every body against the queue's model first: nothing is written unless all pass."""
        sub = self.queue(queue)
        messages, errors = [], []
        for index, body in enumerate(bodies):
            try:
                messages.append(read_body(sub.message_type, body))  # as the JSON it is
            except ValidationError as exc:
                for e in exc.errors(include_url=False):
                    errors.append(
                        {**e, "loc": ["body", index, *e["loc"]] if len(bodies) > 1 else ["body", *e["loc"]]}
                    )
        if errors:
            raise BodyInvalid(errors)
        opts: EnqueueOptions = {k: v for k, v in options.items() if v is not None}  # type: ignore[assignment]
        receipts = await self.runtime.producer.enqueue_many(messages, **opts)
        return [
            EnqueuedMessage(
                message_id=r.message_id,
                tracking_id=r.tracking_id,
                type=r.type,
                queue=r.queue,
                status=r.status,
                not_before=r.not_before,
                expires_at=r.expires_at,
                outcome=r.outcome,
                supersedes=r.supersedes,
            )
            for r in receipts
        ]


def _reason(q: QueueSummary) -> str:
    bad = q.counts.get(S.DEAD_LETTERED, 0) + q.counts.get(S.ABANDONED, 0)
    parts = [f"{bad} dead-lettered or abandoned message(s)"] if bad else []
    if q.circuit is not None and q.circuit.state != "closed":
        parts.append(f"circuit {q.circuit.state}")
    return "; ".join(parts)


def _example_body(mtype: type[QueueMessage]) -> dict[str, Any] | None:
    """The type's example, shown to the operator; None where it no longer builds (a type met first as it
    was enqueued is registered without checking it): one stale example must not fail the listing."""
    try:
        example = mtype.example()
        return example.body() if example is not None else None
    except Exception as exc:
        log.warning("the example of %s does not build: %s", mtype.type_name(), first_line(exc))
        return None


def _body_schema(sub: Subscription) -> dict[str, Any]:
    schema = sub.message_type.model_json_schema()
    props = schema.get("properties", {})
    for base in ("message_id", "created_at", "correlation_id", "properties"):
        props.pop(base, None)
    return schema
