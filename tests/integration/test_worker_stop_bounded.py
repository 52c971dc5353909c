"""A worker's stop is bounded by its shutdown timeout plus fixed margins, whatever the database does, on
SQLite and PostgreSQL: a claim held past the deadline has what it brings given back at once (none run,
none left leased), a claim that never comes back is left behind (its rows come back when their lease
lapses), a settlement flush or a provider close that hangs does not hold the stop, and a stop with no
wait (``shutdown_timeout=0``) gives back a claim in flight without a warning.

The database is made to hang at the provider's seam (a call held on an event the test controls), so
each test is deterministic; one test on PostgreSQL holds a real table lock so the claim itself waits in
the server. Each stop is awaited under a generous ``wait_for``: a stop that does not return fails the
test there (on the code before the bound, every one of these stops hung)."""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, queue
from queueing_core.errors import MalformedEnvelope
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.serve import serve_worker_and_api
from queueing_core.settings import QueueingSettings
from queueing_core.transport import Delivery, Settlement
from queueing_core.worker import Worker
from tests.contract.harness import wait_until

from .served import free_port
from .test_worker_receives_in_flight import Claims

#: how long a test lets a stop take before it calls it hung (the stops here need a second or two)
STOP_BOUND = 60.0
#: the lease of the messages whose claims the tests leave behind: they come back after it
SHORT_LEASE = timedelta(seconds=2)
#: what a stop with a deadline of 0.2 s and margins of 1 s (``worker_for``) may take, generously: far
#: above 0.2 + 1 + 1 + 1 s, far below the 0.2 + 10 + 5 + 5 s the default margins would give
MARGINS_BOUND = 15.0


@queue("stop-bounded", lease_duration=timedelta(seconds=60))
class Job(QueueMessage):
    n: int


@queue("stop-bounded-short", lease_duration=SHORT_LEASE)
class Brief(QueueMessage):
    n: int


#: the lease of the messages a claim left behind may take after the stop: long enough that the second
#: worker's own runs keep theirs on a loaded machine, short enough that the rows come back quickly
LAPSING_LEASE = timedelta(seconds=6)


@queue("stop-bounded-lapsing", lease_duration=LAPSING_LEASE)
class Lapsing(QueueMessage):
    n: int


@queue("stop-bounded-ahead", lease_duration=SHORT_LEASE, max_concurrency=2)
class Ahead(QueueMessage):
    n: int


@queue("stop-bounded-single", lease_duration=SHORT_LEASE, max_concurrency=1)
class Single(QueueMessage):
    n: int


@queue(
    "stop-bounded-breaker",
    lease_duration=timedelta(seconds=60),
    circuit_breaker=CircuitBreakerOptions(failure_threshold=5, cooldown=timedelta(seconds=1)),
)
class Guarded(QueueMessage):
    n: int


class Logged(logging.Handler):
    """The worker's log lines, and an event per phrase the test waits for."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.waits: dict[str, asyncio.Event] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        text = record.getMessage()
        for phrase, event in self.waits.items():
            if phrase in text:
                event.set()

    def on(self, phrase: str) -> asyncio.Event:
        return self.waits.setdefault(phrase, asyncio.Event())

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.fixture
def logged() -> Iterator[Logged]:
    logger = logging.getLogger("queueing.worker")
    handler, level = Logged(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


class HeldClaims:
    """Wraps a provider's ``receive``: once armed, a claim commits (its rows leased under its own
    token) and is then held on ``release`` before it returns, as a claim whose answer the database
    never sends back."""

    def __init__(self, provider: SqlProvider) -> None:
        self.armed = True
        #: the held claim hands back its first delivery as one whose envelope did not read (its row and
        #: lease are the claim's own), as a row damaged outside the kit is claimed
        self.damage_first = False
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.claimed: list[int] = []
        self._receive = provider.receive
        provider.receive = self.receive  # type: ignore[method-assign]

    async def receive(self, sub: Any, max_messages: int) -> list[Delivery]:
        got = await self._receive(sub, max_messages)
        if got and self.armed:
            self.armed = False
            self.claimed += [d.envelope.body["n"] for d in got if d.envelope]  # type: ignore[index]
            self.held.set()
            await self.release.wait()
            if self.damage_first:
                d = got[0]
                bad = MalformedEnvelope("damaged for the test", d.raw)
                got[0] = Delivery(d.queue, d.raw, None, bad, d.attempt, d.handle, lease_until=d.lease_until)
        return got


def job_app(name: str, message: type[QueueMessage], ran: Counter[int]) -> QueueingApp:
    app = QueueingApp(name)

    @app.handler(message)
    async def handle(msg: Any) -> None:
        ran[msg.n] += 1

    return app


def worker_for(rt: Runtime, shutdown_timeout: float) -> Worker:
    worker = Worker(rt, shutdown_timeout=shutdown_timeout, poll_min=0.01, poll_max=0.1, schedules=False)
    # the margins after the deadline, short for the tests (set after construction: on code without
    # them the test fails on what it checks, not on an unknown keyword)
    worker.claim_grace = 1.0
    worker.close_floor = 1.0
    return worker


async def timed(stop: Any) -> float:
    """How long ``stop`` took (awaited under the hung-stop bound)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(stop, STOP_BOUND)
    return loop.time() - began


