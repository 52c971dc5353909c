"""The long-running host: one consumer loop per subscribed queue.

- Receives only what it can run: ``max_concurrency x prefetch`` per type, never more.
- Receives ahead (a provider whose receives may overlap): while claims come back full, a second claim
  runs while the first is on its way, always with ``receives_in_flight=2``, and with ``"auto"`` (the
  default) while this worker is the only one holding leases and the second claim pays
  (:mod:`queueing_core.overlap`); slots a claim in flight may fill count as taken, so the cap above holds.
- Polls adaptively: straight again while batches come back full, a short pause after a
  partial batch, doubling up to ``poll_max`` while idle; a provider with push wake-ups (NOTIFY,
  in-memory) cuts the sleep short when work arrives.
- Settles in small batches (one round-trip for many completions) and renews leases while handlers run.
- Shuts down gracefully, and within a bound: on SIGTERM/SIGINT it stops receiving, lets claims in
  flight come back (their messages are given back, not run) and running handlers finish until
  ``shutdown_timeout`` from the stop, then cancels what is left and releases those leases so another
  worker can take them at once. A second signal skips the wait. A claim still waiting on the database
  at the deadline gets ``CLAIM_GRACE`` (10 s) more: what it brings then is given back at once, through
  the same fenced release as a cancelled handler's message; if it never comes back the stop goes on
  without it and its rows come back when their lease lapses. The final settlement flush and the
  provider's close each get what is left of the deadline, at least ``CLOSE_FLOOR`` (5 s); a settlement
  not committed by then comes back when its lease lapses (at-least-once). So a stop takes at most
  ``shutdown_timeout`` + 20 s, whatever the database does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, cast

from .app import Subscription
from .clock import Clock, utcnow
from .control import ControlState, circuit
from .decisions import Defer, Release
from .errors import ProviderUnavailable, first_line
from .messages import MessageStatus
from .overlap import GATE_EVERY, STALE, Overlap
from .runtime import HistoryAhead, Runtime, default_worker_id
from .transport import (
    Delivery,
    HasBackgroundTasks,
    KnowsClaimers,
    Maintains,
    OwnsLeases,
    Provider,
    Settlement,
    SettlesWithClaims,
)

log = logging.getLogger("queueing.worker")

#: after the stop's deadline, how long a claim still running may take to come back (its messages are
#: then given back at once) and cancelled handlers may take to end, before the stop goes on without them
CLAIM_GRACE = 10.0
#: the least time the final settlement flush, and then the provider's close, each get: what is left of
#: the stop's deadline, and never less than this
CLOSE_FLOOR = 5.0


async def _within(aw: Awaitable[Any], timeout: float) -> bool:
    """Await ``aw`` for at most ``timeout`` seconds: True if it finished (its error raised), False if
    not. Then it is cancelled and left, not awaited: a cancelled database call may itself wait on the
    database (a connection given back to its pool is rolled back first), and the stop must not."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task}, timeout=max(0.0, timeout))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        task.add_done_callback(_ignored)
        return False
    task.result()
    return True


def _ignored(task: asyncio.Future[Any]) -> None:
    """A task left behind at a stop: its outcome is read, so asyncio does not log it as unretrieved."""
    if not task.cancelled():
        task.exception()


def _held(state: ControlState, sub: Subscription) -> bool:
    """Paused, or a circuit that admits nothing now: receiving would only hand the work back."""
    if state.is_paused(sub.queue, sub.type_name):
        return True
    return _admission(state, sub) is circuit.Admission.HOLD


def _admission(state: ControlState, sub: Subscription) -> circuit.Admission:
    if sub.options.circuit_breaker is None:
        return circuit.Admission.RUN
    return circuit.admission(state.circuit(sub.type_name), utcnow())


def _combined(provider: Provider) -> bool:
    """The provider settles a batch with its next claim (one commit for both), right now."""
    # the class is asked once (a check against a runtime protocol walks the protocol's members each
    # time, and the consumer asks before every claim); a class without the methods may still have an
    # instance that answers for them (one that hands on its attributes), so that one is asked itself
    offers = _offers_combined(type(provider)) or isinstance(provider, SettlesWithClaims)
    return offers and cast(SettlesWithClaims, provider).settles_with_claims()


@functools.cache
def _offers_combined(cls: type) -> bool:
    """The provider's class has the combined call."""
    return issubclass(cls, SettlesWithClaims)


def lease_owner(runtime: Runtime, worker_id: str | None) -> str:
    """The id the worker logs under: the provider's lease owner where it claims under one, so a log
    line and the ``locked_by`` column name the same worker; otherwise ``worker_id`` or a fresh id."""
    provider = runtime.provider
    if isinstance(provider, OwnsLeases):
        if worker_id is not None and worker_id != provider.worker_id:
            raise ValueError(
                f"worker_id {worker_id!r} differs from the provider's lease owner {provider.worker_id!r}: "
                "give the id to the provider (QUEUEING_WORKER_ID) and leave the worker's unset"
            )
        return provider.worker_id
    return worker_id or default_worker_id()


