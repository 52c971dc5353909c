"""Job control from code and the ops API: find a message by tracking id, cancel it, read its status,
progress and result, and wait for it to finish. One implementation for every transport: the control
store carries cancellation requests to whichever host runs the message, the history holds the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from uuid import UUID

from .control.base import CANCEL_KEPT
from .errors import InvalidOperation, JobCancelled, JobFailed, MessageNotFound
from .messages import MessageStatus
from .tracking import MessageQuery, MessageRecord, record_change
from .tracking.base import CANCEL_REQUESTED, ChangesIfUnchanged, is_cancel_request

if TYPE_CHECKING:
    from datetime import datetime

    from .runtime import Runtime
    from .transport import Provider

S = MessageStatus
TERMINAL = frozenset(s.value for s in MessageStatus.terminal())
#: writes of a cancel request's record tried against a history that keeps changing (a run's progress)
_REQUEST_TRIES = 5
#: why a finished message cannot be cancelled, by its status
_FINISHED = {
    S.SUCCEEDED.value: "it already succeeded",
    S.DEAD_LETTERED.value: "it was dead-lettered",
    S.EXPIRED.value: "it expired",
    S.CANCELLED.value: "it is already cancelled",
}


@runtime_checkable
class CancelsWaiting(Protocol):
    """A provider that can take a message that is not running out of its queue at once (the SQL
    provider: one guarded UPDATE). Elsewhere the message stays queued and is settled Cancelled,
    unrun, when a host receives it."""

    async def ops_cancel(self, record: MessageRecord, now: datetime) -> bool: ...


@runtime_checkable
class WakesResultWaiters(Protocol):
    """A provider that can tell a waiter in any process that a message reached a final status (the
    SQL provider on PostgreSQL: a NOTIFY sent only for messages someone waits for)."""

    async def watch_result(self, message_id: UUID, wake: asyncio.Event) -> bool: ...

    def unwatch_result(self, message_id: UUID, wake: asyncio.Event) -> None: ...


#: how often ``result`` looks at the history: at most ``POLL`` seconds apart (it starts faster), or
#: ``WOKEN_POLL`` apart where a NOTIFY wakes it (the look then only covers a NOTIFY that was lost)
POLL = 0.2
WOKEN_POLL = 5.0


#: how many of a tracking id's newest messages ``find`` looks through for one whose row reads
FIND_AMONG = 20


@dataclass(frozen=True, slots=True)
class CancelReceipt:
    message_id: UUID
    tracking_id: UUID
    #: Cancelled, or Leased while a running handler is being told to stop
    status: str
    detail: str


async def find(runtime: Runtime, tracking_id: UUID, *, newest: bool = True) -> MessageRecord:
    """The message with this tracking id (or message id): the newest whose creation time reads, else
    the newest. A row damaged outside the kit may share the tracking id, and its time, which does not
    read, may sort first (SQLite's ``garbage``, PostgreSQL's ``infinity``): an action must not land on
    it. Only the time decides: the newest message damaged elsewhere (its progress, say) is still the
    newest, and an action on it is refused by name, not moved to an older message.

    A message's tracking id is its own message id unless its sender gave one, so the first message of
    a tracking id that later messages were sent with is found by both ids. ``newest`` (code's
    ``app.cancel``, ``status``, ``result``, which take a tracking id) names the newest of them then;
    without it (the ops API, the dashboard and the command line, which name one message), a message
    found by its own message id is the one named."""
    rec = await runtime.tracker.get(tracking_id)
    if rec is None or (newest and rec.tracking_id == tracking_id):
        page = await runtime.tracker.query(MessageQuery(tracking_id=tracking_id), limit=FIND_AMONG)
        dated = (r for r in page.items if r.readable("created_at"))
        rec = next(dated, page.items[0] if page.items else rec)
    if rec is None:
        raise MessageNotFound(f"no message with tracking id {tracking_id}")
    return rec


def _only_requested(r: MessageRecord, provider: Provider) -> bool:
    return is_cancel_request(r) and not provider.capabilities.durable_history


def _lapses_first(r: MessageRecord, now: datetime) -> bool:
    return r.not_before is not None and r.not_before - now > CANCEL_KEPT


async def cancel(runtime: Runtime, tracking_id: UUID, *, newest: bool = True) -> CancelReceipt:
    """A message not yet running never runs; a running one is told (``ctx.cancelled``) and cancelled
    after its type's ``cancel_grace``. Either way it ends Cancelled. A finished message is refused.
    The message is :func:`find`'s (``newest`` as there)."""
    r = await find(runtime, tracking_id, newest=newest)
    if not r.readable("message_id"):  # found by its tracking id, but nothing can name its row
        raise InvalidOperation(
            f"cannot cancel message with tracking id {tracking_id}: its stored row is damaged "
            f"({r.malformed}); purge it by a filter (queue, status, tracking id)"
        )
    if r.status in TERMINAL or r.archived:
        why = _FINISHED.get(r.status, "it is archived")
        raise InvalidOperation(f"cannot cancel message {r.message_id}: {why}")
    now = runtime.clock()
    provider = runtime.provider
    waiting_elsewhere = r.status != S.LEASED.value and not isinstance(provider, CancelsWaiting)
    if waiting_elsewhere and not provider.capabilities.durable_history and _lapses_first(r, now):
        # a host receives it when it is due, after a request would have lapsed: it would run then, so
        # no request is made and it is not said to be cancelled
        assert r.not_before is not None
        return CancelReceipt(
            r.message_id,
            r.tracking_id,
            r.status,
            f"not cancelled: it is due {r.not_before.isoformat()}, and a cancellation request is kept a "
            "day on this transport: cancel it again within a day of that time",
        )
    # the request first: whichever host holds the message now, or receives it later, sees it
    await runtime.control.set_cancel(r.message_id, True, now)
    if r.status != S.LEASED.value:
        if isinstance(provider, CancelsWaiting):
            if await provider.ops_cancel(r, now):
                return CancelReceipt(
                    r.message_id, r.tracking_id, S.CANCELLED.value, "cancelled before it ran"
                )
            # it was claimed meanwhile: the request reaches the run
        elif not provider.capabilities.durable_history:
            # this transport does not say whether a host runs the message now (only SQL records a
            # claim): Cancelled at once for the operator, marked as the request; a waiter waits for
            # the host's settlement (Cancelled, or Succeeded by a run that finished first)
            change = {"status": S.CANCELLED.value, "description": CANCEL_REQUESTED, "updated_at": now}
            finished = await _record_request(runtime, r, change)
            if finished is not None:
                # a host settled it after it was read: its outcome stands, the request goes
                await runtime.control.set_cancel(r.message_id, False, now)
                why = _FINISHED.get(finished.status, "it finished")
                raise InvalidOperation(f"cannot cancel message {r.message_id}: {why}")
            return CancelReceipt(
                r.message_id,
                r.tracking_id,
                S.CANCELLED.value,
                "cancelled: settled without running when a host receives it; a host running it now is "
                "told (ctx.cancelled) and stops it after its grace, unless it finishes first",
            )
    return CancelReceipt(
        r.message_id,
        r.tracking_id,
        S.LEASED.value,
        "cancellation requested: the running handler sees ctx.cancelled and is stopped after its grace",
    )