async def stop_with_the_claim_held_past_the_deadline(worker: Worker, held: HeldClaims, logged: Any) -> None:
    """Start ``worker``, stop it once its claim is committed and held, and let the claim return only
    after the stop's deadline has passed with it out (within its grace); the stop is waited for."""
    await worker.start()
    stopping = None
    try:
        await wait_until(held.held.is_set, what="the claim to commit and be held")
        stopping = asyncio.create_task(worker.shutdown())
        cut_off = logged.on("claim(s) still running at the shutdown deadline")
        await wait_until(cut_off.is_set, what="the stop's deadline to pass with the claim out")
        held.release.set()
        await asyncio.wait_for(stopping, STOP_BOUND)
    finally:
        held.release.set()
        if stopping is None or not stopping.done():
            await asyncio.wait_for(worker.shutdown(), STOP_BOUND)


async def opened(
    sql_db: Any, message: type[QueueMessage], total: int
) -> tuple[Counter[int], SqlProvider, Runtime]:
    ran: Counter[int] = Counter()
    prov = sql_db.provider(settle_with_claims=False)
    rt = Runtime(job_app("stop-bounded", message, ran), prov)
    await rt.open()
    await rt.app.enqueue_many([message(n=i) for i in range(total)])  # type: ignore[call-arg]
    return ran, prov, rt


async def statuses(prov: SqlProvider) -> Counter[str]:
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.status))).all()
    return Counter(r[0] for r in rows)


async def run_the_rest(
    sql_db: Any, message: type[QueueMessage], ran: Counter[int], total: int, runs: int = 1
) -> None:
    """A second worker, on a provider of its own, runs what the first left until every message ran
    (``runs`` times in all)."""
    rt = Runtime(job_app("stop-bounded", message, ran), sql_db.provider())
    await rt.open()
    again = worker_for(rt, 5.0)
    await again.start()
    try:
        await wait_until(lambda: all(ran[n] >= runs for n in range(total)), what="every message to run")
    finally:
        await asyncio.wait_for(again.shutdown(), STOP_BOUND)
    await rt.close()


async def test_a_claim_held_past_the_deadline_is_given_back(sql_db, logged):
    """The claim commits and is held; the stop's deadline passes, then the claim returns within its
    grace: its messages are given back at once (none run, none left leased) and the stop returns; a
    second worker runs each once."""
    total = 5
    ran, prov, rt = await opened(sql_db, Job, total)
    held = HeldClaims(prov)
    worker = worker_for(rt, shutdown_timeout=0.2)
    worker.claim_grace = STOP_BOUND  # the test releases the claim inside it
    await stop_with_the_claim_held_past_the_deadline(worker, held, logged)
    assert held.claimed
    assert set(held.claimed) <= set(range(total))
    assert not ran
    assert await statuses(prov) == Counter({"Pending": total})
    await run_the_rest(sql_db, Job, ran, total)
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_malformed_delivery_in_a_late_claim_is_dead_lettered_not_released(sql_db, logged):
    """The claim held past the deadline brings back a delivery that is not an envelope: it goes to the
    dead letters, as every malformed delivery does (released, it would come back again and again), and
    the rest of the claim is given back."""
    total = 4
    ran, prov, rt = await opened(sql_db, Job, total)
    held = HeldClaims(prov)
    held.damage_first = True
    worker = worker_for(rt, shutdown_timeout=0.2)
    worker.claim_grace = STOP_BOUND
    await stop_with_the_claim_held_past_the_deadline(worker, held, logged)
    assert not ran
    assert await statuses(prov) == Counter({"DeadLettered": 1, "Pending": total - 1})


