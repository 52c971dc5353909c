"""The runtime: one app bound to one provider, with its control store, tracker, pipeline and producer.

Hosts (the worker, the Azure Functions triggers, the test helpers) all go through
:meth:`Runtime.record` after settling, so history and the outcome log line are written in one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from uuid import UUID

from .clock import Clock, as_utc, utcnow
from .control import CachedControlStore, ControlStore, MemoryControlStore
from .control.identities import KeepsIdentities
from .decisions import Complete, DeadLetter, Defer, Expire, Release, RetryAfter
from .envelope import REPEATED_FORWARD, Envelope, malformed_identity
from .idempotency import IdentityGuard
from .messages import MessageStatus
from .naming import Transport
from .pipeline import Pipeline
from .producer import Producer, SendsIdempotent
from .storable import storable, storable_text
from .throughput import Throughput
from .tracking import MemoryTracker, MessageRecord, Tracker, record_from_envelope
from .tracking.backlog import HistoryWriter
from .tracking.base import ChangesIfUnchanged, is_cancel_request, is_producers_record
from .transport import Delivery, Provider, Settlement

if TYPE_CHECKING:
    from .app import QueueingApp

outcome_log = logging.getLogger("queueing.outcome")
#: added to the longest lease before a dead process's unconfirmed history row is written (seconds)
UNSETTLED_MARGIN = 10.0


@runtime_checkable
class ProvidesControl(Protocol):
    """A provider whose own store holds the shared pause/circuit state (the SQL provider)."""

    def control_store(self) -> ControlStore: ...


@runtime_checkable
class ProvidesTracker(Protocol):
    """A provider that is its own durable history (the SQL provider)."""

    def tracker(self) -> Tracker: ...


@runtime_checkable
class StoresProgress(Protocol):
    """A provider that keeps a running message's progress on its own row (the SQL provider), written
    only while the delivery's own lease holds it."""

    async def store_progress(self, delivery: Delivery, progress: dict[str, Any]) -> None: ...


@runtime_checkable
class PushesCancels(Protocol):
    """A provider that hears cancellation requests as they are made (PostgreSQL's NOTIFY): it calls
    ``on_cancel`` with the message id, sooner than the worker's look at the control store."""

    on_cancel: Callable[[UUID], None] | None


@dataclass(slots=True)
class HistoryAhead:
    """Records made (and journaled) before a batch is settled, to be written once it is."""

    records: dict[int, MessageRecord] = field(default_factory=dict)  # by id() of the delivery
    rows: dict[int, int] = field(default_factory=dict)  # journal row by id() of the delivery