async def _record_request(runtime: Runtime, r: MessageRecord, change: dict[str, Any]) -> MessageRecord | None:
    """Write the request's record over ``r`` unless a host recorded something since it was read; when
    that was a final outcome, that record (not replaced: written over a success it wiped the result,
    and a waiter waited for a settlement that would never come). Something else recorded meanwhile (a
    run's progress, a retry scheduled) is read again and the request written over it."""
    tracker = runtime.tracker
    if not isinstance(tracker, ChangesIfUnchanged) or r.malformed is not None:
        await record_change(tracker, r, change)
        return None
    for _ in range(_REQUEST_TRIES):
        if await tracker.change_if_unchanged(r, change):
            return None
        now_r = await tracker.get(r.message_id)
        if now_r is None:  # purged meanwhile: nothing to mark
            return None
        if _only_requested(now_r, runtime.provider):
            return None  # another cancel beside this one wrote the request's record: done
        if now_r.status in TERMINAL:
            return now_r
        r = now_r
    raise InvalidOperation(
        f"cannot cancel message {r.message_id}: its history kept changing while the request was "
        "recorded; the request stands (a host that receives it settles it Cancelled): look again"
    )


async def result(
    runtime: Runtime, tracking_id: UUID, *, timeout: float | None = None, poll: float | None = None
) -> Any:
    """Wait for the message to finish and return its handler's result. Raises :class:`JobCancelled`
    or :class:`JobFailed` for a message that ended without one, and ``TimeoutError`` after
    ``timeout`` seconds (None: wait as long as it takes). ``poll``: the longest time between two
    looks at the history (:data:`POLL`, or :data:`WOKEN_POLL` where a NOTIFY wakes the waiter)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    r = await find(runtime, tracking_id)
    provider = runtime.provider
    wake = asyncio.Event()
    watched = r.message_id  # unwatched by this id: a later look may find another message of the tracking id
    woken = isinstance(provider, WakesResultWaiters) and await provider.watch_result(watched, wake)
    interval = poll if poll is not None else WOKEN_POLL if woken else POLL
    # woken: the look only covers a lost NOTIFY, so it need not start fast
    delay = interval if woken else min(interval, 0.05)
    try:
        if woken:
            # look again now that it is watched: a settlement before the watch is seen by this look,
            # and one after it sends the NOTIFY
            r = await find(runtime, tracking_id)
        while True:
            if r.status == S.SUCCEEDED.value:
                return r.result
            if r.status in TERMINAL and not _only_requested(r, provider):
                error = JobCancelled if r.status == S.CANCELLED.value else JobFailed
                why = [r.reason or "", (r.description or "").split("\n")[0]]
                detail = ": " + "; ".join(w for w in why if w) if any(why) else ""
                raise error(
                    f"message {r.message_id} ended {r.status}{detail}",
                    status=r.status,
                    reason=r.reason,
                    description=r.description,
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"message {r.message_id} is still {r.status} after {timeout:g}s")
            wait = delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
            wake.clear()
            delay = min(interval, delay * 2)
            r = await find(runtime, tracking_id)
    finally:
        if woken:
            assert isinstance(provider, WakesResultWaiters)
            provider.unwatch_result(watched, wake)