async def test_a_claim_that_never_returns_is_left_behind(sql_db, logged):
    """The claim commits and never returns: the stop returns after the claim's grace, says so, and the
    messages it took run on a second worker once their lease lapses."""
    total = 3
    ran, prov, rt = await opened(sql_db, Brief, total)
    held = HeldClaims(prov)
    worker = worker_for(rt, shutdown_timeout=0.2)
    await worker.start()
    try:
        await wait_until(held.held.is_set, what="the claim to commit and be held")
        took = await timed(worker.shutdown())
    finally:
        held.release.set()
    assert any("did not come back" in w for w in logged.warnings()), logged.warnings()
    assert took < MARGINS_BOUND  # the stop waited the margins it was given, not the defaults
    assert held.claimed
    assert set(held.claimed) <= set(range(total))
    assert not ran
    await run_the_rest(sql_db, Brief, ran, total)
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_hung_settlement_flush_does_not_hold_the_stop(sql_db, logged):
    """The handler succeeds but its settlement never commits (the database does not answer): the stop
    returns, names the settlement left, and the message is delivered again once its lease lapses
    (at-least-once: it runs twice, and is not lost)."""
    ran, prov, rt = await opened(sql_db, Brief, 1)
    never = asyncio.Event()

    async def settle(settlements: list[Settlement]) -> None:
        await never.wait()

    prov.settle = settle  # type: ignore[method-assign]
    worker = worker_for(rt, shutdown_timeout=0.2)
    await worker.start()
    try:
        await wait_until(lambda: ran[0] == 1, what="the handler to run")
        took = await timed(worker.shutdown())
    finally:
        never.set()
    assert any("1 settlement(s) not committed" in w for w in logged.warnings()), logged.warnings()
    assert took < MARGINS_BOUND  # the stop waited the margins it was given, not the defaults
    await run_the_rest(sql_db, Brief, ran, 1, runs=2)
    assert ran[0] == 2
    assert await statuses(prov) == Counter({"Succeeded": 1})


async def test_a_hung_provider_close_does_not_hold_the_stop(sql_db, logged):
    """The worker opened the provider, so it closes it as it stops; the close never finishes: the stop
    returns and says so."""
    app = job_app("stop-bounded", Job, Counter())
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    close, never = prov.close, asyncio.Event()

    async def hung_close() -> None:
        await never.wait()
        await close()

    prov.close = hung_close  # type: ignore[method-assign]
    worker = worker_for(rt, shutdown_timeout=0.2)
    await worker.start()
    try:
        took = await timed(worker.shutdown())
    finally:
        never.set()  # the fixture's close goes through
    assert any("closing the provider did not finish" in w for w in logged.warnings()), logged.warnings()
    assert took < MARGINS_BOUND  # the stop waited the margins it was given, not the defaults


async def test_a_stop_with_no_wait_gives_back_a_claim_in_flight_quietly(sql_db, logged):
    """``shutdown_timeout=0``: the deadline is the stop itself. A claim in flight comes back in its
    grace: its messages are given back, nothing is left leased, and no warning is logged (nothing
    went wrong)."""
    total = 4
    ran, prov, rt = await opened(sql_db, Job, total)
    held = HeldClaims(prov)
    worker = worker_for(rt, shutdown_timeout=0)
    worker.claim_grace = STOP_BOUND
    await stop_with_the_claim_held_past_the_deadline(worker, held, logged)
    assert logged.warnings() == []
    assert not ran
    assert await statuses(prov) == Counter({"Pending": total})
    await run_the_rest(sql_db, Job, ran, total)
    assert set(ran.values()) == {1}