#: transports whose queues (and their dead-letter or poison companions) are named on the broker
_NAMED_ON_THE_BROKER = frozenset(
    {Transport.SERVICE_BUS, Transport.STORAGE_QUEUE, Transport.SQS, Transport.RABBITMQ}
)


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Runtime:
    def __init__(
        self,
        app: QueueingApp,
        provider: Provider,
        *,
        control: ControlStore | None = None,
        tracker: Tracker | None = None,
        clock: Clock = utcnow,
        control_ttl: float = 1.0,
        pause_recheck: timedelta = timedelta(seconds=5),
        waiting_recheck: timedelta = timedelta(seconds=30),
        history_journal: Path | None = None,
    ) -> None:
        self.app = app
        self.provider = provider
        self.clock = clock
        if control is None:
            control = (
                provider.control_store()
                if isinstance(provider, ProvidesControl)
                else MemoryControlStore(clock)
            )
        if tracker is None:
            tracker = provider.tracker() if isinstance(provider, ProvidesTracker) else MemoryTracker()
        self.control = CachedControlStore(control, ttl=control_ttl)
        self.tracker = tracker
        #: history not yet written (kept in ``history_journal``, a directory, so a restart resumes it)
        self.history = HistoryWriter(tracker, journal_dir=history_journal, clock=clock)
        self.producer = Producer(app, provider, history=self.history, clock=clock, opener=self.open)
        self.pipeline = Pipeline(
            app,
            self.control,
            clock=clock,
            pause_recheck=pause_recheck,
            waiting_recheck=waiting_recheck,
            producer=self.producer,
        )
        self.pipeline.progress_sink = self.store_progress
        self.pipeline.run_bound = provider.capabilities.longest_run
        previous = getattr(provider, "previous_of", None)
        #: idempotent types where the provider cannot find a waiting message (all but SQL)
        self.identities: IdentityGuard | None = None
        if previous is not None:
            self.pipeline.previous_lookup = previous
            self.pipeline.supersede_check = getattr(provider, "superseded_by", None)
        elif not isinstance(provider, SendsIdempotent) and isinstance(control, KeepsIdentities):
            self.identities = IdentityGuard(app, control, tracker, provider, clock)
            self.producer.identities = self.identities
            self.pipeline.previous_lookup = self.identities.previous
            self.pipeline.supersede_check = self.identities.check_start
            self.pipeline.expiry_check = self.identities.expires
        if isinstance(provider, PushesCancels):
            provider.on_cancel = self._cancel_heard
        app.bind(self.producer, runtime=self)
        #: handled messages and waiting time in this process (``GET metrics``)
        self.throughput = Throughput.of(app.hooks)
        self._opened = False
        self._open_lock = asyncio.Lock()

    def _cancel_heard(self, message_id: UUID) -> None:
        self.control.invalidate()  # the next state read (a message about to start) sees it too
        self.pipeline.cancel_running(message_id)

    async def store_progress(self, delivery: Delivery, progress: dict[str, Any]) -> None:
        """Keep a running handler's progress report with its message."""
        now = self.clock()
        stamped = {**progress, "at": now.isoformat()}
        if isinstance(self.provider, StoresProgress):
            await self.provider.store_progress(delivery, stamped)
        elif delivery.envelope is not None:  # (always: only a decoded message's handler runs)
            rec = record_from_envelope(delivery.envelope, MessageStatus.LEASED.value, now, progress=stamped)
            await self.tracker.upsert([rec])

    @property
    def is_open(self) -> bool:
        return self._opened

    async def open(self) -> None:
        if self._opened:  # (every enqueue comes here: no lock once open)
            return
        # two first enqueues at once (a web app's first requests) opened the provider twice: the
        # second open's broker connection replaced the first, which nothing closed
        async with self._open_lock:
            if self._opened:
                return
            if self.provider.transport in _NAMED_ON_THE_BROKER:
                # a queue named like another's dead-letter or poison queue (or two sharing one name)
                # would run that queue's dead letters again: refused before anything is declared or
                # created. The Functions app runs the same check at indexing
                from .infra import check_names

                naming = getattr(self.provider, "naming", None)
                check_names(self.app, (self.provider.transport,), naming, deployed=False)
            await self.provider.open(self.app)
            self._opened = True
            if not self.provider.capabilities.durable_history:
                # a row a dead process kept before an unapplied settlement waits out every lease
                leases = [s.options.lease_duration.total_seconds() for s in self.app.subscriptions()]
                self.history.unsettled_after = max(leases, default=30.0) + UNSETTLED_MARGIN
                self.history.open()

    async def close(self) -> None:
        if self._opened:
            self._opened = False
            await self.history.close()
            await self.provider.close()

    async def __aenter__(self) -> Runtime:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def process(
        self, delivery: Delivery, *, cancel_poll: float | None = None, **kwargs: Any
    ) -> Settlement:
        """Decide what becomes of ``delivery``. A host that runs one message at a time (a Functions
        trigger) passes ``cancel_poll``: the control store is read that often while the handler runs,
        so a cancellation reaches it there too (a worker watches all its messages at once)."""
        env = delivery.envelope
        if env is not None and REPEATED_FORWARD in env.headers and await self._already_done(env):
            delivery.duplicate = True
            return Settlement(delivery, Complete())
        if cancel_poll is None or env is None:
            return Settlement(delivery, await self.pipeline.process(delivery, **kwargs))
        watcher = asyncio.create_task(self._watch_cancel(env.message_id, cancel_poll))
        try:
            return Settlement(delivery, await self.pipeline.process(delivery, **kwargs))
        finally:
            watcher.cancel()

    async def _already_done(self, env: Envelope) -> bool:
        """A forward sent again after a dispatcher died: its first forward ran if the history holds a
        success of this attempt or a later one. Only a success counts: another outcome may be a record
        whose settlement never reached the transport, and acting on it could drop the only copy (a
        success, stale or not, means a run of the handler succeeded). An unreadable history runs it
        (a duplicate run beats a lost one)."""
        try:
            rec = await self.tracker.get(env.message_id)
        except Exception as exc:
            outcome_log.warning("could not look for an earlier run of %s: %s", env.message_id, exc)
            return False
        done = rec is not None and rec.status == MessageStatus.SUCCEEDED and rec.attempt >= env.attempt
        if done:
            outcome_log.warning(
                "message %s was forwarded again after its outcome (%s) was recorded: completed as a "
                "duplicate, not run",
                env.message_id,
                rec.status if rec else "",
            )
        return done

    async def _watch_cancel(self, message_id: UUID, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                requested = message_id in (await self.control.state()).cancelled
            except Exception as exc:
                outcome_log.warning("could not read cancellation requests (%s); will try again", exc)
                continue
            if requested and self.pipeline.cancel_running(message_id):
                return

    async def process_and_settle(self, delivery: Delivery) -> Settlement:
        """Decide, settle and record one delivery (hosts without batching use this)."""
        settlement = await self.process(delivery)
        ahead = self.history_ahead([settlement])
        try:
            await self.provider.settle([settlement])
        except BaseException:
            self.history_not_settled(ahead)
            raise
        self.history_applied([settlement], ahead)
        await self.record([settlement], ahead)
        return settlement

    def history_ahead(self, settlements: Sequence[Settlement]) -> HistoryAhead:
        """Make the history records of ``settlements`` and journal them, before the transport is
        settled: a crash between the settlement and the history write leaves them to be written by the
        next process (see :mod:`queueing_core.tracking.backlog`)."""
        ahead = HistoryAhead()
        if self.provider.capabilities.durable_history or not settlements:
            return ahead
        now = self.clock()
        ahead.records = {
            id(s.delivery): history_record(s, now) for s in settlements if not s.delivery.duplicate
        }
        rows = self.history.ahead(list(ahead.records.values()))
        # the journal keeps one row per message: it belongs to the last settlement of that message
        taken: set[object] = set()
        for s in reversed(settlements):
            if s.delivery.duplicate:
                continue
            mid = ahead.records[id(s.delivery)].message_id
            if mid in rows and mid not in taken:
                taken.add(mid)
                ahead.rows[id(s.delivery)] = rows[mid]
        return ahead

    def history_applied(self, settlements: Sequence[Settlement], ahead: HistoryAhead) -> None:
        """The transport has applied ``settlements`` (all but those it refused): their journal rows now
        record what happened, and a process that takes them over after a crash writes them at once.
        A refused one's row is forgotten now: its outcome must never be written."""
        rows = [
            (s.delivery.refused, ahead.rows[k]) for s in settlements if (k := id(s.delivery)) in ahead.rows
        ]
        self.history.drop([row for refused, row in rows if refused])
        self.history.settled([row for refused, row in rows if not refused])

    def history_not_settled(self, ahead: HistoryAhead) -> None:
        """The settlement did not happen (it failed for good): forget what was journaled for it."""
        self.history.drop(list(ahead.rows.values()))

    async def record(self, settlements: Sequence[Settlement], ahead: HistoryAhead | None = None) -> None:
        """Write history (for providers without their own) and one outcome line per message. A
        settlement the transport refused (its lease had passed to another run) is not history: the
        run that holds the message now records the outcome. A write that fails is kept and retried
        until it lands (``history.backlog`` counts what waits). An idempotent message's success is
        noted for its identity first: one who saw it recorded and sent the next version got no
        ``ctx.previous`` while the note was still on its way (seen in CI)."""
        if self.identities is not None and settlements:
            await self.identities.note_settled(settlements)
        if not self.provider.capabilities.durable_history and settlements:
            if ahead is None:
                ahead = self.history_ahead(settlements)
            refused = [
                ahead.rows[k]
                for s in settlements
                if s.delivery.refused and (k := id(s.delivery)) in ahead.rows
            ]
            self.history.drop(refused)
            applied = [s for s in settlements if not s.delivery.refused and not s.delivery.duplicate]
            records = [_with_left_behind(ahead.records[id(s.delivery)], s.delivery) for s in applied]
            rows = {
                ahead.records[k].message_id: ahead.rows[k]
                for s in applied
                if (k := id(s.delivery)) in ahead.rows
            }
            self.history_applied(applied, ahead)
            await self.history.write(records, rows)
            for s in settlements:
                if s.delivery.refused and s.delivery.unconfirmed and id(s.delivery) in ahead.records:
                    await self._record_unless_overtaken(ahead.records[id(s.delivery)], s.delivery)
            for s in settlements:
                if s.delivery.duplicate and not s.delivery.refused and s.delivery.envelope is not None:
                    await self._note_duplicate(s.delivery.envelope.message_id)
        for s in settlements:
            if not s.delivery.duplicate:
                log_outcome(s)

    async def _record_unless_overtaken(self, rec: MessageRecord, d: Delivery) -> None:
        """The outcome of a settlement the transport refused after the message left its queue, which an
        earlier try of that settlement may have done (its answer lost): recorded over the stored record
        by compare-and-set, unless a later run of the message may have recorded its own: a record with
        a higher attempt, or one written since this run received the message that says more than the
        producer's "sent" (a progress report included: it may be a later run's). Dated when this run
        received the message: a later run received it only after this run's lock lapsed, so its
        record, even one that lands after this one, is the newer by the hosts' clocks (the late write's
        rule keeps it). Best effort: a failure leaves the history at its last recorded state."""
        rec = rec.model_copy(update={"updated_at": d.received_at})
        tracker = self.tracker
        if not isinstance(tracker, ChangesIfUnchanged):  # (every tracker of a transport that refuses so)
            return
        try:
            seen = await tracker.get(rec.message_id)
            if seen is None or seen.attempt > rec.attempt:
                return
            if as_utc(seen.updated_at) > rec.updated_at and not (
                is_producers_record(seen) or is_cancel_request(seen)
            ):
                # recorded since this run received the message, and more than the producer's "sent" or
                # an operator's request to cancel: another run's (one that used no attempt, a pause's
                # wait say, has this run's attempt number), or a progress report, which may be a later
                # run's (of a copy) as well as this one's
                return
            changes = {name: getattr(rec, name) for name in _RECORD_FIELDS}
            if not await tracker.change_if_unchanged(seen, changes):
                outcome_log.info("%s was recorded by another run meanwhile: that stands", rec.message_id)
        except Exception as exc:
            outcome_log.warning("could not record the outcome of %s: %s", rec.message_id, exc)

    async def _note_duplicate(self, message_id: UUID) -> None:
        """Count a known duplicate in the message's history (where the history store keeps a count)."""
        note = getattr(self.tracker, "note_duplicate", None)
        if note is None:
            return
        try:
            await note(message_id)
        except Exception as exc:  # a count, not an outcome: the message was settled as it had to be
            outcome_log.warning("could not count a duplicate of %s: %s", message_id, exc)


#: every field of a record as a settlement writes it (the whole record, as ``history.write`` does)
_RECORD_FIELDS = tuple(name for name in MessageRecord.model_fields if name != "unreadable")


def _with_left_behind(rec: MessageRecord, d: Delivery) -> MessageRecord:
    """``rec``, made before the settlement, with what the settlement itself learned: an original it
    sent a copy of but could not complete (``left_behind``), so that its return is recognised even
    when noting it at once failed."""
    if d.left_behind is None or rec.copied_from == d.left_behind:
        return rec
    return rec.model_copy(update={"copied_from": d.left_behind})


def history_record(s: Settlement, now: Any) -> MessageRecord:
    d, decision = s.delivery, s.decision
    env = d.envelope
    fields: dict[str, Any] = {
        "status": str(decision.status),
        "attempt": d.attempts_used(decision),
        "updated_at": now,
    }
    if isinstance(decision, RetryAfter):
        fields.update(last_error=decision.error, not_before=now + decision.delay)
    elif isinstance(decision, DeadLetter):
        fields.update(reason=decision.reason.value, description=decision.description)
    elif isinstance(decision, Defer):
        fields.update(reason=decision.reason, not_before=decision.until)
        if decision.reset_attempts:
            fields.update(expires_at=decision.expires_at)
    elif isinstance(decision, Complete):
        fields.update(result=jsonable(decision.result))
        if decision.reason is not None:
            fields.update(reason=decision.reason)
    elif isinstance(decision, Release):
        fields.update(reason=decision.reason)
    if d.left_behind is not None:
        fields.update(copied_from=d.left_behind)
    # the message's own texts made storable (storable.py): one another system published straight to the
    # broker never met the enqueue's check, and a U+0000 or a lone surrogate in it made every history
    # store refuse its record (PostgreSQL's on every try, and the writer then dropped it)
    if env is None:
        message_id, tracking_id, type_name = malformed_identity(d.text())
        return MessageRecord(
            message_id=message_id,
            tracking_id=tracking_id,
            type=storable_text(type_name),
            queue=d.queue,
            created_at=d.received_at,
            raw=storable_text(d.text()[:65536]),
            **fields,
        )
    return MessageRecord(
        message_id=env.message_id,
        tracking_id=env.tracking_id,
        type=storable_text(env.type),
        queue=env.queue,
        correlation_id=None if env.correlation_id is None else storable_text(env.correlation_id),
        created_at=env.created_at,
        headers=storable(env.headers)[0],
        body=storable(env.body)[0],
        **{"not_before": env.not_before, "expires_at": env.expires_at, **fields},
    )


def jsonable(value: Any) -> Any:
    """A handler's result as JSON-ready data (pydantic models dumped; other objects by repr)."""
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else repr(value)


def log_outcome(s: Settlement) -> None:
    d, decision = s.delivery, s.decision
    env = d.envelope
    # the level first: a line nobody logs is not formatted (most are successes at INFO)
    if d.refused or isinstance(decision, RetryAfter):
        level = logging.WARNING
    elif isinstance(decision, DeadLetter):
        level = logging.ERROR
    else:
        level = logging.INFO
    if not outcome_log.isEnabledFor(level):
        return
    detail = ""
    if d.refused and d.unconfirmed:
        detail = " refused, the message gone from its queue (a try's answer lost?): kept unless a later run's"
    elif d.refused:
        detail = " not applied: the lease had passed to another run"
    elif isinstance(decision, RetryAfter):
        detail = f" retry in {decision.delay.total_seconds():.1f}s: {decision.error.splitlines()[0]}"
    elif isinstance(decision, DeadLetter):
        first_line = decision.description.splitlines()[0] if decision.description else ""
        detail = f" {decision.reason.value}: {first_line}"
    elif isinstance(decision, Defer | Release):
        detail = f" ({decision.reason})"
    elif isinstance(decision, Expire):
        detail = f" (expired at {decision.expired_at.isoformat()})"
    outcome_log.log(
        level,
        "%s %s%s",
        decision.status,
        env.type if env else "(malformed)",
        detail,
        extra={
            "message_id": str(env.message_id) if env else None,
            "correlation_id": env.correlation_id if env else None,
            "queue": d.queue,
            "attempt": d.attempt,
            "status": str(decision.status),
        },
    )
