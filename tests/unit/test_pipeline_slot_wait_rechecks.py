"""A message that waited for a concurrency slot of its type is looked at again before it starts.

Found by a review: expiry, cancellation, pause and the circuit were looked at once, before the wait
for a slot, which can be long (a handler's whole run with ``prefetch`` above 1; a minute in the
Functions host). A message paused, expired or cancelled meanwhile ran anyway (its cancel answered
Cancelled, then it ran and was recorded Succeeded), and while it waited a cancel could not reach it.
One that found its slot free at once is not looked at again (no second read of the control state)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from queueing_core import (
    CircuitBreakerOptions,
    Complete,
    Defer,
    Expire,
    MessageStatus,
    QueueingApp,
    QueueMessage,
    queue,
)
from queueing_core.control import ControlState, MemoryControlStore
from queueing_core.decisions import Decision
from queueing_core.ops.service import OpsService
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Capabilities, Delivery
from queueing_core.worker import Worker

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)
BREAKER = CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(minutes=1))


@queue(
    "slot-wait",
    max_concurrency=1,
    expiration=timedelta(minutes=10),
    circuit_breaker=BREAKER,
    cancel_grace=timedelta(seconds=0.05),
)
class Held(QueueMessage):
    n: int


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class CountingControl(MemoryControlStore):
    """Counts the reads of the control state."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.reads = 0

    async def state(self) -> ControlState:
        self.reads += 1
        return await super().state()


class _NullProvider:
    capabilities = Capabilities()


class Setup:
    def __init__(self, handler: Callable[..., Awaitable[None]] | None = None) -> None:
        self.app = QueueingApp("slot-wait")
        self.ran: list[int] = []

        async def handle(msg: Held) -> None:
            self.ran.append(msg.n)

        self.app.handler()(handler or handle)

        self.clock = Clock()
        self.control = CountingControl(self.clock)
        self.pipe = Pipeline(self.app, self.control, clock=self.clock)
        self.prod = Producer(self.app, _NullProvider(), clock=self.clock)
        sub = self.app.subscription("Held")
        assert sub is not None
        self.slot = self.pipe.limiter(sub)

    def delivery(self, n: int) -> Delivery:
        env = self.prod.envelope_for(Held(n=n, created_at=T0))
        return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)

    async def held_while(self, change: Callable[[Delivery], Awaitable[Any]]) -> Decision:
        """Process a message while another run holds the type's one slot, ``change`` the world while it
        waits, then free the slot."""
        await self.slot.acquire()  # another run holds the type's one slot
        d = self.delivery(2)
        assert d.envelope is not None
        task = asyncio.create_task(self.pipe.process(d))
        for _ in range(100):  # until it waits for the slot
            if d.envelope.message_id in self.pipe.running:
                break
            await asyncio.sleep(0)
        assert d.envelope.message_id in self.pipe.running  # (where a cancel looks for it)
        await change(d)
        self.slot.release()
        decision = await asyncio.wait_for(task, 5)
        assert not self.pipe.running
        assert not self.slot.locked()  # (the slot is given back)
        return decision


async def test_unchanged_it_starts() -> None:
    s = Setup()

    async def nothing(_: Delivery) -> None:
        return None

    assert await s.held_while(nothing) == Complete()
    assert s.ran == [2]


async def test_paused_meanwhile_it_is_held_as_at_the_start() -> None:
    s = Setup()

    async def pause(_: Delivery) -> None:
        await s.control.set_paused("queue", "slot-wait", True)

    decision = await s.held_while(pause)
    assert isinstance(decision, Defer)
    assert (decision.status, decision.reason) == (MessageStatus.PAUSED, "queue 'slot-wait' is paused")
    assert s.ran == []


async def test_its_type_paused_meanwhile_it_is_held() -> None:
    s = Setup()

    async def pause(_: Delivery) -> None:
        await s.control.set_paused("type", "Held", True)

    decision = await s.held_while(pause)
    assert isinstance(decision, Defer)
    assert decision.status is MessageStatus.PAUSED
    assert s.ran == []