async def stop_while_the_claim_waits_on_a_lock(
    pg_db: Any, prov: Any, rt: Runtime, then: Callable[[], object] = lambda: None
) -> Worker:
    """Another connection locks the messages table, so the worker's claim waits in the server; the
    worker is stopped while it waits, then the lock goes (and ``then`` is called)."""
    locker = await prov.engine.connect()
    locked = await locker.begin()
    table = f"{pg_db.schema}.{prov.tables.messages.name}"
    await locker.execute(sa.text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
    worker = worker_for(rt, shutdown_timeout=0.2)
    try:
        await worker.start()

        async def claim_waiting() -> bool:
            result = await locker.execute(
                sa.text(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = CAST(:t AS regclass)"
                ),
                {"t": table},
            )
            # (the maintenance task may wait on the lock too: the worker's own claim must be out)
            return bool(result.scalar()) and worker._claims_out() > 0

        await wait_until(claim_waiting, what="the claim to wait on the lock")
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    finally:
        await locked.rollback()
        await locker.close()
        then()
    return worker


async def test_a_claim_waiting_on_a_postgresql_lock_does_not_hold_the_stop(pg_db, logged):
    """Another connection holds the messages table locked, so the worker's claim waits in the server:
    the stop returns after the claim's grace, and once the lock goes a second worker runs every
    message once. The claim left behind is cancelled in the server, but the cancel may arrive after the
    lock went (it travels on a connection of its own, late on a loaded machine): the claim then commits
    and its rows stay leased to the stopped worker until the lease lapses (``Lapsing``: the second worker
    is given that lapse), never run by it and never lost."""
    total = 3
    ran, prov, rt = await opened(pg_db, Lapsing, total)
    await stop_while_the_claim_waits_on_a_lock(pg_db, prov, rt)
    assert any("did not come back" in w for w in logged.warnings()), logged.warnings()
    assert not ran
    await run_the_rest(pg_db, Lapsing, ran, total)
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_claim_left_waiting_on_a_lock_that_goes_through_after_the_stop_loses_nothing(
    pg_db, logged, monkeypatch
):
    """As above, but the claim's cancel never reaches the server (as one that arrives after the lock
    went, late on a loaded machine): once the lock goes the claim commits, its rows leased to the
    stopped worker, none run; they come back when that lease lapses and a second worker runs each
    once."""
    import psycopg

    total = 3
    ran, prov, rt = await opened(pg_db, Lapsing, total)
    released, cancels = asyncio.Event(), Counter[str]()
    cancel_safe = psycopg.AsyncConnection.cancel_safe

    async def lost_until_released(self: Any, *, timeout: float = 30.0) -> None:
        # the claim's cancel (called under the provider's receive) is lost; any other (the
        # maintenance's, also waiting on the lock) goes through
        if any(f.name == "receive" and f.filename.endswith("provider.py") for f in traceback.extract_stack()):
            cancels["lost"] += 1
            await released.wait()
            return
        cancels["sent"] += 1
        await cancel_safe(self, timeout=timeout)

    monkeypatch.setattr(psycopg.AsyncConnection, "cancel_safe", lost_until_released)
    worker = await stop_while_the_claim_waits_on_a_lock(pg_db, prov, rt, then=released.set)
    assert any("did not come back" in w for w in logged.warnings()), logged.warnings()
    m = prov.tables.messages

    async def leased_to_the_stopped_worker() -> bool:
        async with prov.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(sa.func.count()).where(m.c.locked_by == worker.worker_id, m.c.status == "Leased")
            )
            return bool(rows.scalar_one())

    await wait_until(leased_to_the_stopped_worker, what="the claim left behind to go through")
    assert cancels["lost"] == 1
    assert not ran
    await run_the_rest(pg_db, Lapsing, ran, total)
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


