"""``receives_in_flight="auto"`` (the default) on SQLite and PostgreSQL: a lone worker on PostgreSQL tries
a second claim while its queue is full, and loses nothing by it; a worker that finds another worker's
lease in the database, and any worker on SQLite, keeps one claim at a time; and the provider's answer
to "am I the only one holding leases?" is read from the database's rows, by lease owner."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker
from tests.contract.harness import wait_until

from .history_rows import fill
from .test_sql_history_plan import nodes
from .test_worker_receives_in_flight import Claims, statuses

TOTAL = 600  # enough full claims of 10 for a trial's first window and the start of its second


@queue("auto_claims", lease_duration=timedelta(seconds=60))
class Job(QueueMessage):
    n: int


@queue("elsewhere", lease_duration=timedelta(seconds=60))
class Other(QueueMessage):
    n: int


def jobs_app(ran: Counter[int]) -> QueueingApp:
    app = QueueingApp("auto-claims")

    @app.handler(max_concurrency=10)
    async def handle(msg: Job) -> None:
        ran[msg.n] += 1

    return app


def other_app() -> QueueingApp:
    """Another worker's app, on another queue of the same database."""
    app = QueueingApp("auto-claims-other")

    @app.handler()
    async def handle(msg: Other) -> None:
        return None

    return app


async def burn_down(
    sql_db: Any, *, other_worker_holds_a_lease: bool = False
) -> tuple[Claims, Counter[int], Any]:
    """TOTAL jobs run by one default worker (``receives_in_flight`` left as it comes); what its claims
    did, what ran, and the provider."""
    ran: Counter[int] = Counter()
    app = jobs_app(ran)
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    if other_worker_holds_a_lease:
        # another worker's claim, of another queue, held for the whole run
        theirs = other_app()
        other = sql_db.provider(worker_id="another-worker")
        await Runtime(theirs, other).open()
        await theirs.enqueue(Other(n=1))
        assert len(await other.receive(theirs.subscription("Other"), 1)) == 1
    await app.enqueue_many([Job(n=i) for i in range(TOTAL)])
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=10, schedules=False)
    assert worker.receives_in_flight == "auto"  # the default
    claims = Claims(prov, worker)
    await worker.start()
    try:
        await wait_until(lambda: len(ran) == TOTAL, what="every job to run", timeout=60)
    finally:
        await worker.shutdown()
    return claims, ran, prov


async def test_a_lone_worker_on_postgresql_tries_a_second_claim_and_loses_nothing(sql_db):
    claims, ran, prov = await burn_down(sql_db)
    assert set(ran.values()) == {1}  # each job once
    assert (await statuses(prov))["Succeeded"] == TOTAL
    assert claims.most_taken <= 20  # never more claimed than the slots, two claims or one
    # PostgreSQL: alone, a trial runs a window of two claims while the queue is full. SQLite: one writer,
    # which runs two claims one after the other: never two
    assert claims.most_active == (2 if sql_db.backend == "postgresql" else 1)


async def test_another_workers_lease_keeps_one_claim_at_a_time(sql_db):
    claims, ran, prov = await burn_down(sql_db, other_worker_holds_a_lease=True)
    assert set(ran.values()) == {1}
    assert (await statuses(prov))["Succeeded"] == TOTAL
    assert claims.most_active == 1


async def test_the_provider_tells_its_own_leases_from_another_workers(sql_db):
    if sql_db.backend != "postgresql":
        prov = sql_db.provider()
        await prov.open(jobs_app(Counter()))
        assert await prov.sole_claimer() is False  # (SQLite: never a second claim)
        return
    app = jobs_app(Counter())
    mine, theirs = sql_db.provider(worker_id="me"), sql_db.provider(worker_id="them")
    await Runtime(app, mine).open()
    await theirs.open(app)
    assert await mine.sole_claimer() is True  # nothing leased
    await app.enqueue_many([Job(n=i) for i in range(3)])
    got = await mine.receive(app.subscription("Job"), 2)
    assert len(got) == 2
    assert await mine.sole_claimer() is True  # only its own leases
    assert len(await theirs.receive(app.subscription("Job"), 1)) == 1
    assert await mine.sole_claimer() is False  # another worker holds one
    assert await theirs.sole_claimer() is False


@queue("auto_claims_too", lease_duration=timedelta(seconds=60))
class Job2(QueueMessage):
    n: int


class PerQueue:
    """Claims in flight at once, per queue, and the questions asked of the provider."""

    def __init__(self, prov: Any) -> None:
        self.active: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.asked = 0
        receive, ask = prov.receive, prov.sole_claimer

        async def counted_receive(sub: Any, n: int) -> Any:
            self.active[sub.queue] += 1
            self.most[sub.queue] = max(self.most[sub.queue], self.active[sub.queue])
            try:
                return await receive(sub, n)
            finally:
                self.active[sub.queue] -= 1

        async def counted_ask() -> bool:
            self.asked += 1
            return bool(await ask())

        prov.receive = counted_receive
        prov.sole_claimer = counted_ask