async def test_expired_meanwhile_it_expires() -> None:
    s = Setup()

    async def ten_minutes_on(_: Delivery) -> None:
        s.clock.now = T0 + timedelta(minutes=10)

    assert await s.held_while(ten_minutes_on) == Expire(T0 + timedelta(minutes=10))
    assert s.ran == []


async def test_cancelled_meanwhile_through_the_control_store_it_ends_cancelled() -> None:
    s = Setup()

    async def cancel(d: Delivery) -> None:
        assert d.envelope is not None
        await s.control.set_cancel(d.envelope.message_id, True, s.clock())

    assert await s.held_while(cancel) == Complete(None, cancelled=True)
    assert s.ran == []


async def test_a_cancel_reaches_it_while_it_waits() -> None:
    """As the worker's watch (and PostgreSQL's NOTIFY) tell a running handler: the message waiting is
    found, and, past the type's ``cancel_grace``, its wait is not cancelled as a running handler's task
    would be (cancelled, it was handed back as for a host's stop)."""
    s = Setup()

    async def cancel(d: Delivery) -> None:
        assert d.envelope is not None
        assert s.pipe.cancel_running(d.envelope.message_id)
        await asyncio.sleep(0.2)  # past the grace

    assert await s.held_while(cancel) == Complete(None, cancelled=True)
    assert s.ran == []


async def test_a_cancel_ends_its_wait_at_once() -> None:
    """It is settled Cancelled when cancelled, not once the slot comes free (a handler's whole run, or
    a Functions invocation's minute later: told Cancelled, the message stayed leased all that while)."""
    s = Setup()
    await s.slot.acquire()  # another run holds the type's one slot, and keeps it
    d = s.delivery(2)
    assert d.envelope is not None
    task = asyncio.create_task(s.pipe.process(d))
    for _ in range(100):
        if d.envelope.message_id in s.pipe.running:
            break
        await asyncio.sleep(0)
    assert s.pipe.cancel_running(d.envelope.message_id)
    assert await asyncio.wait_for(task, 5) == Complete(None, cancelled=True)
    assert s.ran == []
    assert not s.pipe.running
    s.slot.release()
    assert not s.slot.locked()  # (it took no slot: the one held is the only one out)


async def test_its_circuit_opened_meanwhile_it_is_held() -> None:
    s = Setup()

    async def trip(_: Delivery) -> None:
        await s.control.record_failure("Held", BREAKER, s.clock())

    decision = await s.held_while(trip)
    assert isinstance(decision, Defer)
    assert (decision.status, decision.reason) == (MessageStatus.PAUSED, "circuit for 'Held' is open")
    assert s.ran == []


async def test_the_probe_that_waited_still_runs() -> None:
    """The circuit is half-open because of the probe this message holds: it goes."""
    s = Setup()
    await s.control.record_failure("Held", BREAKER, s.clock())
    s.clock.now = T0 + timedelta(minutes=2)  # the cooldown is over: the next message probes

    async def nothing(_: Delivery) -> None:
        return None

    assert await s.held_while(nothing) == Complete()
    assert s.ran == [2]
    assert (await s.control.state()).circuit("Held").state == "closed"  # the probe's success closed it


@queue("slot-wait-free", max_concurrency=1)
class Free(QueueMessage):
    n: int


async def test_a_free_slot_reads_the_control_state_once() -> None:
    app = QueueingApp("slot-wait-free")

    @app.handler()
    async def handle(msg: Free) -> None:
        return None

    clock = Clock()
    control = CountingControl(clock)
    pipe = Pipeline(app, control, clock=clock)
    env = Producer(app, _NullProvider(), clock=clock).envelope_for(Free(n=1, created_at=T0))
    d = Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)
    assert await pipe.process(d) == Complete()
    assert control.reads == 1


# -- in a worker, on SQLite: a message claimed with prefetch 2 waits for the type's one slot -----------


@queue("slot-wait-worker", max_concurrency=1, expiration=timedelta(seconds=1))
class Claimed(QueueMessage):
    n: int


