"""Two receives in flight per queue (``Worker(receives_in_flight=2)``), on SQLite and PostgreSQL: a
second claim runs while the first is on its way, the slots a claim in flight may fill count as taken
(handlers running plus slots reserved never exceed ``max_concurrency x prefetch``), a stop while two
claims are in flight loses nothing and settles nothing twice, a consumer cancelled while its claims
are out waits for them, a claim that returns beside a failed one runs its messages at once, and a
circuit's probe still claims one message with no claim beside it, also a claim decided in the
cooldown that runs after it."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, RetryPolicy, queue
from queueing_core.clock import utcnow
from queueing_core.control import ControlState, circuit
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery
from queueing_core.worker import PollBackoff, Worker, _admission
from tests.contract.harness import wait_until

CONCURRENCY, PREFETCH, BATCH = 2, 2, 2
CAPACITY = CONCURRENCY * PREFETCH


@queue("ahead", lease_duration=timedelta(seconds=60))
class Job(QueueMessage):
    n: int


class Claims:
    """Wraps a provider's ``receive``: how many run at once, and at each start whether the worker's
    running handlers plus the slots every claim in flight may fill stay within the capacity."""

    def __init__(self, provider: SqlProvider, worker: Worker) -> None:
        self.worker = worker
        self.active = 0
        self.most_active = 0
        self.reserved = 0
        self.most_taken = 0
        self.calls = 0
        self.claimed: list[int] = []
        #: what each claim (numbered from 1) took
        self.by_call: dict[int, list[int]] = {}
        #: called before a claim starts its transaction: a test may hold it there, or make it fail
        self.before_claim: Callable[[int], Awaitable[None]] | None = None
        #: called after a claim committed, before it returns: a test may hold it there
        self.after_commit: Callable[[int], Awaitable[None]] | None = None
        self._receive = provider.receive
        provider.receive = self.receive  # type: ignore[method-assign]

    async def receive(self, sub: Any, max_messages: int) -> list[Delivery]:
        self.calls += 1
        call = self.calls
        self.active += 1
        self.reserved += max_messages
        state = self.worker._subs[sub.type_name]
        self.most_active = max(self.most_active, self.active)
        self.most_taken = max(self.most_taken, state.in_flight + self.reserved)
        try:
            if self.before_claim is not None:
                await self.before_claim(call)
            got = await self._receive(sub, max_messages)
            assert len(got) <= max_messages
            self.by_call[call] = [d.envelope.body["n"] for d in got if d.envelope]  # type: ignore[index]
            self.claimed += self.by_call[call]
            if self.after_commit is not None:
                await self.after_commit(call)
            return got
        finally:
            self.active -= 1
            self.reserved -= max_messages


def job_app(ran: Counter[int], gate: asyncio.Semaphore | None = None) -> tuple[QueueingApp, dict[str, int]]:
    app = QueueingApp("ahead")
    running = {"now": 0, "most": 0}

    @app.handler(max_concurrency=CONCURRENCY)
    async def handle(msg: Job) -> None:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        try:
            if gate is not None:
                await gate.acquire()
            ran[msg.n] += 1
        finally:
            running["now"] -= 1

    return app, running


def worker_for(rt: Runtime, receives: int = 2) -> Worker:
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=PREFETCH, batch_size=BATCH, schedules=False)
    # set after construction: on code without the setting the test fails on what it checks, not on
    # an unknown keyword
    worker.receives_in_flight = receives
    return worker


async def opened(
    sql_db: Any, total: int, gate: asyncio.Semaphore | None = None
) -> tuple[Counter[int], dict[str, int], SqlProvider, Runtime]:
    """The jobs' app on a provider of its own, opened, with ``total`` jobs enqueued: what ran (by
    job), the handlers running (now and at most), the provider and the runtime."""
    ran: Counter[int] = Counter()
    app, running = job_app(ran, gate)
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    await app.enqueue_many([Job(n=i) for i in range(total)])
    return ran, running, prov, rt


def holding_after_the_first(
    release: asyncio.Event,
) -> tuple[dict[str, int], Callable[[int], Awaitable[None]]]:
    """A claim hook that holds every claim after the first until ``release`` is set, and the count of
    claims it holds now."""
    held = {"now": 0}

    async def hold(call: int) -> None:
        if call > 1:  # the first comes back full, so the next ones run ahead
            held["now"] += 1
            await release.wait()

    return held, hold


async def statuses(prov: SqlProvider) -> Counter[str]:
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.status))).all()
    return Counter(r[0] for r in rows)


async def test_a_second_claim_runs_while_the_first_is_on_its_way(sql_db):
    """The first claim comes back full; the next is held after its commit until another starts beside
    it (or 5 s pass): with one receive at a time the second never starts, and the test fails."""
    ran, running, prov, rt = await opened(sql_db, 40)
    worker = worker_for(rt)
    claims = Claims(prov, worker)
    beside = asyncio.Event()

    async def hold_the_second(call: int) -> None:
        if claims.active > 1:
            beside.set()
        if call == 2:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(beside.wait(), 5)

    claims.after_commit = hold_the_second
    await worker.start()
    try:
        await wait_until(lambda: sum(ran.values()) == 40, what="every message to run")
    finally:
        await worker.shutdown()
    assert claims.most_active == 2
    assert claims.most_taken <= CAPACITY, claims.most_taken
    assert running["most"] <= CONCURRENCY
    assert set(ran) == set(range(40))
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": 40})


async def test_claims_never_take_more_than_the_free_slots(sql_db):
    """Handlers block until the test lets one finish at a time: however the claims overlap, the
    handlers running plus the slots reserved by claims in flight never exceed the capacity, and no more
    than ``max_concurrency`` handlers run at once."""
    gate = asyncio.Semaphore(0)
    total = 30
    ran, running, prov, rt = await opened(sql_db, total, gate)
    worker = worker_for(rt)
    claims = Claims(prov, worker)
    await worker.start()
    try:
        for finished in range(total):
            # every slot is taken (the handlers block) before the next one is let go
            await wait_until(
                lambda f=finished: running["now"] == min(CONCURRENCY, total - f),  # type: ignore[misc]
                what="the handler slots to fill",
            )
            assert worker._subs["Job"].in_flight <= CAPACITY
            gate.release()
            await wait_until(lambda f=finished: sum(ran.values()) == f + 1, what="one more to finish")  # type: ignore[misc]
    finally:
        for _ in range(total):
            gate.release()
        await worker.shutdown()
    assert claims.most_taken <= CAPACITY, claims.most_taken
    assert running["most"] <= CONCURRENCY
    assert set(ran) == set(range(total))
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_stop_with_two_claims_in_flight_loses_nothing(sql_db):
    """Two claims committed and held on their way back when the worker is told to stop: the stop
    waits for them, and their messages are given back at once as any not started at a stop are (none
    left leased until the lease runs out); a second worker finishes the rest, each exactly once."""
    total = 40
    ran, _, prov, rt = await opened(sql_db, total)
    worker = worker_for(rt)
    claims = Claims(prov, worker)
    release = asyncio.Event()
    held, hold_after_the_first = holding_after_the_first(release)
    claims.after_commit = hold_after_the_first
    await worker.start()
    stopping: asyncio.Task[None] | None = None
    try:
        await wait_until(lambda: held["now"] == 2, timeout=10, what="two claims in flight")
        stopping = asyncio.create_task(worker.shutdown())
        await wait_until(lambda: worker._stopping.is_set(), what="the stop to begin")
        release.set()
        await stopping
    finally:
        release.set()
        if stopping is None:
            await worker.shutdown()
    first = sum(ran.values())
    assert len(claims.claimed) >= 3 * BATCH  # both held claims had committed theirs
    # what the held claims took ran, or (not started when the stop came) was given back at once: none
    # is left leased until its lease runs out
    counts = await statuses(prov)
    assert counts == Counter({"Succeeded": first, "Pending": total - first}), counts
    # a second worker takes the rest: each message once in all
    again = worker_for(rt, receives=1)
    await again.start()
    try:
        await wait_until(lambda: sum(ran.values()) == total, what="the rest to run")
    finally:
        await again.shutdown()
    assert set(ran) == set(range(total))
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_claim_that_returns_beside_a_failed_one_runs_at_once(sql_db):
    """Claim 2 waits until claim 3 has committed, then fails: claim 3's messages start (and their
    leases are renewed) at once, not after the pause that claim 2's failure brings (20 s here, beyond
    the 10 s the test waits)."""
    total = 40
    ran, _, prov, rt = await opened(sql_db, total)
    worker = worker_for(rt)
    # a failed claim pauses the loop for 20 s (``PollBackoff.failure`` doubles the current 10 s)
    worker.poll_min = worker.poll_max = 10.0
    assert PollBackoff(10.0, 10.0).failure() == 20.0
    claims = Claims(prov, worker)
    three_committed = asyncio.Event()
    two_failing = asyncio.Event()

    async def fail_the_second(call: int) -> None:
        if call == 2:
            await three_committed.wait()
            two_failing.set()
            raise ConnectionError("database went away")

    async def hold_the_third(call: int) -> None:
        if call == 3:
            three_committed.set()
            await two_failing.wait()

    claims.before_claim = fail_the_second
    claims.after_commit = hold_the_third
    await worker.start()
    try:
        await wait_until(lambda: 3 in claims.by_call, timeout=30, what="the third claim to return")
        third = set(claims.by_call[3])
        assert third
        await wait_until(lambda: third <= set(ran), timeout=10, what="the third claim's messages to run")
    finally:
        await worker.shutdown()
    assert set(ran.values()) == {1}
    counts = await statuses(prov)
    assert counts == Counter({"Succeeded": sum(ran.values()), "Pending": total - sum(ran.values())}), counts


async def test_a_cancelled_consumer_leaves_no_claim_behind(sql_db):
    """Two claims beside the consumer loop, held before their transaction, when the consumer is
    cancelled (not stopped: at a stop the consumer leaves at once and the claims beside it are the
    stop's to wait for, bounded; see test_worker_stop_bounded.py): both claims are cancelled and
    waited for before the consumer ends, so none claims rows after it is gone and no row is left
    leased until its lease runs out (a claim the consumer dropped would commit and its batch be
    thrown away)."""
    total = 40
    ran, _, prov, rt = await opened(sql_db, total)
    worker = worker_for(rt)
    claims = Claims(prov, worker)
    release = asyncio.Event()
    held = {"now": 0}

    async def hold_after_the_first(call: int) -> None:
        if call > 1:  # the first comes back full, so the next ones run beside the loop
            held["now"] += 1
            try:
                await release.wait()
            except asyncio.CancelledError:
                # a cancelled database call takes a moment to end (its connection is rolled back):
                # a consumer that did not wait would be gone before it
                await asyncio.sleep(0.2)
                raise

    claims.before_claim = hold_after_the_first
    await worker.start()
    try:
        await wait_until(lambda: held["now"] == 2, timeout=10, what="two claims in flight")
        beside = set(worker._claims)
        assert len(beside) == 2
        consumer = worker._consumers[0]
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        # waited for, not only cancelled: neither runs on after the consumer is gone
        assert all(claim.done() for claim in beside)
        assert claims.active == 0
        release.set()
    finally:
        release.set()
        await asyncio.wait_for(worker.shutdown(), 60)
    assert claims.calls == 3  # no claim after the two held
    counts = await statuses(prov)
    assert "Leased" not in counts, counts
    assert counts == Counter({"Succeeded": sum(ran.values()), "Pending": total - sum(ran.values())}), counts


@queue(
    "ahead-probe",
    max_concurrency=4,
    max_attempts=100,
    retry=RetryPolicy(base=timedelta(milliseconds=20), factor=1.0, jitter=0),
    circuit_breaker=CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(seconds=1)),
)
class Charge(QueueMessage):
    n: int


async def failing_charges(sql_db: Any, total: int) -> tuple[list[int], SqlProvider, Runtime, Worker, Claims]:
    """``total`` charges whose handler always fails, behind a circuit that opens at the first failure:
    the numbers run, the provider, runtime, a worker not yet started, and its claims watched."""
    calls: list[int] = []
    app = QueueingApp("ahead-probe")

    @app.handler()
    async def charge(msg: Charge) -> None:
        calls.append(msg.n)
        raise ConnectionError("payment gateway down")

    prov = sql_db.provider()
    rt = Runtime(app, prov, control_ttl=0.05)
    await rt.open()
    await app.enqueue_many([Charge(n=i) for i in range(total)])
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=4, schedules=False)
    return calls, prov, rt, worker, Claims(prov, worker)


async def until_opened_and_idle(rt: Runtime, worker: Worker, claims: Claims) -> None:
    """The circuit is open, and no claim nor run is left from before."""

    async def circuit_open() -> bool:
        rt.control.invalidate()
        return (await rt.control.state()).circuit("Charge").state == "open"

    await wait_until(circuit_open, what="the circuit to open")
    await wait_until(lambda: claims.active == 0 and worker.in_flight == 0, what="the runs in flight to end")


async def test_the_probe_claims_one_message_alone(sql_db):
    """Behind an open circuit, with two receives allowed, every claim that takes a message after the
    opening is a probe: it asked for one, and no other claim ran beside it."""
    calls, prov, rt, worker, claims = await failing_charges(sql_db, 200)
    worker.receives_in_flight = 2
    # (asked for, claims running, taken) after the circuit opened; the claims of a held type come back
    # empty (the SQL claim leaves its rows alone)
    sizes: list[tuple[int, int, int]] = []
    opened = asyncio.Event()
    inner = claims.receive

    async def watched(sub: Any, max_messages: int) -> list[Delivery]:
        together = claims.active + 1
        got = await inner(sub, max_messages)
        if opened.is_set():
            sizes.append((max_messages, together, len(got)))
        return got

    prov.receive = watched  # type: ignore[method-assign]
    await worker.start()
    try:
        await until_opened_and_idle(rt, worker, claims)
        opened.set()
        ran = len(calls)
        await wait_until(lambda: len(calls) >= ran + 2, what="two probes")
    finally:
        await worker.shutdown()
    probes = [s for s in sizes if s[2]]
    assert len(probes) >= 2, sizes
    assert all(asked == 1 and together == 1 for asked, together, _ in probes), probes


async def test_a_claim_decided_in_the_cooldown_and_run_after_it_takes_one_message(sql_db):
    """The SQL claim leaves a held type's rows alone by the clock at its statement, so a claim the
    worker decided on while the circuit cooled down, whose statement runs once the cooldown is over,
    finds every row claimable. It asked for one, as a claim decided after the cooldown does: a batch
    would be one probe and the rest handed back."""
    _, prov, rt, worker, claims = await failing_charges(sql_db, 40)
    armed = asyncio.Event()
    # (asked for, taken) of the first claim that starts while the circuit is open and cooling down,
    # held until the cooldown is over
    edge: list[tuple[int, int]] = []
    inner = claims.receive

    async def across_the_end(sub: Any, max_messages: int) -> list[Delivery]:
        if armed.is_set() and not edge:
            now_state = await rt.control.inner.state()  # type: ignore[attr-defined]
            charges = now_state.circuit("Charge")
            # the worker decided before this call, on a state read no later: open and cooling down
            # (no probe has run since the runs ended, so this is the cooldown it saw)
            if charges.state == "open" and _admission(now_state, sub) is circuit.Admission.HOLD:
                until = circuit.hold_until(charges, utcnow())
                await asyncio.sleep((until - utcnow()).total_seconds() + 0.05)
                got = await inner(sub, max_messages)
                edge.append((max_messages, len(got)))
                return got
        return await inner(sub, max_messages)

    prov.receive = across_the_end  # type: ignore[method-assign]
    await worker.start()
    try:
        await until_opened_and_idle(rt, worker, claims)
        armed.set()
        await wait_until(lambda: bool(edge), what="a claim across the cooldown's end")
    finally:
        await worker.shutdown()
    assert edge == [(1, 1)], edge


@queue(
    "ahead-probe-full",
    max_concurrency=CONCURRENCY,
    circuit_breaker=CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(seconds=1)),
)
class Refund(QueueMessage):
    n: int


async def test_no_probe_claim_starts_beside_a_full_claim_in_flight(sql_db):
    """Claims come back full; two are in flight (held after their commit) when the circuit turns to
    letting a probe through. The third returns (its messages find the probe taken and wait), so the
    consumer has free slots and sees the probe may go while the second is still on its way: it starts
    no claim (the probe's, of one message, included) until the second has returned."""
    ran: Counter[int] = Counter()
    app = QueueingApp("ahead-probe-full")

    @app.handler()
    async def refund(msg: Refund) -> None:
        ran[msg.n] += 1

    prov = sql_db.provider()
    rt = Runtime(app, prov, control_ttl=0.05)
    await rt.open()
    total = 40
    await app.enqueue_many([Refund(n=i) for i in range(total)])
    worker = worker_for(rt)
    claims = Claims(prov, worker)
    sub = app.subscriptions()[0]
    forced = asyncio.Event()
    release = {2: asyncio.Event(), 3: asyncio.Event()}
    # (asked for in all, claims running) for each claim started while the second is held
    beside: list[tuple[int, int]] = []
    # the consumer read the control store while the probe may go, with no handler running
    looked = asyncio.Event()
    read_state = rt.control.state

    async def watched_state() -> ControlState:
        got = await read_state()
        probe = _admission(got, sub) is circuit.Admission.PROBE
        if forced.is_set() and probe and worker._subs["Refund"].in_flight == 0:
            looked.set()
        return got

    async def probe_taken(*_: Any) -> bool:
        return False  # some other host holds the probe: the circuit stays where a probe may go

    rt.control.state = watched_state  # type: ignore[method-assign]
    rt.control.acquire_probe = probe_taken  # type: ignore[method-assign]

    async def record_beside(call: int) -> None:
        if forced.is_set() and not release[2].is_set():
            beside.append((claims.reserved, claims.active))

    async def hold(call: int) -> None:
        if call in release:
            await release[call].wait()

    claims.before_claim = record_beside
    claims.after_commit = hold
    await worker.start()
    try:
        await wait_until(lambda: claims.active == 2, timeout=10, what="two claims in flight")
        # a failure an hour ago opened the circuit, and its cooldown is long over: a probe may go
        await rt.control.record_failure(
            "Refund", CircuitBreakerOptions(failure_threshold=1), utcnow() - timedelta(hours=1)
        )
        assert _admission(await read_state(), sub) is circuit.Admission.PROBE
        forced.set()
        release[3].set()
        await wait_until(lambda: looked.is_set(), timeout=10, what="the consumer to see the probe may go")
        release[2].set()
        await wait_until(lambda: claims.active == 0, what="the second claim to return")
    finally:
        for event in release.values():
            event.set()
        await worker.shutdown()
    assert beside == [], beside