async def test_two_backlogged_queues_of_one_worker_keep_one_claim_each(pg_db):
    """Each queue's trial would judge by its own rate, at the other's expense: with two of its queues
    full, a lone worker claims one at a time on each."""
    ran: Counter[str] = Counter()
    app = QueueingApp("auto-claims-two")

    @app.handler(max_concurrency=10)
    async def one(msg: Job) -> None:
        ran["one"] += 1

    @app.handler(max_concurrency=10)
    async def two(msg: Job2) -> None:
        ran["two"] += 1

    prov = pg_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    await app.enqueue_many([Job(n=i) for i in range(TOTAL)])
    await app.enqueue_many([Job2(n=i) for i in range(TOTAL)])
    seen = PerQueue(prov)
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=10, schedules=False)
    await worker.start()
    try:
        await wait_until(lambda: ran["one"] == ran["two"] == TOTAL, what="both queues to run")
    finally:
        await worker.shutdown()
    assert seen.most == {"auto_claims": 1, "auto_claims_too": 1}


async def test_where_two_claims_cannot_fit_nothing_is_asked(pg_db):
    """One slot: a second claim could never start beside a first, so ``"auto"`` neither asks the
    database nor tries one."""
    ran: Counter[int] = Counter()
    app = QueueingApp("auto-claims-small")

    @app.handler(max_concurrency=1)
    async def handle(msg: Job) -> None:
        ran[msg.n] += 1

    prov = pg_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    await app.enqueue_many([Job(n=i) for i in range(200)])
    seen = PerQueue(prov)
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, schedules=False)
    await worker.start()
    try:
        await wait_until(lambda: len(ran) == 200, what="every job")
    finally:
        await worker.shutdown()
    assert seen.asked == 0
    assert seen.most["auto_claims"] == 1


async def unanswered(sql_db: Any) -> tuple[Worker, Claims, Counter[int], dict[str, int]]:
    """A worker over TOTAL jobs whose provider never answers whether it is the only one claiming;
    what ran, and how many times it was asked (``asked["n"]``)."""
    ran: Counter[int] = Counter()
    app = jobs_app(ran)
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    asked = {"n": 0}

    async def never_answers() -> bool:
        asked["n"] += 1
        await asyncio.Event().wait()
        return True

    prov.sole_claimer = never_answers  # type: ignore[method-assign]
    await app.enqueue_many([Job(n=i) for i in range(TOTAL)])
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, prefetch=2, batch_size=10, schedules=False)
    return worker, Claims(prov, worker), ran, asked


async def test_an_unanswered_question_does_not_hold_the_claims(sql_db):
    """Asked between claims and unanswered, the consumer claims on (one at a time) after a second."""
    worker, claims, ran, asked = await unanswered(sql_db)
    await worker.start()
    try:
        await wait_until(lambda: len(ran) == TOTAL, what="every job, the question unanswered")
    finally:
        await worker.shutdown()
    assert asked["n"] >= 1
    assert claims.most_active == 1


async def test_a_stop_does_not_wait_for_the_answer(sql_db):
    worker, _, _, asked = await unanswered(sql_db)
    await worker.start()
    try:
        await wait_until(lambda: asked["n"] >= 1, what="the question")
    finally:
        started = time.monotonic()
        await worker.shutdown()
        stopped_in = time.monotonic() - started
    # (waiting for the answer it would give up on, the stop would take most of a second)
    assert stopped_in < 0.8, stopped_in


async def test_the_question_reads_the_lease_index_not_the_history(pg_db):
    """Asked every second by every backlogged worker: under 100,000 rows of history it reads the lease
    sweeper's partial index, never the table."""
    prov = pg_db.provider(listen=False)
    await prov.open(jobs_app(Counter()))
    await fill(prov, ("auto_claims",))
    async with prov.engine.connect() as conn:
        compiled = prov.statements.other_claimer.compile(dialect=conn.dialect)
        raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {compiled}", compiled.params)).scalar_one()
    plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    used = [n for n in nodes(plan) if n.get("Relation Name") == prov.tables.messages.name]
    assert used, json.dumps(plan, indent=1)
    assert {n.get("Index Name") for n in used} == {"ix_queueing_messages_leased"}, json.dumps(plan, indent=1)


@pytest.fixture(autouse=True)
def _quiet_worker_logs(caplog):
    caplog.set_level("WARNING", logger="queueing")
