"""Forwards due delayed messages to their transport.

Loop: fetch what is due -> forward each to its destination queue -> remove it. When nothing is due
it sleeps until :meth:`SqlDelayedStore.next_due` (at most ``max_idle``), or until a ``store`` wakes
it (in process at once; from other processes by PostgreSQL ``NOTIFY``).

A failed forward:

- the transport is unreachable (:class:`ProviderUnavailable`): not the message's fault, so it is not
  counted; the message is due again after the dispatch breaker's back-off.
- any other error counts a failure on the message; after ``retries`` failures it goes to the
  transport's dead-letter queue with the reason ``delayed-forward-failed`` and the last error.

Due times, leases and retry times are the store's, on the database's clock (see the store's module),
so hosts whose clocks differ neither forward a message early nor take another's lease for over. The
lease of the rows in hand is renewed every third of it while their forwards are under way, so a forward
that outlasts it (a transport's SDK retrying) is neither fetched again nor purged meanwhile.

Three circuit breakers (``store`` in the store, ``fetch`` and ``dispatch`` here) open after failures
that continue for longer than their time-to-trigger: they log once at CRITICAL and back off.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

from ...clock import Clock, utcnow
from ...envelope import REPEATED_FORWARD, Envelope, malformed_identity
from ...errors import ProviderError, ProviderUnavailable
from ...messages import MessageStatus
from ...tracking import MessageRecord, Tracker, record_change, record_from_envelope
from .breaker import CircuitBreaker, first_line
from .store import DelayedMessage, SqlDelayedStore

log = logging.getLogger("queueing.delayed")

#: the dead-letter reason of a message whose forwards kept failing
FORWARD_FAILED = "delayed-forward-failed"


def forward_failed_record(env: Envelope, description: str, now: datetime) -> MessageRecord:
    """The history of a delayed message the dispatcher gave up on (the transport records it)."""
    return record_from_envelope(
        env, MessageStatus.DEAD_LETTERED.value, now, reason=FORWARD_FAILED, description=description
    )


async def record_stored_text(
    tracker: Tracker, item: DelayedMessage, queue: str, reason: str, description: str, now: datetime
) -> None:
    """Record in ``tracker`` a delayed-store row whose text is not an envelope, dead-lettered as it
    was stored: under the message id the row was stored with, the text kept (up to 64 KiB). The
    message's own record, when the history has one that reads, gives its queue, creation time, type
    and tracking id: the text cannot (what it names may be another message's), and a record of another
    creation time or queue was, on Tables, whose keys hold them, a second entity beside the message's,
    which stayed listed as waiting. A damaged one (see ``MessageRecord.malformed``) is changed in place
    (:func:`record_change`), so that its stand-ins never replace the text it keeps."""
    _, tracking_id, type_name = malformed_identity(item.envelope)
    record = MessageRecord(
        message_id=item.message_id,
        tracking_id=tracking_id,
        type=type_name,
        queue=queue,
        status=MessageStatus.DEAD_LETTERED.value,
        created_at=item.created_at,
        updated_at=now,
        reason=reason,
        description=description,
        raw=item.envelope[:65536],
    )
    try:
        known = await tracker.get(item.message_id)
    except ProviderError:
        raise  # (the store failing: the row stays, and its dead letter is tried again)
    except Exception as exc:  # a stored record that does not read at all: written over, as it was
        log.warning("the history record of message %s does not read (%s)", item.message_id, first_line(exc))
        known = None
    if known is not None and known.malformed is not None:
        changes = {"status": record.status, "updated_at": now, "reason": reason, "description": description}
        await record_change(tracker, known, changes)
        return
    if known is not None:
        record = record.model_copy(
            update={
                "queue": known.queue,
                "created_at": known.created_at,
                "tracking_id": known.tracking_id,
                "type": known.type,
            }
        )
    await tracker.upsert([record])


def mark_repeated(item: DelayedMessage) -> DelayedMessage:
    """``item`` with its envelope marked as a possible second forward (visible in its headers)."""
    try:
        env = Envelope.decode(item.envelope)
    except Exception:  # forwarded as it is; the dead-letter path handles a body that is not one
        return item
    marked = env.model_copy(update={"headers": {**env.headers, REPEATED_FORWARD: str(item.claims - 1)}})
    return dataclasses.replace(item, envelope=marked.encode_text())


@runtime_checkable
class DelayedTarget(Protocol):
    """The transport side: what a provider does with a due message."""

    async def forward_delayed(self, item: DelayedMessage) -> None:
        """Send ``item.envelope`` to ``item.destination``; return once the transport accepted it."""

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        """Put ``item`` in the dead-letter queue of ``item.destination`` with ``FORWARD_FAILED``."""


class DelayedDispatcher:
    def __init__(
        self,
        store: SqlDelayedStore,
        target: DelayedTarget,
        *,
        retries: int = 3,
        retry_delay: timedelta = timedelta(seconds=1),
        batch: int = 50,
        max_idle: float | None = None,
        time_to_trigger_fetch: timedelta = timedelta(seconds=30),
        time_to_trigger_dispatch: timedelta = timedelta(seconds=30),
        open_backoff: float = 10.0,
        listen: bool = True,
        clock: Clock = utcnow,
        stop_grace: float = 10.0,
    ) -> None:
        self.store = store
        self.target = target
        self.retries = retries
        self.retry_delay = retry_delay
        self.batch = batch
        # PostgreSQL wakes dispatchers across processes; SQLite has no NOTIFY, so poll more often
        self.max_idle = max_idle if max_idle is not None else (30.0 if store.is_postgres else 5.0)
        self.listen = listen
        #: this host's clock; due and retry times are the store's, on the database's (see the module)
        self.clock = clock
        self.stop_grace = stop_grace  # how long a stop waits for the batch in hand
        self.fetch_breaker = CircuitBreaker(
            "delayed store (fetch)", time_to_trigger_fetch, open_backoff=open_backoff
        )
        self.dispatch_breaker = CircuitBreaker(
            "delayed store (dispatch)", time_to_trigger_dispatch, open_backoff=open_backoff
        )
        self._wakeup = asyncio.Event()
        #: messages forwarded / moved to the dead-letter queue since start (for tests and metrics)
        self.forwarded = 0
        self.dead_lettered = 0
        #: forwards sent again after a dispatcher stopped between a forward and its removal
        self.repeated = 0

    def wake(self) -> None:
        self._wakeup.set()

    # -- one batch ---------------------------------------------------------------------------------
    async def dispatch_once(self) -> int:
        """Fetch up to ``batch`` due messages and forward them; returns how many were taken."""
        items = await self.store.fetch_due(limit=self.batch)
        if not items:
            return 0
        batch = asyncio.ensure_future(self._settle(items))
        renewing = asyncio.ensure_future(self._renew_while(batch, items))
        try:
            await asyncio.shield(batch)
        except asyncio.CancelledError:
            # stopping between a forward and its removal would leave the message to be sent twice
            await asyncio.wait([batch], timeout=self.stop_grace)
            raise
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        return len(items)

    async def _renew_while(self, batch: asyncio.Future[None], items: list[DelayedMessage]) -> None:
        """Renew the lease of the rows of ``items`` every third of it until ``batch`` is done: a forward
        that outlasts the lease is neither fetched by another dispatcher (a second forward while the
        first is under way) nor taken by a purge by status (reported gone, its history deleted, and
        then run when the forward lands). Only rows still as the fetch (or the last renewal) left them
        are renewed (see :meth:`SqlDelayedStore.renew`); a renewal that fails is tried again at the
        next third, and a lease that ends all the same lets another dispatcher forward the row again,
        a known repeat (at least once), never a loss."""
        held = {i.id for i in items}
        until = items[0].leased_until
        every = self.store.lease.total_seconds() / 3
        while held and until is not None and not batch.done():
            await asyncio.sleep(every)
            if batch.done():
                return
            try:
                held, until = await self.store.renew(sorted(held), until)
            except Exception as exc:
                log.warning(
                    "renewing the lease of %d delayed message(s) failed: %s", len(held), first_line(exc)
                )

    async def _settle(self, items: list[DelayedMessage]) -> None:
        """Forward (or dead-letter) each item, removing each as soon as it left the store's care: a
        dispatcher that stops part-way repeats only the forwards it had in flight."""
        results = await asyncio.gather(*(self._one(i) for i in items), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.error("handling a delayed message failed: %s", first_line(r))

    async def _one(self, item: DelayedMessage) -> None:
        if await self._forward(item) and not await self.store.remove(item.id):
            # its lease lapsed and another dispatcher took it too: a duplicate, not a loss
            log.warning("forwarded delayed message %s was already gone", item.message_id)

    async def _forward(self, item: DelayedMessage) -> bool:
        """True when the message left the store's care (forwarded or dead-lettered)."""
        if item.claims > 1:
            # an earlier fetch's forward may have reached the transport: its dispatcher stopped, or
            # the forward raised after the transport took it (a lost confirm or answer)
            self.repeated += 1
            log.warning(
                "delayed message %s forwarded again: %d earlier forward(s) may have reached the "
                "transport (a dispatcher stopped, or a forward failed without an answer); the handler "
                "may run twice",
                item.message_id,
                item.claims - 1,
                extra={"message_id": str(item.message_id)},
            )
            item = mark_repeated(item)
        try:
            await self.target.forward_delayed(item)
        except Exception as exc:
            backoff = self.dispatch_breaker.failure(exc)
            if isinstance(exc, ProviderUnavailable):
                await self.store.release(item.id, self.store.now() + timedelta(seconds=backoff))
                return False
            return await self._failed(item, exc)
        self.dispatch_breaker.success()
        self.forwarded += 1
        return True

    async def _failed(self, item: DelayedMessage, exc: Exception) -> bool:
        error = first_line(exc)
        if item.failures >= self.retries:
            description = f"{item.failures + 1} forward(s) to {item.destination} failed; last: {error}"
            try:
                await self.target.dead_letter_delayed(item, description)
            except Exception as dl_exc:
                log.error("could not dead-letter delayed message %s: %s", item.message_id, first_line(dl_exc))
            else:
                self.dead_lettered += 1
                log.error("delayed message %s dead-lettered: %s", item.message_id, description)
                return True
        delay = self.retry_delay * 2 ** min(item.failures, 6)
        await self.store.increment_failure(item.id, error=error, retry_at=self.store.now() + delay)
        log.warning(
            "forwarding delayed message %s to %s failed (%d/%d): %s",
            item.message_id,
            item.destination,
            item.failures + 1,
            self.retries + 1,
            error,
        )
        return False

    # -- hosts -------------------------------------------------------------------------------------
    async def dispatch_due(self, budget_seconds: float) -> int:
        """Forward what is due until nothing is, or ``budget_seconds`` pass (a Functions timer)."""
        deadline = time.monotonic() + budget_seconds
        total = 0
        while time.monotonic() < deadline:
            n = await self.dispatch_once()
            total += n
            if n < self.batch:
                break
        return total

    async def run(self) -> None:
        """Forward due messages until cancelled (the worker runs this as a background task)."""
        listener = None
        self.store.add_waker(self.wake)
        if self.listen and self.store.is_postgres:
            listener = self.store.sql.listener(self.store.channel)
            listener.on_notify = lambda transport: (
                self.wake() if transport == self.store.transport.value else None
            )
            await listener.start()
        try:
            while True:
                await self._step()
        finally:
            self.store.remove_waker(self.wake)
            if listener is not None:
                await listener.stop()

    async def _step(self) -> None:
        self._wakeup.clear()  # before looking: a store from now on cuts the sleep short
        try:
            n = await self.dispatch_once()
            if n >= self.batch:
                self.fetch_breaker.success()
                return  # more may be due
            nxt = await self.store.next_due()
            self.fetch_breaker.success()
        except Exception as exc:
            await asyncio.sleep(self.fetch_breaker.failure(exc))
            return
        timeout = self.max_idle
        if nxt is not None:
            timeout = min(timeout, max(0.0, (nxt - self.store.now()).total_seconds()))
        if n == 0:
            # due but not fetched: another dispatcher holds it this instant; do not spin on it
            timeout = max(timeout, 0.05)
        if timeout > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout)