@pytest.mark.parametrize("case", ["pause", "expire", "cancel"])
async def test_a_claimed_message_waiting_for_its_slot_does_not_start_once_paused_expired_or_cancelled(
    case: str,
) -> None:
    app = QueueingApp(f"slot-wait-{case}")
    ran: list[int] = []
    first_may_end = asyncio.Event()

    @app.handler()
    async def handle(msg: Claimed) -> None:
        ran.append(msg.n)
        if msg.n == 1:
            await first_may_end.wait()

    rt = Runtime(app, SqlProvider(f"sqlite:///{tempfile.mkdtemp()}/db.sqlite"))
    await rt.open()
    await app.enqueue(Claimed(n=1))
    second = await app.enqueue(Claimed(n=2))
    worker = Worker(rt, prefetch=2, poll_min=0.01, poll_max=0.05, cancel_poll=0.05)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    try:
        for _ in range(250):  # 1 runs, 2 is claimed and waits for the slot
            if ran and worker.in_flight == 2:
                break
            await asyncio.sleep(0.02)
        assert (ran, worker.in_flight) == ([1], 2)
        if case == "pause":
            await OpsService(rt).set_paused("queue", "slot-wait-worker", True)
        elif case == "cancel":
            await app.cancel(second.tracking_id)
        else:
            await asyncio.sleep(1.1)  # 2 expires while it waits
        await asyncio.sleep(0.2)
        first_may_end.set()
        for _ in range(250):
            if worker.in_flight == 0:
                break
            await asyncio.sleep(0.02)
    finally:
        first_may_end.set()
        worker.request_stop()
        await asyncio.wait_for(task, 30)
    rec = await rt.tracker.get(second.message_id)
    await rt.close()
    assert rec is not None
    assert ran == [1], (case, rec.status)
    expected = {
        "pause": MessageStatus.PAUSED,
        "expire": MessageStatus.EXPIRED,
        "cancel": MessageStatus.CANCELLED,
    }
    assert rec.status == expected[case].value


async def _running_and_a_duplicate_waiting(slot_wait: float | None) -> tuple[Any, ...]:
    """Two deliveries of one message (a retry's copy beside its original, a redelivery): the first
    runs, holding the type's one slot, until it is told to stop or let go; the second waits."""
    told: list[bool] = []
    let_go = asyncio.Event()
    started = asyncio.Event()

    async def handle(msg: Held, ctx: Any) -> None:
        if started.is_set():
            return
        started.set()
        stop = asyncio.ensure_future(ctx.cancelled.wait())
        await asyncio.wait({stop, asyncio.ensure_future(let_go.wait())}, return_when=asyncio.FIRST_COMPLETED)
        told.append(ctx.cancelled.is_set())

    s = Setup(handle)
    first = s.delivery(1)
    second = Delivery(first.queue, first.raw, first.envelope, None, 1)
    running = asyncio.create_task(s.pipe.process(first))
    await asyncio.wait_for(started.wait(), 5)
    waiting = asyncio.create_task(s.pipe.process(second, slot_wait=slot_wait))
    await asyncio.sleep(0.05)  # (the second waits for the slot)
    return s, first, running, waiting, told, let_go


@pytest.mark.parametrize("slot_wait", [None, 0.1], ids=["still-waiting", "gave-up-waiting"])
async def test_a_cancel_reaches_the_running_copy_beside_a_waiting_duplicate(slot_wait: float | None) -> None:
    # (the waiting copy took the running one's entry: a cancel reached only the waiting copy, and once
    # it gave up waiting, none at all)
    s, first, running, waiting, told, let_go = await _running_and_a_duplicate_waiting(slot_wait)
    if slot_wait is not None:
        assert isinstance(await asyncio.wait_for(waiting, 5), Defer)  # it gave up: no slot in time
    assert first.envelope is not None
    assert s.pipe.cancel_running(first.envelope.message_id)
    decided = await asyncio.wait_for(running, 5)
    let_go.set()
    assert told == [True]
    assert decided == Complete(None, cancelled=True)
    if slot_wait is None:
        await asyncio.wait_for(waiting, 5)