async def test_a_consumer_cancelled_while_waiting_for_work_cancels_that_wait(sql_db):
    """A consumer cancelled (not stopped) while it waits for work between polls: the wait it started
    is cancelled with it, not left running behind it (on the provider, until its timeout)."""
    ran: Counter[int] = Counter()
    prov = sql_db.provider()
    rt = Runtime(job_app("stop-bounded", Job, ran), prov)
    await rt.open()
    waiting, cancelled = asyncio.Event(), asyncio.Event()
    wait_for_work = prov.wait_for_work

    async def watched(sub: Any, timeout: float) -> None:
        waiting.set()
        try:
            await wait_for_work(sub, timeout)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    prov.wait_for_work = watched  # type: ignore[method-assign]
    worker = Worker(rt, poll_min=30.0, poll_max=30.0, schedules=False)
    await worker.start()
    try:
        await wait_until(waiting.is_set, what="the consumer to wait for work")
        consumer = worker._consumers[0]
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await wait_until(cancelled.is_set, timeout=10, what="the wait for work to be cancelled")
    finally:
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)


async def test_no_claim_starts_after_a_stop_that_came_during_a_control_read(sql_db):
    """A queue with a circuit breaker reads the control store before each claim; the stop comes while
    that read is held: once it answers, the consumer leaves without claiming."""
    ran: Counter[int] = Counter()
    prov = sql_db.provider()
    rt = Runtime(job_app("stop-bounded", Guarded, ran), prov)
    await rt.open()
    worker = worker_for(rt, shutdown_timeout=STOP_BOUND)
    receive, receives = prov.receive, Counter[bool]()

    async def counted(sub: Any, max_messages: int) -> list[Delivery]:
        receives[worker._stopping.is_set()] += 1
        return await receive(sub, max_messages)

    prov.receive = counted  # type: ignore[method-assign]
    state, reading, answer = rt.control.state, asyncio.Event(), asyncio.Event()
    armed = False

    async def held_state() -> Any:
        if armed:
            reading.set()
            await answer.wait()
        return await state()

    rt.control.state = held_state  # type: ignore[method-assign]
    await worker.start()
    stopping = None
    try:
        await wait_until(lambda: receives[False] > 0, what="the consumer to claim once")
        armed = True
        await wait_until(reading.is_set, what="the consumer to read the control store")
        stopping = asyncio.create_task(worker.shutdown())
        await wait_until(worker._stopping.is_set, what="the stop to begin")
        answer.set()
        await asyncio.wait_for(stopping, STOP_BOUND)
    finally:
        answer.set()
        if stopping is None:
            await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    assert receives[True] == 0, receives


async def test_a_second_shutdown_waits_for_the_first(sql_db):
    """A second ``shutdown()`` while the first closes the provider returns only once the provider is
    closed, and the provider is closed once."""
    prov = sql_db.provider()
    rt = Runtime(job_app("stop-bounded", Job, Counter()), prov)
    close, closing, finish = prov.close, asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def slow_close() -> None:
        events.append("close")
        closing.set()
        await finish.wait()
        await close()
        events.append("closed")

    prov.close = slow_close  # type: ignore[method-assign]
    worker = worker_for(rt, shutdown_timeout=0.2)
    worker.close_floor = STOP_BOUND  # the test ends the close itself
    await worker.start()

    async def second() -> None:
        await worker.shutdown()
        events.append("second returned")

    first = asyncio.create_task(worker.shutdown())
    try:
        await wait_until(closing.is_set, what="the first stop to close the provider")
        later = asyncio.create_task(second())
        # (a second call that does not wait returns at its first step: give it the chance to)
        await asyncio.wait({later}, timeout=0.5)
        finish.set()
        await asyncio.wait_for(asyncio.gather(first, later), STOP_BOUND)
    finally:
        finish.set()
        await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), STOP_BOUND)
    assert events == ["close", "closed", "second returned"], events


async def test_a_first_shutdown_cancelled_leaves_the_stop_to_finish(sql_db):
    """The first ``shutdown()``'s caller cancelled mid-stop (a ``wait_for`` that timed out): the stop
    goes on to the provider's close, and a later call waits for it, not returning at once over a
    worker left half stopped."""
    prov = sql_db.provider()
    rt = Runtime(job_app("stop-bounded", Job, Counter()), prov)
    close, closing, finish = prov.close, asyncio.Event(), asyncio.Event()
    events: list[str] = []

    async def slow_close() -> None:
        closing.set()
        await finish.wait()
        await close()
        events.append("closed")

    prov.close = slow_close  # type: ignore[method-assign]
    worker = worker_for(rt, shutdown_timeout=0.2)
    worker.close_floor = STOP_BOUND  # the test ends the close itself
    await worker.start()
    first = asyncio.create_task(worker.shutdown())
    try:
        await wait_until(closing.is_set, what="the first stop to close the provider")
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert first.cancelled()
        later = asyncio.create_task(worker.shutdown())
        await asyncio.wait({later}, timeout=0.5)
        assert not later.done()  # (the stop is still closing the provider: the later call waits)
        finish.set()
        await asyncio.wait_for(later, STOP_BOUND)
    finally:
        finish.set()
    assert events == ["closed"]