def _refill_at(capacity: int, batch: int) -> int:
    """Free slots at which a consumer with handlers running claims again: half its slots, or a full
    batch if that is fewer (full pages, fewer receive round trips)."""
    return min(batch, max(1, capacity // 2))


def _measure(overlap: Overlap, got: int, want: int) -> None:
    """A claim came back with ``got`` of the ``want`` rows it asked for: full, it counts in ``overlap``'s
    trial; short, the queue is drained and a trial under way ends."""
    if got >= want:
        overlap.returned(got)
    else:
        overlap.drained()


#: how long a message whose processing failed in the kit itself (not in its handler) waits to run again
PIPELINE_ERROR_WAIT = timedelta(seconds=10)


def _released(delivery: Delivery) -> Settlement:
    """A message the host gives back untouched as it stops (no attempt used): a handler cancelled at
    the deadline, or a claim that came back after it."""
    return Settlement(delivery, Release("host shutting down"))


def _parts_of(ahead: HistoryAhead, settlements: list[Settlement]) -> HistoryAhead:
    """What ``ahead`` journaled for ``settlements`` alone (part of a batch settled apart)."""
    part = HistoryAhead()
    for s in settlements:
        key = id(s.delivery)
        if key in ahead.records:
            part.records[key] = ahead.records[key]
        if key in ahead.rows:
            part.rows[key] = ahead.rows[key]
    return part


class PollBackoff:
    def __init__(self, minimum: float, maximum: float) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self.current = minimum

    def after(self, received: int, requested: int) -> float:
        if received >= requested:
            self.current = self.minimum
            return 0.0
        if received:
            self.current = self.minimum
            return self.minimum
        delay = self.current
        self.current = min(self.maximum, self.current * 2)
        return delay

    def failure(self) -> float:
        self.current = min(self.maximum * 5, max(self.current * 2, 0.5))
        return self.current


@dataclass
class _SubState:
    in_flight: int = 0
    #: the consumer is awaiting a claim of its own (not one beside it): a stop waits for the consumer
    claiming: bool = False
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event)


class Settler:
    """Collects settlements and hands them to the provider in batches; ``on_settled`` hears of each
    batch once the provider has committed it (or given up on it), which is when its leases may lapse.

    With a provider that settles with its claims (:class:`SettlesWithClaims`), a consumer about to
    claim says so (:meth:`expecting`) and takes the buffered settlements into its claim's
    transaction: one commit for both. The settler holds its own flush for such a claim, but never for
    long: it flushes itself once the buffer is a full batch, once no consumer is about to claim (all
    idle in their wait for work, paused, stopping), and at the latest ``hold`` seconds after its linger
    (a claim comes as soon as enough handlers finish; when they take longer, the settlements of those
    that finished must not wait for them: their leases are renewed and their results unseen meanwhile).
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        batch: int = 200,
        linger: float = 0.002,
        hold: float = 0.02,
        on_settled: Callable[[list[Settlement]], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.batch = batch
        self.linger = linger
        self.hold = hold
        #: the pause before a settlement's second try, doubled for each try after it (up to 5 s)
        self.backoff = 0.2
        self.on_settled = on_settled
        self._buf: list[Settlement] = []
        #: batches a claim took and gave back (its transaction failed): settled first, with retries
        self._returned: list[tuple[list[Settlement], HistoryAhead]] = []
        self._ready = asyncio.Event()
        #: something the held flush waits on changed (a take, a full buffer, a claim no longer coming)
        self._changed = asyncio.Event()
        self._expecting = 0  # consumers about to claim (see ``expecting``)
        self._closing = False
        #: settlements on their way to the provider now (a flush's chunk, a claim's taken batch)
        self._on_the_way = 0
        self._task: asyncio.Task[None] | None = None
        # history is written by one task, in settlement order, while the next batch settles
        self._history: asyncio.Queue[tuple[list[Settlement], HistoryAhead] | None] = asyncio.Queue()
        self._recorder: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="queueing-settler")
        self._recorder = asyncio.create_task(self._record(), name="queueing-history")

    async def _record(self) -> None:
        done = False
        while not done:
            item = await self._history.get()
            chunk: list[Settlement] = []
            ahead = HistoryAhead()
            done = item is None
            if item is not None:
                chunk, ahead = list(item[0]), item[1]
            # a slow store lets work pile up: write all that waits in one go (fewer, fuller requests)
            while not done and not self._history.empty():
                more = self._history.get_nowait()
                if more is None:
                    done = True
                else:
                    chunk += more[0]
                    ahead.records.update(more[1].records)
                    ahead.rows.update(more[1].rows)
            if chunk:
                try:
                    await self.runtime.record(chunk, ahead)
                except Exception:
                    # (these are settled: only their history is missing; raised on, it ended the task,
                    # and no later settlement's history was written)
                    log.exception("could not record the history of %d settled message(s)", len(chunk))

    def add(self, settlement: Settlement) -> None:
        self._buf.append(settlement)
        self._ready.set()
        if len(self._buf) >= self.batch:
            self._changed.set()

    # -- settling with a claim -----------------------------------------------------------------------
    @contextlib.contextmanager
    def expecting(self, claim: bool = True) -> Iterator[None]:
        """A consumer is about to claim (while inside): the settler holds its flush for that claim."""
        if not claim:
            yield
            return
        self._expecting += 1
        try:
            yield
        finally:
            self._expecting -= 1
            if not self._expecting:
                self._changed.set()
                if self._buf:
                    self._ready.set()  # no claim is coming for them now: the settler's own flush

    async def claim_with(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        """Claim from ``sub`` with the buffered settlements (up to a batch) in the claim's transaction
        (the provider must offer :class:`SettlesWithClaims` now). Committed: the settlements are done as
        after a flush of the settler's own. Failed: nothing was settled nor claimed; the settlements go
        back to the settler, which settles them itself with its retries, and the failure is raised."""
        provider = self.runtime.provider
        assert isinstance(provider, SettlesWithClaims)
        with self.expecting():
            taken = self.take()
            if taken is None:
                return await provider.receive(sub, max_messages)
            self._on_the_way += len(taken[0])
            try:
                batch = await provider.settle_and_receive(taken[0], sub, max_messages)
            except BaseException:
                self.give_back(*taken)
                raise
            finally:
                self._on_the_way -= len(taken[0])
            self._applied(*taken)
            return batch

    def take(self) -> tuple[list[Settlement], HistoryAhead] | None:
        """Up to a batch of the buffered settlements, for the caller's claim to commit (None: none, or
        none whose history record could be made: see :meth:`_journal`); the caller reports back with
        :meth:`_applied` or :meth:`give_back` (see :meth:`claim_with`)."""
        if not self._buf:
            return None
        chunk, self._buf = self._buf[: self.batch], self._buf[self.batch :]
        self._changed.set()
        # journaled before the settlement, as ``_flush`` does
        chunk, ahead = self._journal(chunk)
        return (chunk, ahead) if chunk else None

    def give_back(self, chunk: list[Settlement], ahead: HistoryAhead) -> None:
        """The claim's transaction failed (nothing settled): the settler settles ``chunk`` itself, first
        and with its retries; the leases are renewed until then."""
        self._returned.append((chunk, ahead))
        self._ready.set()
        self._changed.set()

    def _held(self) -> bool:
        return bool(
            self._buf
            and self._expecting
            and len(self._buf) < self.batch
            and not self._closing
            and not self._returned
        )

    async def _hold_for_claim(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.hold
        while self._held():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def _run(self) -> None:
        while not (self._closing and not self._buf and not self._returned):
            await self._ready.wait()
            # cleared before looking: whatever arrives from here on (a settlement, a batch a failed
            # claim gave back) wakes the next pass, so nothing waits in a buffer for an unrelated event
            self._ready.clear()
            while self._returned:
                await self._flush(*self._returned.pop(0))
            if self.linger and self._buf and len(self._buf) < self.batch and not self._closing:
                await asyncio.sleep(self.linger)  # let a burst of completions share one round-trip
            if self._held():
                await self._hold_for_claim()  # a consumer's claim may take them into its commit
            while self._returned or self._buf:
                if self._returned:  # given back during the hold or a flush: first, with retries
                    await self._flush(*self._returned.pop(0))
                    continue
                chunk, self._buf = self._buf[: self.batch], self._buf[self.batch :]
                await self._flush(chunk)
                if self._held():
                    # a claim is coming for what came in meanwhile: round again, to the bounded hold
                    # (which the linger before it would only delay)
                    self._ready.set()
                    break
                if self.linger and self._buf and len(self._buf) < self.batch and not self._closing:
                    # what came in during that flush lingers as the first did: flushed at once, the
                    # batches would shrink to what arrives during one settle call, so the faster the
                    # call the more commits (on SQLite a batch of 10 costs about as much as one of 50)
                    await asyncio.sleep(self.linger)
                if self._held():
                    # what came in meanwhile goes round again, under the bounded hold: a claim is
                    # coming for it
                    self._ready.set()
                    break

    async def _flush(self, chunk: list[Settlement], ahead: HistoryAhead | None = None) -> None:
        on_the_way = len(chunk)
        self._on_the_way += on_the_way
        try:
            # journaled before the settlement: a crash after it still leaves the history to be written
            if ahead is None:
                chunk, ahead = self._journal(chunk)
            await self._settle(chunk, ahead)
        except Exception:
            # a fault of the kit's own (the store's are retried in ``_settle``): raised on, it ended the
            # settler's task, and nothing more was settled on this worker. The chunk is no longer
            # renewed: settled, or left to lapse and delivered again (at-least-once, nothing lost)
            log.exception("could not settle %d message(s); those not settled are delivered again", len(chunk))
            self._settled(chunk)
        finally:
            self._on_the_way -= on_the_way

    def _journal(self, chunk: list[Settlement]) -> tuple[list[Settlement], HistoryAhead]:
        """``chunk``'s history records, made and journaled before it is settled, and the settlements
        they were made for. One whose record cannot be made (a value no record holds) is not settled:
        it is no longer renewed, its lease lapses and it is delivered again (at-least-once, nothing
        lost). Raised on, it failed the whole chunk, and ended the settler's task."""
        with contextlib.suppress(Exception):  # (failed: for which one? each is made on its own)
            return chunk, self.runtime.history_ahead(chunk)
        kept: list[Settlement] = []
        ahead = HistoryAhead()
        for one in chunk:
            try:
                own = self.runtime.history_ahead([one])
            except Exception:
                env = one.delivery.envelope
                log.exception(
                    "could not make the history record of message %s (%s); not settled: it is delivered "
                    "again once its lease lapses",
                    env.message_id if env else "?",
                    type(one.decision).__name__,
                )
                self._settled([one])
                continue
            kept.append(one)
            ahead.records.update(own.records)
            ahead.rows.update(own.rows)
        return kept, ahead

    async def _settle(self, chunk: list[Settlement], ahead: HistoryAhead) -> None:
        """``chunk`` settled, with five tries; after the last, its leases are left to lapse and its
        messages run again (at-least-once, nothing lost).

        Where a batch is one transaction (``Capabilities.settles_as_one``: SQL), one settlement the
        store refuses (a value it cannot take) fails every other with it, on every try, and they would
        all lapse and run again, successes included. So the first failure that is not the store's
        absence (``ProviderUnavailable``) has the batch settled one by one (:meth:`_settle_apart`):
        once, or again for what is left if that absence cut the split short."""
        split = False
        for attempt in range(1, 6):
            try:
                await self.runtime.provider.settle(chunk)
                break
            except Exception as exc:
                if (
                    not split
                    and len(chunk) > 1
                    and not isinstance(exc, ProviderUnavailable)
                    and self.runtime.provider.capabilities.settles_as_one
                ):
                    split = True  # (what is left after it goes on as a batch)
                    log.warning(
                        "settling %d message(s) failed (%s); settling each on its own", len(chunk), exc
                    )
                    left = await self._settle_apart(chunk, ahead)
                    if left is None:
                        return
                    chunk, ahead, cut_short = left
                    # cut short by the store's absence, the split did not finish: the next failure
                    # that is not that absence may split what is left again
                    split = not cut_short
                if attempt == 5:
                    # what took effect before a later part of the batch failed is recorded: it is done.
                    # So is what may have: a message gone from its queue after a try whose answer was
                    # lost (``Delivery.unconfirmed``), recorded by compare-and-set unless a later run
                    # recorded its own (dropped here, its history said Pending for good)
                    for s in chunk:
                        if s.delivery.unconfirmed and not s.delivery.applied:
                            s.delivery.refused = True
                    done = [s for s in chunk if s.delivery.applied or s.delivery.unconfirmed]
                    chunk = [s for s in chunk if not (s.delivery.applied or s.delivery.unconfirmed)]
                    if chunk:
                        log.error(
                            "could not settle %d message(s) after %d tries: %s", len(chunk), attempt, exc
                        )
                    if done:
                        self._applied(done, _parts_of(ahead, done))
                    self.runtime.history_not_settled(_parts_of(ahead, chunk))
                    self._settled(chunk)
                    return
                log.warning("settling %d message(s) failed (%s); retrying", len(chunk), exc)
                await asyncio.sleep(min(5.0, self.backoff * 2**attempt))
        self._applied(chunk, ahead)

    async def _settle_apart(
        self, chunk: list[Settlement], ahead: HistoryAhead
    ) -> tuple[list[Settlement], HistoryAhead, bool] | None:
        """Each settlement of ``chunk`` on its own, one try each, no pause: those that settle are done.
        If some settled, those the store refused alone are its refusals of their own values: given up
        (their leases lapse), and None. Otherwise what goes on as a batch, with its tries and pauses:
        all of it if none settled (the store, not the data, is then the likelier cause: a failover's
        read-only server, an exhausted pool), or the refused and the rest from the first that met
        the store's absence; and whether it was that absence that cut the split short."""
        settled = 0
        refused: list[Settlement] = []
        error: BaseException | None = None
        for i, one in enumerate(chunk):
            try:
                await self.runtime.provider.settle([one])
            except ProviderUnavailable:
                rest = refused + chunk[i:]
                return rest, _parts_of(ahead, rest), True
            except Exception as exc:
                refused.append(one)
                error = exc
                continue
            self._applied([one], _parts_of(ahead, [one]))
            settled += 1
        if not settled:
            return chunk, ahead, False
        if refused:
            log.error(
                "could not settle %d message(s) of a batch whose other %d settled: %s",
                len(refused),
                settled,
                error,
            )
            self.runtime.history_not_settled(_parts_of(ahead, refused))
            self._settled(refused)
        return None

    def _applied(self, chunk: list[Settlement], ahead: HistoryAhead) -> None:
        # the history queued first (no await between these calls): whatever fails after it, what the
        # store applied has its outcome recorded, since it will not be delivered again
        self._history.put_nowait((chunk, ahead))
        self.runtime.history_applied(chunk, ahead)
        self._settled(chunk)

    def _settled(self, chunk: list[Settlement]) -> None:
        if self.on_settled is not None:
            self.on_settled(chunk)

    @property
    def unsettled(self) -> int:
        """Settlements not committed yet: buffered, given back by a claim, or on their way."""
        return len(self._buf) + sum(len(chunk) for chunk, _ in self._returned) + self._on_the_way

    async def close(self) -> None:
        self._closing = True
        self._ready.set()
        self._changed.set()
        if self._task is not None:
            await self._task
        if self._recorder is not None:
            self._history.put_nowait(None)  # after everything queued: the history is complete
            await self._recorder

    async def close_within(self, timeout: float) -> bool:
        """:meth:`close`, for at most ``timeout`` seconds (a database that stopped answering must not
        hold the host): False if it did not finish. Then the settler's tasks are cancelled and left,
        and what was not committed is not lost: those messages' leases lapse and they are delivered
        again (at-least-once)."""
        closed = await _within(self.close(), timeout)
        # (closed, there may still be settlements riding in a claim the stop left behind)
        left = self.unsettled
        if not closed:
            for task in (self._task, self._recorder):
                if task is not None:
                    task.cancel()
        if left:
            log.warning(
                "%d settlement(s) not committed by the stop (the database did not answer within "
                "%.1fs, or they ride in a claim the stop went on without): their messages are "
                "delivered again once their leases lapse (at-least-once)",
                left,
                timeout,
            )
        elif not closed:
            log.warning("the history of the last settlements was not written within %.1fs", timeout)
        return closed


