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
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import MalformedEnvelope
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from queueing_core.worker import Worker
from tests.contract.harness import wait_until

#: how long a test lets a stop take before it calls it hung (the stops here need a second or two)
STOP_BOUND = 60.0
#: the lease of the messages whose claims the tests leave behind: they come back after it
SHORT_LEASE = timedelta(seconds=2)


@queue("stop-bounded", lease_duration=timedelta(seconds=60))
class Job(QueueMessage):
    n: int


@queue("stop-bounded-short", lease_duration=SHORT_LEASE)
class Brief(QueueMessage):
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
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    finally:
        held.release.set()
    assert any("did not come back" in w for w in logged.warnings()), logged.warnings()
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
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    finally:
        never.set()
    assert any("1 settlement(s) not committed" in w for w in logged.warnings()), logged.warnings()
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
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    finally:
        never.set()  # the fixture's close goes through
    assert any("closing the provider did not finish" in w for w in logged.warnings()), logged.warnings()


async def test_a_stop_with_no_wait_gives_back_a_claim_in_flight_quietly(sql_db, logged):
    """``shutdown_timeout=0``: the deadline is the stop itself. A claim in flight comes back in its
    grace: its messages are given back, nothing is left leased, and no warning is logged (nothing
    went wrong)."""
    total = 4
    ran, prov, rt = await opened(sql_db, Job, total)
    held = HeldClaims(prov)
    worker = worker_for(rt, shutdown_timeout=0)
    worker.claim_grace = STOP_BOUND
    await worker.start()
    stopping = None
    try:
        await wait_until(held.held.is_set, what="the claim to commit and be held")
        stopping = asyncio.create_task(worker.shutdown())
        cut_off = logged.on("claim(s) still running at the shutdown deadline")
        await wait_until(cut_off.is_set, what="the stop to reach its deadline")
        held.release.set()
        await asyncio.wait_for(stopping, STOP_BOUND)
    finally:
        held.release.set()
        if stopping is None or not stopping.done():
            await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    assert logged.warnings() == []
    assert not ran
    assert await statuses(prov) == Counter({"Pending": total})
    await run_the_rest(sql_db, Job, ran, total)
    assert set(ran.values()) == {1}


async def test_a_claim_waiting_on_a_postgresql_lock_does_not_hold_the_stop(pg_db, logged):
    """Another connection holds the messages table locked, so the worker's claim waits in the server:
    the stop returns after the claim's grace, and once the lock goes a second worker runs every
    message once (the claim left behind took nothing)."""
    total = 3
    ran, prov, rt = await opened(pg_db, Job, total)
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
            return bool(result.scalar())

        await wait_until(claim_waiting, what="the claim to wait on the lock")
        await asyncio.wait_for(worker.shutdown(), STOP_BOUND)
    finally:
        await locked.rollback()
        await locker.close()
    assert any("did not come back" in w for w in logged.warnings()), logged.warnings()
    assert not ran
    await run_the_rest(pg_db, Job, ran, total)
    assert set(ran.values()) == {1}


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
