"""What each Azure Function does: feed one message (or one timer tick) to the same runtime and
decision pipeline as the worker, then settle the decision in the way its trigger allows.

Settlement inside Functions:

Storage Queues trigger (the host deletes the message when the function returns, and on an exception
retries it until ``maxDequeueCount``, then moves it to ``<queue>-poison``):

=============  ==========================================================================
Complete       return: the host deletes it
RetryAfter     send a copy hidden for the backoff (attempts used in its envelope; beyond the 7-day
               visibility limit, its due time too, so an early arrival is hidden again); return
Defer/Release  the same, without counting an attempt (pause, waiting for a handler, early)
DeadLetter     put it in ``<queue>-poison`` with the reason and last error; return
Expire         return (deleted), recorded as Expired
=============  ==========================================================================

So a poison message never crash-loops and a pause never burns the dequeue count. Only a failure of
the kit itself (a store, or the transport as a copy or a dead letter is sent, unreachable for longer
than ``KIT_OUTAGE_WAIT``, waited out within the invocation) raises, and then the host's own retry and
poison apply.

Service Bus trigger, with SDK-type bindings and ``auto_complete_messages=False`` (the default
auto-complete mode can only complete or abandon, so it could not dead-letter an expired or refused
message *with a reason*, and abandoning for a retry spends the delivery count with no backoff). The
attempt is the envelope's (copies carry the attempts used) plus the host's delivery number (see
``servicebus_delivery``), so a crash, a timeout or a lost lock counts too. The settlement calls of
``ServiceBusMessageActions`` are synchronous gRPC: they run in a thread, off the event loop that the
other invocations of the process share.

=============  ==========================================================================
Complete       ``message_actions.complete``
RetryAfter     renew the lock, a copy scheduled for now + backoff (attempts in its envelope),
               then complete
Defer/Release  the same, without counting an attempt
DeadLetter     ``message_actions.deadletter(reason=MaxDeliveryAttemptsExceeded|NonRetryable|...)``
Expire         ``message_actions.deadletter(reason=Expired)``
=============  ==========================================================================

As in the worker's settlement: the lock is renewed before a copy is sent, so a run whose lock lapsed
(the host's renewal failed and the message went to another instance) sends none and records nothing;
and when completing fails after the copy went out, the original's sequence number is noted in the
history (``copied_from``), so its return is completed as a known duplicate instead of running again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from queueing_core.app import QueueingApp, Subscription
from queueing_core.bootstrap import instrumented, make_provider
from queueing_core.clock import utcnow
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, Defer, Expire, Release, RetryAfter
from queueing_core.errors import ProviderUnavailable, first_line
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings, journal_dir
from queueing_core.transport import SHORTEST_BOUND, Delivery, RunBound, Settlement

if TYPE_CHECKING:
    import azure.functions as func

log = logging.getLogger("queueing.functions")
T = TypeVar("T")
#: how long an invocation waits out an outage of the kit's own stores before it raises (the host's
#: retry then): well within the lock the host renews and the functionTimeout (10 min)
KIT_OUTAGE_WAIT = 30.0
#: how long an invocation waits for a free slot of its type (``max_concurrency`` per process) before
#: its message is deferred, no attempt counted: the host pushes in more invocations than a type's slots
#: (host.json: up to 16 Service Bus messages, or 24 Storage messages, a batch of 16 and the next fetched
#: when 8 are left), and one still waiting at the functionTimeout ended the Python worker, with every
#: other invocation of the process
SLOT_WAIT = 60.0
#: the most a SQL processor run gives the handlers still running at its budget's end to finish (a fifth
#: of the budget when that is less); one still running then is cut: a failed attempt if it had run
#: the whole budget, else handed back uncounted (``Worker.drain``)
PROCESSOR_STOP_GRACE = 10.0
#: how long before the host's ``functionTimeout`` a run is cut (at most a quarter of it): the cut run's
#: settlement, an outage of the kit's stores waited out included (``KIT_OUTAGE_WAIT``), must be done
#: before the host ends the invocation
TIMEOUT_MARGIN = KIT_OUTAGE_WAIT + 30.0


def function_timeout_bound(timeout: float | None) -> RunBound | None:
    """The longest a run may go on in a Functions worker process whose host ends an invocation after
    ``timeout`` seconds (host.json's ``functionTimeout``; None: unbounded). The host ends it by
    restarting the Python worker process, and with it every other invocation of the process (each
    message's delivery or dequeue counted, some with a copy already sent: run again), so one handler
    running into the timeout failed its neighbours too (review)."""
    margin = min(TIMEOUT_MARGIN, timeout / 4) if timeout is not None else 0.0
    if timeout is None or timeout - margin < SHORTEST_BOUND.total_seconds():
        return None  # (a few seconds: nothing a run could be cut within)
    return RunBound(
        timedelta(seconds=timeout - margin),
        f"the run came within {margin:g} s of the Functions host's functionTimeout ({timeout:g} s), "
        "which ends every invocation of the worker process (host.json: a longer functionTimeout)",
    )


async def outlasting(step: Callable[[], Awaitable[T]]) -> T:
    """What ``step`` gives, brief outages (``ProviderUnavailable``: the kit's stores, or the transport
    as it sends a copy) waited out within the invocation, with backoff, up to ``KIT_OUTAGE_WAIT``.
    Raising at once is the host's retry: Service Bus hands the message back at once, a delivery
    counted, so a store away for a second moved every message in flight to the dead-letter queue
    unrecorded and unrun (a review found it), and so did a paused queue's copies that Service Bus
    throttled for a while (another review); Storage spends a dequeue. Anything but an outage raises
    at once."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + KIT_OUTAGE_WAIT
    pause = 0.5
    while True:
        try:
            return await step()
        except ProviderUnavailable as exc:
            if loop.time() + pause > give_up:
                raise
            log.warning("%s; trying again in %.1f s", first_line(exc), pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 8.0)


class FunctionsHost:
    """One per Functions worker process: the runtime is built and opened on the first invocation (never
    at import), then shared by every function of the process."""

    def __init__(
        self,
        app: QueueingApp,
        settings: QueueingSettings,
        *,
        runtime: Runtime | None = None,
        run_bound: RunBound | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self._runtime = runtime
        self._opening: asyncio.Lock | None = None
        #: the host's own bound on a run (its functionTimeout): see :func:`function_timeout_bound`
        self.run_bound = run_bound
        if runtime is not None:
            self._bound(runtime)

    def _bound(self, rt: Runtime) -> None:
        if self.run_bound is not None:
            rt.pipeline.run_bound = self.run_bound.tighter(rt.pipeline.run_bound)

    async def runtime(self) -> Runtime:
        if self._runtime is None or not self._runtime.is_open:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._runtime is None:
                    self._runtime = Runtime(
                        instrumented(self.app, self.settings),
                        make_provider(self.settings),
                        pause_recheck=timedelta(seconds=self.settings.pause_recheck_seconds),
                        waiting_recheck=timedelta(seconds=max(30.0, self.settings.pause_recheck_seconds)),
                        # history a store outage held back, on the instance's disk: the next invocation
                        # (or the instance's next process) writes it (it was memory only here)
                        history_journal=journal_dir(self.settings),
                    )
                    self._bound(self._runtime)
                try:
                    await self._runtime.open()
                except BaseException:
                    # release what the half-open provider made (clients, credential sessions); the next
                    # invocation builds a fresh runtime rather than reusing closed clients
                    failed, self._runtime = self._runtime, None
                    with contextlib.suppress(Exception):
                        await failed.provider.close()
                    raise
        return self._runtime

    async def close(self) -> None:
        """Close the runtime (a worker process never needs to; tests and tools do)."""
        if self._runtime is not None:
            await self._runtime.close()

    # -- queue triggers ----------------------------------------------------------------------------
    async def _through_outages(self, step: Callable[[Runtime], Awaitable[T]]) -> tuple[Runtime, T]:
        """The runtime and what ``step`` gives, the kit's own stores' brief outages waited out
        (:func:`outlasting`)."""

        async def once() -> tuple[Runtime, T]:
            rt = await self.runtime()
            return rt, await step(rt)

        return await outlasting(once)

    async def on_storage_message(self, sub: Subscription, msg: func.QueueMessage) -> Settlement:
        # host.json's messageEncoding is "none": the host passes the queue text as it is, and the kit
        # reads base64 (what it sends) or plain text (another producer's, the v12 SDK's default). With
        # "base64" the host failed on plain text before the function was called, 5 times, then moved
        # it to -poison with no reason and no history
        from queueing_core.providers.storage_queue import decode_body, storage_delivery

        text = decode_body(msg.get_body().decode("utf-8", errors="replace"))
        # (as the worker's receive: an envelope too large for any copy of it is dead-lettered unrun)
        delivery = storage_delivery(text, queue=sub.queue, delivery_count=msg.dequeue_count or 1)
        rt, settlement = await self._through_outages(
            lambda rt: rt.process(delivery, cancel_poll=self.settings.cancel_poll, slot_wait=SLOT_WAIT)
        )
        ahead = rt.history_ahead([settlement])  # a crash after the settlement still leaves the history
        try:
            await settle_storage(rt.provider, settlement)
        except BaseException:
            rt.history_not_settled(ahead)
            raise
        rt.history_applied([settlement], ahead)
        await rt.record([settlement], ahead)
        return settlement

    async def on_servicebus_message(self, sub: Subscription, msg: Any, actions: Any) -> Settlement:
        from queueing_core.providers.servicebus import _text

        from .servicebus_delivery import delivery_number

        delivery = Delivery.of(_text(msg), queue=sub.queue, delivery_count=delivery_number(msg))

        async def processed(rt: Runtime) -> Settlement | None:
            if await _known_duplicate(rt.tracker, delivery, msg, actions):
                return None
            return await rt.process(delivery, cancel_poll=self.settings.cancel_poll, slot_wait=SLOT_WAIT)

        rt, done = await self._through_outages(processed)
        if done is None:
            return Settlement(delivery, Complete())
        settlement = done
        ahead = rt.history_ahead([settlement])  # a crash after the settlement still leaves the history
        try:
            await settle_servicebus(rt.provider, settlement, msg, actions, tracker=rt.tracker)
        except BaseException:
            rt.history_not_settled(ahead)
            raise
        rt.history_applied([settlement], ahead)
        await rt.record([settlement], ahead)
        return settlement

    # -- timers ------------------------------------------------------------------------------------
    async def process_sql(self, budget: float) -> None:
        """Claim and process batches until idle or until ``budget`` seconds have passed; handlers still
        running then get :data:`PROCESSOR_STOP_GRACE` (at most a fifth of the budget) to finish, and one
        still running after that is cut, a failed attempt if it had run the whole budget
        (``Worker.drain``)."""
        from queueing_core.worker import Worker

        rt = await self.runtime()
        # schedules have a timer of their own (run_schedules), not a share of the processor's budget
        worker = Worker(
            rt,
            shutdown_timeout=min(PROCESSOR_STOP_GRACE, budget / 5),
            poll_min=0.05,
            poll_max=1.0,
            schedules=False,
        )
        await worker.drain(budget)

    async def sweep_leases(self) -> dict[str, int]:
        """Expired leases back to retry (or Abandoned), overdue waiting messages to Expired."""
        from queueing_core.providers.sql.maintenance import expire_waiting, sweep_leases
        from queueing_core.providers.sql.provider import SqlProvider

        rt = await self.runtime()
        provider = rt.provider
        assert isinstance(provider, SqlProvider)
        now = utcnow()
        # lapsed on the database's time, on which every host writes its leases
        done = await sweep_leases(provider, self.app, now, lease_now=await provider.lease_time())
        done["expired"] = await expire_waiting(provider, now)
        return done

    async def dispatch_delayed(self, budget: float) -> dict[str, int]:
        """Forward what is due in the delayed store, within ``budget`` seconds."""
        rt = await self.runtime()
        dispatch = getattr(rt.provider, "dispatch_due", None)
        return {"forwarded": await dispatch(budget)} if dispatch is not None else {}

    async def run_schedules(self) -> dict[str, int]:
        """Fire the ticks that are due (the kit's schedules timer)."""
        from queueing_core.scheduler import Scheduler

        rt = await self.runtime()
        grace = timedelta(seconds=self.settings.schedule_grace_seconds)
        # a tick waits for the next timer run: its grace counts from there, or a run that comes a
        # little late would read the first ticks of the interval as missed (and drop them)
        interval = longest_interval(self.settings.functions_schedules_schedule)
        grace += interval
        # a tick whose send failed is tried again by the next run at the soonest
        return {"ticks": await Scheduler(rt, grace=grace, retry_gap=interval).run_due()}

    async def prune_ticks(self) -> dict[str, int]:
        from queueing_core.scheduler import Scheduler

        if not len(self.app.schedules):
            return {}
        return {"ticks_pruned": await Scheduler(await self.runtime()).prune()}

    async def retention(self) -> dict[str, int]:
        """SQL: archive and delete by the retention policy; cloud transports: prune old history. Old
        schedule ticks are pruned too."""
        rt = await self.runtime()
        provider = rt.provider
        pruned = await self.prune_ticks()
        if provider.transport.value == "sql":
            from queueing_core.providers.sql.maintenance import retain
            from queueing_core.providers.sql.provider import SqlProvider

            assert isinstance(provider, SqlProvider)
            return {**await retain(provider, self.app, utcnow()), **pruned}
        maintain = getattr(provider, "maintain", None)
        if maintain is not None:
            return {**await maintain(self.app), **pruned}
        # Service Bus has no upkeep of its own, but its history is in Tables too: without this the
        # history table would grow for ever (nothing else prunes it in Functions)
        prune = getattr(rt.tracker, "prune", None)
        if prune is None:
            return pruned
        return {"history_pruned": await prune(utcnow(), provider.capabilities.dead_letters_kept), **pruned}


@functools.cache
def longest_interval(ncrontab: str) -> timedelta:
    """The longest wait between two runs of a six-field NCRONTAB timer (seconds first), over its
    next 20,000 runs (a week of one every 10 s in working hours) or 400 days. A timer croniter cannot
    read (or that never fires) adds nothing, with a warning."""
    from croniter import croniter

    start = datetime(2026, 1, 1)  # the fires' pattern, not the present, matters: any fixed start
    longest, last = timedelta(0), start
    try:
        fires = croniter(ncrontab, start, second_at_beginning=True)
        for _ in range(20_000):
            fire = fires.get_next(datetime)
            longest, last = max(longest, fire - last), fire
            if fire - start > timedelta(days=400):
                break
    except Exception as exc:
        log.warning("could not read the timer %r (%s): the schedules' grace is not widened", ncrontab, exc)
        return timedelta(0)
    return longest


async def settle_storage(provider: Any, s: Settlement) -> None:
    """Only what returning cannot say: copies for later, poison for dead letters (see the table above)."""
    d, decision = s.delivery, s.decision
    now = utcnow()
    if isinstance(decision, DeadLetter):
        await outlasting(lambda: provider.dead_letter(d, decision, now))
    elif isinstance(decision, RetryAfter | Defer | Release):
        from queueing_core.providers.storage_queue import copy_for_later  # (a Storage app's alone)

        assert d.envelope is not None, "malformed messages are always dead-lettered"
        due = _due(decision, now)
        # a due beyond the visibility limit goes in the copy, or it would run when the limit ends
        env = copy_for_later(d.copy_after(decision), due, now)
        await outlasting(lambda: provider.put(d.queue, env, due - now, now))


async def settle_servicebus(
    provider: Any, s: Settlement, msg: Any, actions: Any, *, tracker: Any = None
) -> None:
    # ServiceBusMessageActions blocks on a gRPC call to the host: in a thread, so the event loop (and
    # every other invocation on it) keeps running meanwhile
    from queueing_core.providers.servicebus import dead_letter_text  # (a Service Bus app's alone)

    d, decision = s.delivery, s.decision

    async def taking_off(call: Callable[[], object]) -> None:
        """A settlement that takes the message off its queue (complete, dead-letter). One that failed
        may have been applied all the same, its answer lost on the way back through the host: when the
        message is no longer in its queue, the run's outcome is recorded unless a later run's was (as
        the worker does, ``Delivery.unconfirmed``). Raised on, the history said what it said before
        the run, for a message completed or dead-lettered (found in review)."""
        try:
            await asyncio.to_thread(call)
        except Exception as exc:
            sequence = getattr(msg, "sequence_number", None)
            if sequence is None or await provider.gone_from_queue(d.queue, sequence) is not True:
                raise
            d.unconfirmed = True
            d.refuse(f"the host's settlement failed ({first_line(exc)}) and the message left its queue")

    if isinstance(decision, Expire):
        await taking_off(
            lambda: actions.deadletter(
                msg,
                deadletter_reason=DeadLetterReason.EXPIRED.pascal,
                deadletter_error_description=f"expired at {decision.expired_at.isoformat()}",
            )
        )
    elif isinstance(decision, DeadLetter):
        await taking_off(
            lambda: actions.deadletter(
                msg,
                deadletter_reason=decision.reason.pascal,
                deadletter_error_description=dead_letter_text(decision.description),
            )
        )
    elif isinstance(decision, RetryAfter | Defer | Release):
        assert d.envelope is not None, "malformed messages are always dead-lettered"
        env = d.copy_after(decision)

        async def copy_sent() -> bool:
            # Renewing the lock first proves this run still holds the message: a run whose lock lapsed
            # must send no copy, or the message runs again after the run that holds it now has settled
            # it; so before each try of the send, when an outage is waited out. (A renewal that failed
            # for another reason leaves the message locked until its lock lapses: it comes back,
            # nothing is lost.)
            try:
                await asyncio.to_thread(actions.renew_message_lock, msg)
            except Exception as exc:
                d.refuse(f"renewing the lock failed: {first_line(exc)}")
                return False
            # the copy first: if completing fails after it, a duplicate beats a loss (as does a send
            # whose answer an outage lost, tried again)
            await provider.send_copy(d.queue, env, _due(decision, utcnow()))
            return True

        if not await outlasting(copy_sent):
            return
        try:
            await asyncio.to_thread(actions.complete, msg)
        except Exception as exc:
            # The copy is out and carries the outcome on; the original comes back (its lock lapses).
            # Its sequence number goes into the history at once, where its return is recognised
            # (_known_duplicate), rather than run again beside the copy.
            sequence = getattr(msg, "sequence_number", None)
            d.left_behind = None if sequence is None else str(sequence)
            log.warning(
                "completing message %s on %s after sending its copy failed (%s): the original will come "
                "back and is then completed as a duplicate",
                d.envelope.message_id,
                d.queue,
                first_line(exc),
            )
            note = getattr(tracker, "note_copied", None)
            if note is not None and d.left_behind is not None:
                try:
                    await note(d.envelope.message_id, d.left_behind)
                except Exception as note_exc:  # the history write after settling carries it too
                    log.warning("could not note the copy of %s: %s", d.envelope.message_id, note_exc)
    else:
        await taking_off(lambda: actions.complete(msg))


async def _known_duplicate(tracker: Any, d: Delivery, msg: Any, actions: Any) -> bool:
    """As the worker's receive asks (``known_duplicate``): an original that came back after its copy was
    sent (see ``settle_servicebus``) is completed without running the handler."""
    from queueing_core.providers.servicebus import known_duplicate  # (only a Service Bus app loads it)

    from .servicebus_delivery import delivery_number

    return await known_duplicate(
        tracker,
        d,
        getattr(msg, "sequence_number", None),
        delivery_number(msg) - 1,  # earlier deliveries, as the SDK's own count says (0: the first)
        lambda: asyncio.to_thread(actions.complete, msg),
    )


def _due(decision: RetryAfter | Defer | Release, now: datetime) -> datetime:
    if isinstance(decision, RetryAfter):
        return now + decision.delay
    if isinstance(decision, Defer):
        return decision.until
    return now