class Worker:
    def __init__(
        self,
        runtime: Runtime,
        *,
        worker_id: str | None = None,
        queues: Collection[str] | None = None,
        shutdown_timeout: float = 30.0,
        poll_min: float = 0.05,
        poll_max: float = 2.0,
        pause_poll: float = 1.0,
        batch_size: int = 100,
        prefetch: int = 1,
        receives_in_flight: int | Literal["auto"] = "auto",
        settle_batch: int = 200,
        settle_linger: float = 0.002,
        settle_hold: float = 0.02,
        schedules: bool = True,
        schedule_grace: timedelta = timedelta(seconds=60),
        cancel_poll: float = 1.0,
    ) -> None:
        self.runtime = runtime
        self.worker_id = lease_owner(runtime, worker_id)
        self.queues = set(queues) if queues else None
        self.shutdown_timeout = shutdown_timeout
        self.poll_min = poll_min
        self.poll_max = poll_max
        self.pause_poll = pause_poll
        self.batch_size = batch_size
        self.prefetch = max(1, prefetch)
        #: receives per queue at once: 2 lets a second claim run while the first is on its way (where
        #: the provider's receives may overlap), so two round trips' waits overlap while the queue is full;
        #: ``"auto"``: 1 or 2, decided per queue as it runs (see :mod:`queueing_core.overlap`)
        self.receives_in_flight: int | Literal["auto"] = (
            "auto" if receives_in_flight == "auto" else min(2, max(1, receives_in_flight))
        )
        #: the provider's last answer to "is this worker the only one holding leases?", and when
        self._sole: tuple[float, bool] | None = None
        #: that question on its way (asked in the background: a consumer never waits for the answer)
        self._asking: asyncio.Task[None] | None = None
        #: when that question was asked, and whether the last one failed (logged once per failing spell)
        self._asked_at = 0.0
        self._asking_failed = False
        #: whether the provider can tell at all (looked up once: an ``isinstance`` on a protocol is slow)
        self._knows_claimers: bool | None = None
        #: the queues whose last claims came back full (``"auto"``: a second claim only while one is)
        self._backlogged: set[str] = set()
        self.cancel_poll = cancel_poll
        self.settler = Settler(
            runtime, batch=settle_batch, linger=settle_linger, hold=settle_hold, on_settled=self._settled
        )
        self._stopping = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()  # a second signal: do not wait for in-flight work
        self._handler_stop = asyncio.Event()  # what handlers see as ``ctx.cancelled``
        self._consumers: list[asyncio.Task[None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        #: the claims running beside the consumer loops (``receives_in_flight=2``): a stop waits for them,
        #: for a bounded time, as it waits for a consumer awaiting a claim of its own
        self._claims: set[asyncio.Task[list[Delivery]]] = set()
        #: the stop's deadline has passed: a claim that comes back now has its messages given back
        self._cut_off = False
        #: the stop went on without the claims still running: what they bring back is left to lapse
        self._left_behind = False
        #: see :data:`CLAIM_GRACE` and :data:`CLOSE_FLOOR`
        self.claim_grace = CLAIM_GRACE
        self.close_floor = CLOSE_FLOOR
        #: deliveries whose lease is renewed: from receipt until their settlement is committed
        self._in_flight: dict[int, Delivery] = {}
        self._subs: dict[str, _SubState] = {}
        self._renewer: asyncio.Task[None] | None = None
        self._canceller: asyncio.Task[None] | None = None
        self._maintainer: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []
        #: run the app's schedules in this host (off where a dedicated timer runs them: Functions)
        self.run_schedules = schedules
        self.schedule_grace = schedule_grace
        self._owns_runtime = False
        self._stop_waiter: asyncio.Future[Any] | None = None
        #: the stop, once begun (``shutdown``): a later call waits for it
        self._shutting_down: asyncio.Future[None] | None = None
        self.started = asyncio.Event()
        #: monotonic time of the last message received or finished (for hosts that stop when idle)
        self.last_activity = time.monotonic()
        #: why a handler the stop cancels counts a failed attempt (``drain``: its budget and the stop
        #: grace are over), and for how long it must have run to count (the budget); None (a worker's
        #: own stop) hands its message back uncounted
        self._out_of_time: tuple[str, float] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def subscriptions(self) -> list[Subscription]:
        # types without a handler are consumed too: their messages become WaitingForHandler
        subs = self.runtime.app.subscriptions()
        if self.queues is not None:
            subs = [s for s in subs if s.queue in self.queues or s.type_name in self.queues]
        return subs

    async def start(self) -> None:
        self._owns_runtime = not self.runtime.is_open  # close on shutdown only what we opened
        await self.runtime.open()
        self._stop_waiter = asyncio.ensure_future(self._stopping.wait())
        self.settler.start()
        for sub in self.subscriptions():
            self._subs[sub.type_name] = _SubState()
            self._consumers.append(asyncio.create_task(self._consume(sub), name=f"consume:{sub.queue}"))
        if self.runtime.provider.capabilities.lock_renewal:
            self._renewer = asyncio.create_task(self._renew_loop(), name="queueing-renew")
        self._canceller = asyncio.create_task(self._watch_cancels(), name="queueing-cancels")
        if isinstance(self.runtime.provider, HasBackgroundTasks):
            for job in self.runtime.provider.background_tasks():
                self._background.append(asyncio.create_task(job(), name=f"queueing-{job.__name__}"))
        if self.run_schedules and len(self.runtime.app.schedules):
            from .scheduler import Scheduler

            scheduler = Scheduler(self.runtime, grace=self.schedule_grace)
            self._background.append(asyncio.create_task(scheduler.run(), name="queueing-schedules"))
        if isinstance(self.runtime.provider, Maintains):
            self._maintainer = asyncio.create_task(
                self._maintain_loop(self.runtime.provider), name="queueing-maintain"
            )
        if self.receives_in_flight == 2 and _combined(self.runtime.provider):
            # (one claim at a time carries the settler's buffer: the second claim asked for never runs)
            log.warning(
                "receives_in_flight=%d has no effect: the provider settles with its claims, one claim at "
                "a time; QUEUEING_SETTLE_WITH_CLAIMS=false (SqlProvider(settle_with_claims=False)) for "
                "two claims in flight",
                self.receives_in_flight,
            )
        log.info(
            "worker %s started on %s: %s",
            self.worker_id,
            self.runtime.provider.transport.value,
            ", ".join(f"{s.queue}(x{s.options.max_concurrency})" for s in self.subscriptions())
            or "no handlers",
        )
        self.started.set()

    async def __aenter__(self) -> Worker:
        """``async with Worker(runtime):`` processes in the background of your own code; leaving the
        block shuts down gracefully (what :meth:`run` does on a signal)."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def request_stop(self) -> None:
        if self._stop_requested.is_set():
            log.warning("second stop request: not waiting for in-flight handlers")
            self._hurry.set()
        self._stop_requested.set()

    async def run(self, *, install_signal_handlers: bool = True) -> None:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`), then shut down gracefully."""
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
            await self._stop_requested.wait()
        finally:
            await self.shutdown()
            if install_signal_handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError):
                        loop.remove_signal_handler(sig)

    async def shutdown(self) -> None:
        """Stop, within ``shutdown_timeout`` from now plus bounded margins, whatever the database does.

        Until the deadline: no claim starts, claims in flight come back (their messages are given back,
        none starts once stopping), running handlers finish. At the deadline (at once after a second
        stop request): handlers still running are cancelled and their messages given back; a claim
        still running gets :data:`CLAIM_GRACE` more (what it brings then is given back at once, not
        run), then the stop goes on without it (its rows come back when their leases lapse). The final
        settlement flush and the provider's close each get what is left of the deadline, and at least
        :data:`CLOSE_FLOOR`; a settlement they could not commit comes back when its lease lapses.

        A second call while the first runs waits for the first to finish (bounded as it is): one stop,
        one close of the runtime, and no caller returns before the provider is closed."""
        if self._shutting_down is None:
            self._shutting_down = asyncio.ensure_future(self._shutdown())
        # every caller waits for the one stop, and a caller cancelled (a ``wait_for`` that timed out)
        # leaves it running: cancelled half-way, it would leave the handlers, the settler and the
        # provider open, and every later call would find it done and return at once. It is bounded
        # (see the docstring); its own error reaches every caller
        await asyncio.shield(self._shutting_down)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        self._stopping.set()
        for state in self._subs.values():
            state.slot_freed.set()  # a consumer waiting for a free slot (see ``_slot_freed``) sees the stop
        await self._drain_until(deadline)
        self._cut_off = True
        await self._past_the_deadline()
        self._consumers.clear()
        await self.settler.close_within(max(0.0, deadline - loop.time()) + self.close_floor)
        if self._stop_waiter is not None:
            self._stop_waiter.cancel()
        within = max(0.0, deadline - loop.time()) + self.close_floor
        if not await _within(self._close_up(), within):
            log.warning("closing the provider did not finish within %.1fs: the stop goes on", within)
        log.info("worker %s stopped", self.worker_id)

    async def _close_up(self) -> None:
        """End the background tasks (renewals, cancellation watch, maintenance, schedules) and close
        the runtime if this worker opened it."""
        helpers = [t for t in (self._renewer, self._canceller, self._maintainer, *self._background) if t]
        if self._asking is not None and not self._asking.done():
            # (cancelled, not awaited: a database that stopped answering holds a cancelled query for
            # seconds, and the answer no longer matters)
            self._asking.cancel()
            self._asking.add_done_callback(_ignored)
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if self._owns_runtime:
            await self.runtime.close()

    async def _drain_until(self, deadline: float) -> None:
        """Until ``deadline`` (or a second stop request): the consumers leave their loops, claims in
        flight come back and running handlers finish."""
        loop = asyncio.get_running_loop()
        hurry: asyncio.Future[Any] = asyncio.ensure_future(self._hurry.wait())
        told = False
        try:
            while not hurry.done():
                pending = {*(c for c in self._consumers if not c.done()), *self._tasks, *self._claims}
                remaining = deadline - loop.time()
                if not pending or remaining <= 0:
                    return
                if self._tasks and not told:
                    told = True
                    log.info("waiting up to %.0fs for %d in-flight message(s)", remaining, len(self._tasks))
                await asyncio.wait({*pending, hurry}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()

    async def _past_the_deadline(self) -> None:
        """Cancel the handlers still running (their messages are given back); wait up to
        :attr:`claim_grace` for the claims still running (what they bring is given back at once), the
        consumers still in their loops and the cancelled handlers; then cancel and leave what is left
        (a claim's rows come back when their lease lapses)."""
        loop = asyncio.get_running_loop()
        handlers = set(self._tasks)
        if handlers:
            # (a deadline of 0, or a second stop request, asks for this: no cause for a warning)
            asked = self.shutdown_timeout <= 0 or self._hurry.is_set()
            log.log(
                logging.INFO if asked else logging.WARNING,
                "releasing %d message(s) still running at the shutdown deadline"
                if self._out_of_time is None
                else "cutting short %d message(s) still running at the shutdown deadline: each that ran "
                "the whole budget counts a failed attempt",
                len(handlers),
            )
            self._handler_stop.set()
            self.runtime.pipeline.stop_running()
            for t in handlers:
                t.cancel()
        if self._claims_out():
            log.info(
                "%d claim(s) still running at the shutdown deadline: waiting up to %.0fs for them; "
                "what they bring back is given back at once",
                self._claims_out(),
                self.claim_grace,
            )
        grace_end = loop.time() + self.claim_grace
        while True:
            pending = {*(c for c in self._consumers if not c.done()), *self._tasks, *self._claims}
            remaining = grace_end - loop.time()
            if not pending or remaining <= 0:
                break
            await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        left = self._claims_out()
        if left:
            self._left_behind = True
            log.warning(
                "%d claim(s) did not come back within %.0fs of the shutdown deadline (is the database "
                "answering?): the stop goes on without them; whatever they claimed is delivered again "
                "once its lease lapses",
                left,
                self.claim_grace,
            )
        # cancelled and left, not awaited: a cancelled database call may itself wait on the database
        for task in [*self._claims, *self._consumers]:
            if not task.done():
                task.cancel()
            task.add_done_callback(_ignored)

    def _claims_out(self) -> int:
        """Claims running now: beside the consumer loops, and awaited in them."""
        return sum(not t.done() for t in self._claims) + sum(s.claiming for s in self._subs.values())

    # -- consuming ---------------------------------------------------------------------------------
    async def _until_stopping(self, aw: Awaitable[Any], timeout: float | None) -> None:
        task: asyncio.Future[Any] = asyncio.ensure_future(aw)
        assert self._stop_waiter is not None
        waiting: set[asyncio.Future[Any]] = {task, self._stop_waiter}
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # (cancelled itself too: ``asyncio.wait`` leaves what it waited on running)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def _most_claims(self) -> int:
        """The most claims a queue may have in flight (``"auto"`` decides between 1 and this)."""
        return 2 if self.receives_in_flight == "auto" else self.receives_in_flight

    def _overlaps(self, sub: Subscription, combined: bool) -> bool:
        """May a second receive for ``sub`` start while one is in flight? Only where it is asked for and
        the provider's receives may run side by side, never for an ordered queue (two claims at once
        could each take a head of the line), nor while claims carry settlements (``combined``: one
        claim takes the settler's buffer at a time)."""
        return (
            self._most_claims > 1
            and self.runtime.provider.capabilities.overlapping_receives
            and sub.handler is not None
            and not sub.options.ordered
            and not combined
        )

    def _alone(self, sub: Subscription) -> bool | None:
        """For ``"auto"``: whether this worker may try a second claim for ``sub`` now, or None when it
        does not know yet (its last answer is out of date and the question was just asked again: the
        queue's decision stays as it was, so a choice made before a quiet spell carries over to the
        next burst). Not while another of its queues is backlogged (two queues' trials would each judge
        by their own rate, at the other's expense); not while another worker holds a lease, by the
        provider's last answer; not while a question has gone unanswered for :data:`STALE` seconds.
        Asks again in the background when the answer is due; never waits."""
        backlogged = self._backlogged
        if len(backlogged) > 1 or (backlogged and sub.type_name not in backlogged):
            return False
        provider = self.runtime.provider
        if self._knows_claimers is None:
            self._knows_claimers = isinstance(provider, KnowsClaimers)
        if not self._knows_claimers:
            return False
        now = time.monotonic()
        asking = self._asking is not None and not self._asking.done()
        if asking and now - self._asked_at >= STALE:
            return False  # (a slow or silent database: one claim until it answers)
        if not asking and (self._sole is None or now - self._sole[0] >= GATE_EVERY):
            self._asked_at = now
            self._asking = asyncio.create_task(
                self._ask_alone(cast(KnowsClaimers, provider), now), name="queueing-alone"
            )
        if self._sole is not None and now - self._sole[0] < STALE:
            return self._sole[1]
        return None

    async def _ask_alone(self, provider: KnowsClaimers, asked_at: float) -> None:
        """The question, in the background; its answer dated when it was asked (a slow answer is as old
        as the question)."""
        try:
            sole = await provider.sole_claimer()
        except Exception as exc:
            if not self._asking_failed:  # (once per failing spell)
                log.warning("could not tell whether other workers claim (%s): one claim at a time", exc)
            self._asking_failed = True
            sole = False
        else:
            self._asking_failed = False
        self._sole = (asked_at, sole)

    def _two_fit(self, sub: Subscription) -> bool:
        """Whether a second claim can ever start beside a first for ``sub``: a claim starts once the free
        slots reach the refill threshold (``short`` in :meth:`_consume`), so a second one can start
        while the first is out only if the capacity holds twice that threshold (never for one slot).
        Where it cannot, ``"auto"`` asks nothing and tries nothing."""
        capacity = self._capacity(sub)
        return capacity >= 2 * _refill_at(capacity, self.batch_size)

    def _capacity(self, sub: Subscription) -> int:
        """The messages ``sub``'s consumer may hold at once, running or claimed: its handler slots times
        the prefetch; one while it has no handler (claimed only to be marked waiting)."""
        return sub.options.max_concurrency * self.prefetch if sub.handler else 1

    async def _receive(self, sub: Subscription, want: int, combined: bool) -> list[Delivery]:
        if combined:
            return await self.settler.claim_with(sub, want)
        return await self.runtime.provider.receive(sub, want)

    async def _claim_done_or_slot_freed(
        self, state: _SubState, claims: dict[asyncio.Task[list[Delivery]], int]
    ) -> None:
        """Wait until a claim in flight comes back, a handler slot frees up, or the worker stops."""
        state.slot_freed.clear()
        freed: asyncio.Future[Any] = asyncio.ensure_future(state.slot_freed.wait())
        assert self._stop_waiter is not None
        try:
            await asyncio.wait({*claims, freed, self._stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            freed.cancel()

    async def _slot_freed(self, state: _SubState) -> None:
        """Wait until a handler slot frees up or the worker stops, on the slot's event alone (``shutdown``
        sets it as it stops): a full worker waits here before every claim, and a task and a wait on two
        things each time would cost more than the claim's own bookkeeping."""
        if self._stopping.is_set():
            return  # (shutdown's wake-up already came: cleared here, it would never come again)
        state.slot_freed.clear()
        await state.slot_freed.wait()

    def _give_back(self, sub: Subscription, state: _SubState, batch: list[Delivery]) -> None:
        """A claim came back after the stop's deadline: its messages are given back at once, not run,
        as a cancelled handler's are (a release fenced by this claim's own lease: one that passed to
        another run meanwhile refuses it). A malformed one goes where every malformed delivery goes,
        through the pipeline to the dead letters: released, it would only come back."""
        malformed = [d for d in batch if d.malformed is not None or d.envelope is None]
        for delivery in batch:
            if delivery.malformed is None and delivery.envelope is not None:
                self._in_flight[id(delivery)] = delivery  # renewed until the release is committed
                self.settler.add(_released(delivery))
        self._dispatch(sub, state, malformed)

    def _dispatch(self, sub: Subscription, state: _SubState, batch: list[Delivery]) -> None:
        if batch:
            self.last_activity = time.monotonic()
        for delivery in batch:
            state.in_flight += 1
            self._in_flight[id(delivery)] = delivery
            task = asyncio.create_task(self._handle(sub, state, delivery))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _receive_failed(self, sub: Subscription, backoff: PollBackoff, *excs: BaseException) -> float:
        """The pause before the next receive after one or more failed (one pause for claims that
        failed together)."""
        delay = backoff.failure()
        for exc in excs:
            log.warning(
                "receiving from %s failed (%s: %s); retrying in %.1fs",
                sub.queue,
                type(exc).__name__,
                exc,
                delay,
            )
        return delay

    def _claim_returned(
        self,
        sub: Subscription,
        state: _SubState,
        claims: dict[asyncio.Task[list[Delivery]], int],
        came_back: list[tuple[int, int] | BaseException],
        overlap: Overlap | None,
        task: asyncio.Task[list[Delivery]],
    ) -> None:
        """A claim in flight returned (its task's done-callback): its slots stop being reserved and its
        messages start, with no await between, whatever the consumer loop is waiting on (a failed
        claim's pause, a slow control store): from here their leases are renewed. The loop learns of
        the outcome from ``came_back``."""
        want = claims.pop(task)
        if task.cancelled():
            return  # the consumer was cancelled: the claim went with it
        exc = task.exception()
        if exc is not None:
            if self._stopping.is_set():  # (the consumer has left: nobody else reads ``came_back``)
                log.warning("receiving from %s failed (%s: %s)", sub.queue, type(exc).__name__, exc)
            came_back.append(exc)
            return
        batch = task.result()
        if self._left_behind:
            return  # the stop went on without this claim: its rows come back when their leases lapse
        try:
            if self._cut_off:
                self._give_back(sub, state, batch)
                return
            self._dispatch(sub, state, batch)
        except Exception as error:  # (the loop would only log it: the consumer must hear of it)
            log.exception("could not start the messages a claim from %s returned", sub.queue)
            came_back.append(error)  # their leases lapse and the sweep gives them back
            return
        came_back.append((len(batch), want))
        if overlap is not None:
            _measure(overlap, len(batch), want)

    async def _consume(self, sub: Subscription) -> None:
        provider = self.runtime.provider
        control = self.runtime.control
        state = self._subs[sub.type_name]
        backoff = PollBackoff(self.poll_min, self.poll_max)
        # receives running beside this loop (at most ``receives_in_flight``), each with the slots it may
        # fill: reserved, so handlers running plus slots reserved never exceed the capacity
        claims: dict[asyncio.Task[list[Delivery]], int] = {}
        # what the claims that returned since the loop last looked brought (messages got, asked for) or
        # raised; their messages already run (:meth:`_claim_returned`)
        came_back: list[tuple[int, int] | BaseException] = []
        # the last claim came back full: the queue has more, so a second claim may overlap the first
        # (an empty or partial one means the queue is drained: one poller, with its backoff)
        full = False
        # ``receives_in_flight="auto"``: whether a second claim may start, decided as the queue runs
        overlap = Overlap() if self.receives_in_flight == "auto" else None
        try:
            while not self._stopping.is_set():
                # re-read: a handler registered after start-up takes over its waiting backlog
                sub = self.runtime.pipeline.subscription(sub.type_name) or sub
                capacity = self._capacity(sub)
                taken = state.in_flight + sum(claims.values())
                free = capacity - taken
                combined = _combined(provider) and sub.handler is not None
                (self._backlogged.add if full else self._backlogged.discard)(sub.type_name)
                if overlap is not None and full and self._overlaps(sub, combined) and self._two_fit(sub):
                    alone = self._alone(sub)  # (nothing awaited: what was counted above holds)
                    if alone is not None:
                        overlap.alone(alone)
                limit = self._most_claims if overlap is None else overlap.limit()
                ahead = full and limit > 1 and self._overlaps(sub, combined)
                # refill when half the slots are free (or all are): full pages, fewer receive round trips
                short = free <= 0 or (taken > 0 and free < _refill_at(capacity, self.batch_size))
                if came_back:
                    outcomes = came_back.copy()
                    came_back.clear()
                    failed = [o for o in outcomes if isinstance(o, BaseException)]
                    got = [o for o in outcomes if not isinstance(o, BaseException)]
                    # the queue has more only if every claim that returned came back full
                    full = not failed and all(n >= asked for n, asked in got)
                    delay = 0.0
                    for n, asked in got:
                        delay = backoff.after(n, asked)
                    if failed:
                        delay = self._receive_failed(sub, backoff, *failed)
                        await self._until_stopping(asyncio.sleep(delay), None)
                    elif delay > 0 and not claims:
                        await self._until_stopping(provider.wait_for_work(sub, delay), delay + 1.0)
                    continue
                if claims and (short or not ahead or len(claims) >= limit):
                    await self._claim_done_or_slot_freed(state, claims)
                    continue
                if short:
                    # the claim comes once enough of the running handlers finish: their settlements may
                    # wait for it (the settler bounds how long)
                    with self.settler.expecting(combined):
                        await self._slot_freed(state)
                    continue
                try:
                    want = min(free, self.batch_size)
                    if sub.options.circuit_breaker is not None or not provider.capabilities.filters_paused:
                        now_state = await control.state()
                        if self._stopping.is_set():
                            break  # the stop came while the control store answered: no claim starts
                        held = not provider.capabilities.filters_paused and _held(now_state, sub)
                        # a circuit not closed: one message at a time. Its cooldown over, that one is
                        # the probe. While it cools down on SQL, whose claim skips held rows itself, the
                        # cooldown may end between this read and the claim: a batch claimed then would
                        # be one probe and the rest deferred
                        probe = _admission(now_state, sub) is not circuit.Admission.RUN
                        if (held or probe) and claims:
                            # paused, probing or cooling down: no claim beside the one in flight (its batch
                            # is collected above, then this is looked at again)
                            full = False
                            continue
                        if held:
                            await self._until_stopping(asyncio.sleep(self.pause_poll), None)
                            continue
                        if probe:
                            # one message alone (the probe, or on SQL a claim that comes back empty until
                            # the cooldown ends), and none while an earlier run (perhaps the probe) is
                            # still going. Not backlogged meanwhile: another queue's claims may overlap
                            full = False
                            if state.in_flight:
                                state.slot_freed.clear()
                                await self._until_stopping(state.slot_freed.wait(), self.pause_poll)
                                continue
                            want = 1
                            ahead = False
                    if ahead:
                        # beside this loop: while it runs, the loop may start a second claim for the
                        # slots left, so two claims' round trips overlap
                        task = asyncio.create_task(self._receive(sub, want, combined))
                        self._claims.add(task)
                        task.add_done_callback(self._claims.discard)
                        claims[task] = want
                        task.add_done_callback(
                            functools.partial(self._claim_returned, sub, state, claims, came_back, overlap)
                        )
                        continue
                    # awaited in this loop, not in a task of its own (a task would start it a turn of
                    # the event loop later, and wake the loop a turn later, behind every handler ready
                    # to run: measured, a fifth fewer messages a second on SQLite). A stop waits for
                    # this consumer while it claims, up to the deadline and the claim's grace, and
                    # then cancels it (``shutdown``)
                    state.claiming = True
                    try:
                        batch = await self._receive(sub, want, combined)
                    finally:
                        state.claiming = False
                except Exception as exc:
                    full = False
                    await self._until_stopping(asyncio.sleep(self._receive_failed(sub, backoff, exc)), None)
                    continue
                if self._left_behind:
                    # the stop went on without this claim (its provider returned it even so, cancelled):
                    # the settler is closed; its rows come back when their leases lapse
                    break
                if self._cut_off:
                    self._give_back(sub, state, batch)  # (it came back after the stop's deadline)
                    break
                self._dispatch(sub, state, batch)
                if overlap is not None:
                    _measure(overlap, len(batch), want)
                full = len(batch) >= want
                delay = backoff.after(len(batch), want)
                if delay > 0:
                    await self._until_stopping(provider.wait_for_work(sub, delay), delay + 1.0)
            # stopping: a claim in flight beside this loop goes on, and its messages are dispatched as
            # it returns (the pipeline gives back at once what has not started at a stop); cancelled
            # after its commit, it would leave its rows leased until the lease runs out. The stop waits
            # for the claims (``shutdown``, bounded), not this loop.
        except asyncio.CancelledError:
            if self._stopping.is_set():
                # cancelled while stopping (by the stop, past its deadline and the claims' grace): the
                # claims beside this loop are the stop's to wait for, bounded, and then to cancel and
                # leave (waiting here for a claim held by the database could hang the stop)
                raise
            # the consumer itself cancelled (not a stop): its claims go with it, as a claim it awaited
            # would; one that returned anyway has its messages dispatched by its callback. Waited for, so
            # none is left behind running
            running = set(claims)
            for task in running:
                task.cancel()
            while running:  # (cancelled again meanwhile: still waited for, so none returns after us)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(running)
                running = {t for t in running if not t.done()}
            raise
        finally:
            # (a queue that is no longer consumed holds no other queue to one claim)
            self._backlogged.discard(sub.type_name)
        for outcome in came_back:
            if isinstance(outcome, BaseException):
                log.warning(
                    "receiving from %s failed (%s: %s)",
                    sub.queue,
                    type(outcome).__name__,
                    outcome,
                )

    async def _handle(self, sub: Subscription, state: _SubState, delivery: Delivery) -> None:
        try:
            settlement = await self.runtime.process(
                delivery, stopping=self._handler_stop, closing=self._stopping, cut_short=self._cut_short
            )
        except asyncio.CancelledError:
            settlement = _released(delivery)
        except BaseException as exc:
            # the pipeline itself failed (e.g. the control store is unreachable): give it back, due a
            # little later. Handed back at once, a message that fails the pipeline every time (however
            # it does) came straight back and ran again, as fast as the worker claims, for ever. Whatever
            # it raised, not only an Exception (a hook's SystemExit, a library's own BaseException): let
            # through, it left the delivery renewed for ever, never settled, or ended the process
            log.exception(
                "could not process a message from %s (%s); it runs again later", sub.queue, type(exc).__name__
            )
            why = f"pipeline error: {first_line(exc)}"
            later = Defer(utcnow() + PIPELINE_ERROR_WAIT, MessageStatus.PENDING, why)
            settlement = Settlement(delivery, later)
        finally:
            # the slot is free for the next message; the lease is still renewed until the settlement
            # is committed (a slow database must not let the sweeper retry a message that succeeded)
            state.in_flight -= 1
            state.slot_freed.set()
            self.last_activity = time.monotonic()
        self.settler.add(settlement)

    def _settled(self, chunk: list[Settlement]) -> None:
        for s in chunk:
            self._in_flight.pop(id(s.delivery), None)

    def _cut_short(self, ran: float) -> str | None:
        """What the pipeline asks of a handler the stop cancelled after ``ran`` seconds (see
        ``_out_of_time``). Only a run that had the whole budget counts: one claimed late in the budget
        may fit the next, which claims it at its start, and is handed back uncounted (counted, a
        healthy handler shorter than the budget was retried, dead-lettered or opened its circuit)."""
        if self._out_of_time is None:
            return None
        why, budget = self._out_of_time
        return why if ran >= budget else None

    async def _renew_loop(self) -> None:
        provider = self.runtime.provider
        # each message's lease as the transport holds it, renewed once a third of it has passed: judged
        # by the shortest lease of the app, a long one was renewed only with less than two thirds of
        # the shortest left (a 10-minute lease beside 30-second ones lost to a stall of 20 s), and one
        # the transport caps (Service Bus locks at most 5 minutes) was first renewed after it lapsed
        cap = provider.capabilities.longest_lease
        # (a provider that knows better says what it holds: an existing Service Bus queue's lock may
        # be shorter than the type's lease, and renewals timed by the lease came after it lapsed)
        held: Callable[[Subscription], timedelta] | None = getattr(provider, "held_lease", None)

        def lease(s: Subscription) -> timedelta:
            if held is not None:
                return held(s)
            return min(s.options.lease_duration, cap) if cap else s.options.lease_duration

        lease_of = {s.type_name: lease(s) for s in self.subscriptions()}
        shortest = min(lease_of.values(), default=timedelta(seconds=30)).total_seconds()
        interval = max(0.5, shortest / 3)
        # a lease's end is on the provider's lease clock where it has one (SQL: the database's time);
        # compared with this host's clock, a host running behind would renew too late
        clock: Clock = getattr(provider, "lease_clock", utcnow)
        while True:
            await asyncio.sleep(interval)
            now = clock()
            due = [
                d
                for d in list(self._in_flight.values())
                if d.lease_until is None
                or (d.lease_until - now).total_seconds()
                < 2 * max(interval, lease_of.get(d.type_name or "", timedelta()).total_seconds() / 3)
            ]
            if not due:
                continue
            try:
                lost = await provider.renew(due)
            except Exception as exc:
                log.warning("lease renewal failed (%s); will try again in %.1fs", exc, interval)
                continue
            for d in lost:
                if id(d) not in self._in_flight:
                    continue  # settled while the renewal was on its way: nothing was lost
                env = d.envelope
                log.warning(
                    "lease lost for message %s on %s: another worker may process it",
                    env.message_id if env else "?",
                    d.queue,
                    extra={
                        "message_id": str(env.message_id) if env else None,
                        "correlation_id": env.correlation_id if env else None,
                    },
                )

    async def _watch_cancels(self) -> None:
        """Cancellation requests for the messages running here, from the shared control store (every
        transport); PostgreSQL's NOTIFY reaches the pipeline sooner through the runtime."""
        pipeline, control = self.runtime.pipeline, self.runtime.control
        while True:
            await asyncio.sleep(self.cancel_poll)
            if not pipeline.running:
                continue
            try:
                requested = (await control.state()).cancelled
            except Exception as exc:
                log.warning("could not read cancellation requests (%s); will try again", exc)
                continue
            for message_id in requested & pipeline.running.keys():
                pipeline.cancel_running(message_id)

    async def _maintain_loop(self, provider: Maintains) -> None:
        # spread hosts apart a little so they do not sweep in lock-step
        await asyncio.sleep(random.uniform(0, provider.maintenance_interval))  # noqa: S311 - jitter, not crypto
        while True:
            try:
                done = await provider.maintain(self.runtime.app)
                if any(done.values()):
                    log.info("maintenance: %s", ", ".join(f"{k}={v}" for k, v in done.items() if v))
            except Exception as exc:
                log.warning("maintenance failed (%s: %s); will try again", type(exc).__name__, exc)
            await asyncio.sleep(provider.maintenance_interval)

    # -- introspection -------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def drain(self, budget: float, *, idle_after: float = 2.0) -> None:
        """Process until nothing has happened for ``idle_after`` seconds or ``budget`` runs out, then
        shut down (what a scheduled host such as a Functions timer does): handlers still running get
        ``shutdown_timeout`` more to finish, after the budget. One still running then is cancelled; if
        it had run for the whole budget it counts a failed attempt (retried with backoff,
        dead-lettered after ``max_attempts``), where a worker's own stop hands it back uncounted: a
        scheduled host stops at every run's end, so a run longer than budget and grace handed back
        would start again on every run, for ever. One that began later in the budget is handed back
        uncounted: the next run claims it at its start, where it may fit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        await self.start()
        try:
            while loop.time() < deadline:
                await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
                if self.in_flight == 0 and time.monotonic() - self.last_activity > idle_after:
                    break
            # (the stop grace was cut to what was left of the budget, nothing at its end: every run
            # still going then was cancelled at once and handed back, and started again next time)
            self._out_of_time = (
                f"cut short: still running after its host's budget ({budget:g} s) and the "
                f"{self.shutdown_timeout:g} s it gives running handlers to finish",
                budget,
            )
        finally:
            await self.shutdown()