async def test_serve_returns_with_a_request_that_never_finishes(sql_db, monkeypatch):
    """``queueing serve`` with the ops API: a request is held open by a handler that never finishes
    when the worker is asked to stop; the API's shutdown is bounded, so serving returns."""
    import queueing_core.ops.api as ops_api

    entered, never = asyncio.Event(), asyncio.Event()
    create_app = ops_api.create_app

    def with_a_hung_route(*args: Any, **kwargs: Any) -> Any:
        inner = create_app(*args, **kwargs)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/hang":
                entered.set()
                await never.wait()
            await inner(scope, receive, send)

        return app

    monkeypatch.setattr(ops_api, "create_app", with_a_hung_route)
    rt = Runtime(job_app("stop-bounded", Job, Counter()), sql_db.provider())
    worker = worker_for(rt, shutdown_timeout=0.2)
    port = free_port()
    cfg = QueueingSettings(api_key=None)
    serving = asyncio.create_task(serve_worker_and_api(worker, cfg, "127.0.0.1", port))
    writer = None
    try:
        await wait_until(worker.started.is_set, what="the worker to start")

        async def connected() -> bool:
            nonlocal writer
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            return True

        await wait_until(connected, what="the API to listen")
        assert writer is not None
        writer.write(b"GET /hang HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        await wait_until(entered.is_set, what="the request to reach its handler")
        worker.request_stop()
        await asyncio.wait_for(serving, STOP_BOUND)
    finally:
        never.set()
        if writer is not None:
            writer.close()
        if not serving.done():
            worker.request_stop()
            await asyncio.wait_for(serving, STOP_BOUND)


async def test_claims_beside_the_loop_are_given_back_or_left_behind(sql_db, logged):
    """Two receives in flight (``receives_in_flight=2``), both claims committed and held when the stop
    comes: one comes back within its grace and what it took is given back, the other never comes back
    in time and is left behind (what it brings back later is not run). Nothing is lost: a second
    worker runs every message exactly once."""
    total = 40
    ran: Counter[int] = Counter()
    # no sweep in this worker (its maintainer is stopped below: its first sweep comes at a random
    # moment within the interval, and one within the stop would mark the left claim's rows Failed):
    # the claim left behind keeps its rows leased until the second worker's
    prov = sql_db.provider(maintenance_interval=STOP_BOUND)
    assert prov.capabilities.overlapping_receives
    rt = Runtime(job_app("stop-bounded", Ahead, ran), prov)
    await rt.open()
    await rt.app.enqueue_many([Ahead(n=i) for i in range(total)])
    worker = Worker(
        rt, shutdown_timeout=0.2, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=2, schedules=False
    )
    worker.receives_in_flight = 2
    worker.claim_grace = 5.0  # the test releases the first held claim inside it
    worker.close_floor = 1.0
    claims = Claims(prov, worker)
    releases = {2: asyncio.Event(), 3: asyncio.Event()}
    held: list[int] = []

    async def hold_after_commit(call: int) -> None:
        if call in releases:  # the first comes back full, so the next ones run beside the loop
            held.append(call)
            await releases[call].wait()

    claims.after_commit = hold_after_commit
    await worker.start()
    assert worker._maintainer is not None
    worker._maintainer.cancel()
    stopping = None
    try:
        await wait_until(lambda: len(held) == 2, what="two claims committed and held")
        assert worker._claims  # beside the loop
        stopping = asyncio.create_task(worker.shutdown())
        cut_off = logged.on("2 claim(s) still running at the shutdown deadline")
        await wait_until(cut_off.is_set, what="the stop's deadline to pass with both claims out")
        releases[2].set()
        await asyncio.wait_for(stopping, STOP_BOUND)
        assert any("1 claim(s) did not come back" in w for w in logged.warnings()), logged.warnings()
        releases[3].set()  # it comes back after the stop went on without it
        await wait_until(lambda: claims.active == 0, what="the claim left behind to return")
    finally:
        for release in releases.values():
            release.set()
        if stopping is None or not stopping.done():
            await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    first, given_back, left = claims.by_call[1], claims.by_call[2], claims.by_call[3]
    assert set(ran) == set(first)  # neither held claim's messages ran here
    counts = await statuses(prov)
    assert counts == Counter(
        {"Succeeded": len(first), "Leased": len(left), "Pending": total - len(first) - len(left)}
    ), (counts, given_back)
    await run_the_rest(sql_db, Ahead, ran, total)
    assert set(ran.values()) == {1}
    assert await statuses(prov) == Counter({"Succeeded": total})


@pytest.mark.parametrize("swallows_cancel", [False, True], ids=["cancelled", "swallows-cancel"])
async def test_settlements_riding_in_a_claim_left_behind_are_flushed_or_counted(
    sql_db, logged, swallows_cancel
):
    """With settlements carried by the next claim (``settle_with_claims``), that claim never comes
    back: the stop goes on without it. Cancelled, the claim gives its settlement back and the final
    flush commits it; a provider that swallows the cancel keeps it, and the stop counts it as not
    committed; when that claim returns at last, what it brings is not dispatched nor given back (the
    settler is closed): its rows come back when their leases lapse. Either way a second worker runs
    what was left, and every message ends done."""
    total = 5
    ran: Counter[int] = Counter()
    prov = sql_db.provider(settle_with_claims=True)
    rt = Runtime(job_app("stop-bounded", Single, ran), prov)
    await rt.open()
    assert prov.settles_with_claims()
    await rt.app.enqueue_many([Single(n=i) for i in range(total)])
    carried: list[Settlement] = []
    riding, answer, returned = asyncio.Event(), asyncio.Event(), asyncio.Event()
    settle_and_receive = prov.settle_and_receive

    async def hung(settlements: list[Settlement], sub: Any, max_messages: int) -> list[Delivery]:
        if settlements and not riding.is_set():
            carried.extend(settlements)
            riding.set()
            while not answer.is_set():  # the database does not answer (nothing committed yet)
                try:
                    await answer.wait()
                except asyncio.CancelledError:
                    if not swallows_cancel:
                        raise
            try:
                return await settle_and_receive(settlements, sub, max_messages)
            finally:
                returned.set()
        return await settle_and_receive(settlements, sub, max_messages)

    prov.settle_and_receive = hung  # type: ignore[method-assign]
    worker = Worker(
        rt,
        shutdown_timeout=0.2,
        poll_min=0.01,
        poll_max=0.1,
        batch_size=1,
        settle_hold=STOP_BOUND,
        schedules=False,
    )
    worker.claim_grace = 1.0
    worker.close_floor = 1.0
    await worker.start()
    consumers = list(worker._consumers)
    try:
        await wait_until(riding.is_set, what="a claim to carry a settlement and hang")
        took = await timed(worker.shutdown())
        if swallows_cancel:
            answer.set()  # the claim commits at last, after the stop went on without it
            await wait_until(returned.is_set, what="the claim left behind to return")
            await wait_until(lambda: all(c.done() for c in consumers), what="its consumer to end")
            assert worker.settler.unsettled == 0  # nothing given back into the closed settler
    finally:
        answer.set()
    warnings = logged.warnings()
    assert any("did not come back" in w for w in warnings), warnings
    counted = any(f"{len(carried)} settlement(s) not committed" in w for w in warnings)
    assert counted == swallows_cancel, warnings
    assert took < MARGINS_BOUND
    assert carried
    done = [s.delivery.envelope.body["n"] for s in carried if s.delivery.envelope]  # type: ignore[index]
    await run_the_rest(sql_db, Single, ran, total)
    assert all(ran[n] == 1 for n in done), (ran, done)  # its settlement was committed: not run again
    assert await statuses(prov) == Counter({"Succeeded": total})
