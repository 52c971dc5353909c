"""Runs an app's schedules inside a host: the worker (``queueing serve``) or the Functions timer.

Every host runs the same loop; the :class:`~queueing_core.schedules.TickStore` makes one of them win
each tick. A round reads the newest claimed tick of each schedule, works out which ticks are due
(on time, or the one catch-up tick of ``catch_up="once"``), builds their messages and fires each tick
through the store. A paused schedule's ticks are claimed with no message, so resuming it does not
replay the ticks of the pause.

A tick that was claimed but never sent (its send failed, or its host died) and whose claim has lapsed
comes back from the store as *unfinished*. While it is on time it is sent again (same message ids);
once it is older than the grace it is a missed tick like any other, and ``catch_up`` decides: it is
confirmed with no message (``"skip"``, or ``"once"`` when a newer tick was missed too), or sent as the
newest missed tick (``"once"``). So a broker outage ends like a host outage: no hours-old tick goes
out, and with ``"once"`` exactly one catch-up tick does.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from .clock import utcnow
from .producer import IdempotentOutcome, identities_of
from .schedules import (
    SCHEDULE_HEADER,
    TICK_HEADER,
    MemoryTickStore,
    ProvidesTickStore,
    Schedule,
    TickStore,
    tick_message_id,
)

if TYPE_CHECKING:
    from .envelope import Envelope
    from .runtime import Runtime

log = logging.getLogger("queueing.schedules")
#: tick rows are kept this long (each schedule's newest always), pruned about this often (seconds)
KEEP_TICKS = timedelta(days=7)
PRUNE_EVERY = 3600.0


#: the in-process provider's tick store, one per provider: every Scheduler of a runtime (the worker's,
#: a test's) and the ops API share it, as the hosts of a deployment share theirs
_MEMORY_STORES: weakref.WeakKeyDictionary[object, MemoryTickStore] = weakref.WeakKeyDictionary()


def tick_store_for(runtime: Runtime) -> TickStore:
    """The store every host of this deployment shares: the provider's own (SQL: its database; RabbitMQ
    and SQS: the side database), else the control store's (Azure Tables), else memory (one process:
    one store per provider, so that every scheduler of it claims each tick once and ops sees them)."""
    for source in (runtime.provider, runtime.control.inner):
        if isinstance(source, ProvidesTickStore):
            return source.schedule_store()
    try:
        store = _MEMORY_STORES.get(runtime.provider)
        if store is None:
            store = _MEMORY_STORES[runtime.provider] = MemoryTickStore()
    except TypeError:  # a provider that cannot be weakly referenced or hashed: one store per runtime
        store = runtime.__dict__.setdefault("_queueing_tick_store", MemoryTickStore())
    return store


class Scheduler:
    def __init__(
        self,
        runtime: Runtime,
        *,
        store: TickStore | None = None,
        grace: timedelta = timedelta(seconds=60),
        poll: float = 1.0,
        retry_gap: timedelta = timedelta(0),
    ) -> None:
        """``retry_gap``: how long after a failed try a host tries a tick again at most (a Functions
        timer's interval); the tick store's claim lease is the least (a dead host's claim lapses)."""
        self.runtime = runtime
        self.store = store or tick_store_for(runtime)
        self.grace = grace
        #: an unfinished tick is missed only this much later than a tick no host claimed: it was
        #: claimed on time, and its next try could come no sooner than its claim lapsed (or the next
        #: timer run). Judged by the grace alone, a tick whose send failed once was dropped by a retry
        #: that came a second late, its never-tried neighbour sent (found in review)
        self.unfinished_allowance = max(retry_gap, getattr(self.store, "lease", timedelta(seconds=30)))
        self.poll = poll
        self._unwakeable: set[str] = set()  # schedules whose next tick failed (warned once each)

    @property
    def schedules(self) -> list[Schedule]:
        return list(self.runtime.app.schedules)

    async def run_due(self, now: datetime | None = None) -> int:
        """One round: fire what is due now; returns the ticks this host fired."""
        schedules = self.schedules
        if not schedules:
            return 0
        now = now or self.runtime.clock()
        paused = (await self.runtime.control.state()).paused_schedules
        last = await self.store.last_ticks([s.name for s in schedules])
        fired = 0
        for s in schedules:
            try:
                unfinished = await self.store.unfinished(s.name, now)
                for tick, send in self.plan(s, unfinished, last.get(s.name), now):
                    fired += await self.fire(s, tick, now, paused=s.name in paused, missed=not send)
            except Exception as exc:  # the next round tries again; other schedules go on
                log.warning("schedule %s: %s: %s; will try again", s.name, type(exc).__name__, exc)
        return fired

    def plan(
        self, s: Schedule, unfinished: Sequence[datetime], last: datetime | None, now: datetime
    ) -> list[tuple[datetime, bool]]:
        """The ticks to fire now, oldest first, each with whether its messages go out.

        ``unfinished`` are ticks claimed but never sent whose claim lapsed. One still on time is sent
        again. One older than the grace (and, unfinished, than ``unfinished_allowance`` more) is a
        missed tick, as a tick no host claimed is: with ``catch_up="skip"`` it is confirmed with no
        message, with ``"once"`` only the newest missed tick (unfinished or never claimed) is sent and
        the older ones are confirmed with no message."""
        retried = set(unfinished)
        ticks = sorted(retried | set(s.due(last, now, self.grace)))
        late = {t: self.grace + (self.unfinished_allowance if t in retried else timedelta(0)) for t in ticks}
        missed = [t for t in ticks if now - t > late[t]]
        kept = missed[-1:] if s.catch_up == "once" else []
        return [(t, t not in missed or t in kept) for t in ticks]

    async def fire(
        self, s: Schedule, tick: datetime, now: datetime, *, paused: bool = False, missed: bool = False
    ) -> bool:
        """Claim ``tick`` and send its messages; a paused schedule's tick, or a missed one that its
        catch-up policy drops (``missed``), is claimed and confirmed with no message."""
        producer = self.runtime.producer
        ready: list[Envelope] = []
        identities: list[str | None] = []
        if not (paused or missed):
            headers = {SCHEDULE_HEADER: s.name, TICK_HEADER: tick.isoformat()}
            envelopes = []
            messages = await s.messages(tick)
            for i, message in enumerate(messages):
                ident = tick_message_id(s.name, tick, i)
                copy = message.model_copy(update={"message_id": ident, "created_at": now})
                envelopes.append(producer.envelope_for(copy, now=now, tracking_id=ident, headers=headers))
            ready = await producer.prepare(envelopes)
            # an idempotent type's tick message is discarded or replaces the waiting one, as any enqueue
            identities = identities_of(self.runtime.app, messages)

        async def send(envs: Sequence[Envelope]) -> None:
            if envs:  # (a tick with no message touches no transport: it goes through a broker outage)
                await producer.send_prepared(envs, wait=True, identities=identities)

        async def announce(outcomes: dict[int, IdempotentOutcome]) -> None:
            await producer.sent(ready, outcomes)  # the store wrote them with the tick

        if getattr(self.store, "writes_messages", False):
            won = await self.store.fire(s.name, tick, ready, send, now, identities, announce=announce)
        else:  # (``send`` records and announces them: a store of the older protocol works as it did)
            won = await self.store.fire(s.name, tick, ready, send, now, identities)
        if won:
            if paused:
                outcome = "skipped (paused)"
            elif missed:
                outcome = f"dropped (missed: older than the grace, catch_up={s.catch_up!r})"
            else:
                outcome = f"enqueued {len(ready)} message(s)"
            log.info("schedule %s: tick %s %s", s.name, tick.isoformat(), outcome)
        return won

    async def prune(self) -> int:
        """Forget ticks older than a week (each schedule's newest is kept: it is where it stands)."""
        prune = getattr(self.store, "prune", None)
        return int(await prune(self.runtime.clock() - KEEP_TICKS)) if prune is not None else 0

    def next_wake(self, now: datetime) -> float:
        """Seconds until the next tick of any schedule (at most ``poll``: pauses and lapsed claims)."""
        nearest: datetime | None = None
        for s in self.schedules:
            try:
                tick = s.next_after(now)
            except Exception as exc:  # one schedule's bad arithmetic must not stop the others' wakes
                self._warn_once(s.name, exc)
                continue
            self._unwakeable.discard(s.name)
            nearest = tick if nearest is None else min(nearest, tick)
        if nearest is None:
            return self.poll
        return max(0.0, min(self.poll, (nearest - now).total_seconds()))

    def _warn_once(self, name: str, exc: Exception) -> None:
        # next_wake runs about every second: warn once per schedule, not once a second
        level = logging.DEBUG if name in self._unwakeable else logging.WARNING
        self._unwakeable.add(name)
        log.log(level, "schedule %s: cannot compute its next tick: %s: %s", name, type(exc).__name__, exc)

    async def run(self) -> None:
        """Until cancelled (a worker background task)."""
        names = ", ".join(f"{s.name} ({s.expression})" for s in self.schedules)
        log.info("running schedules: %s", names)
        pruned_at = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.run_due()
                if loop.time() - pruned_at > PRUNE_EVERY:
                    pruned_at = loop.time()
                    await self.prune()
            except Exception as exc:
                log.warning("schedules: %s: %s; will try again", type(exc).__name__, exc)
            try:
                wake = self.next_wake(utcnow())
            except Exception as exc:  # nothing may end this task: every schedule of the host lives in it
                log.warning("schedules: %s: %s; will try again", type(exc).__name__, exc)
                wake = self.poll
            await asyncio.sleep(wake + 0.01)  # just past the tick


def describe(schedule: Schedule, last: datetime | None, paused: bool, now: datetime) -> dict[str, Any]:
    """One schedule as the ops API and the CLI show it."""
    return {
        "name": schedule.name,
        "expression": schedule.expression,
        "timezone": schedule.timezone,
        "catch_up": schedule.catch_up,
        "paused": paused,
        "last_tick": last,
        "next_tick": schedule.next_after(now),
    }
