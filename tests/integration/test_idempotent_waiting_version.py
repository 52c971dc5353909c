"""What an identical (or changed) enqueue of an idempotent type does with the waiting version, on the
in-process transport (the identity's document in the control store) and on SQL (the messages table).

Found by a review:

- off SQL, a cancel writes its request into the control store and then the history; when the history
  write failed, the history still said the version waits, and an identical enqueue was discarded
  against it: the version was then settled Cancelled without running, and neither request ran. A
  standing cancellation request now makes the waiting version one that cannot stand for the enqueue,
  as on SQL;
- an identical enqueue asking to run now was discarded against a version sleeping for days: the run
  asked for now came days later (past its own expiry). On SQL the discard now brings the waiting row
  forward to the time asked for; elsewhere a queued message cannot be brought forward, so the new one
  is sent and supersedes the waiting one;
- on SQL a changed body kept the replaced version's correlation id and creation time; elsewhere the new
  version is a message of its own, with its own. SQL now takes the new version's too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from queueing_core import HandlerContext, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.clock import as_utc, utcnow
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from tests.integration.conftest import SqlDb
from tests.services import POSTGRES_URL, drop_schema, require


@queue("idem-waiting", idempotent=True, identity="sku")
class Price(QueueMessage):
    sku: str
    cents: int


class Clock:
    """A clock that moves only when the test moves it (started at the real time: the in-process
    transport schedules by the real clock, and the delays here are days long)."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> datetime:
        return self.now


Make = Callable[[QueueingApp, Clock], Runtime]


@pytest.fixture(params=["inprocess", "sqlite", "postgres"])
async def make(request, tmp_path):
    """Builds a runtime of the app on the transport named by the parameter."""
    if request.param == "inprocess":
        yield lambda app, clock: Runtime(app, InProcessProvider(), clock=clock)
        return
    if request.param == "sqlite":
        db = SqlDb("sqlite", f"sqlite:///{tmp_path}/q.db", None)
    else:
        require("PostgreSQL", "127.0.0.1", 5432)
        db = SqlDb("postgresql", POSTGRES_URL, f"qi_{uuid.uuid4().hex[:10]}")
    yield lambda app, clock: Runtime(app, db.provider(clock=clock), clock=clock)
    for p in db.providers:
        await p.close()
    if db.schema is not None:
        await drop_schema(db.schema)


def _sql(rt: Runtime) -> bool:
    return rt.provider.capabilities.durable_history


def _app(runs: list[tuple[int, str | None, datetime]]) -> QueueingApp:
    app = QueueingApp("idem-waiting")

    @app.handler()
    async def handle(msg: Price, ctx: HandlerContext) -> None:
        runs.append((msg.cents, msg.correlation_id, msg.created_at))

    return app


def _start(make: Make) -> tuple[Clock, list[tuple[int, str | None, datetime]], QueueingApp, Runtime]:
    """A clock, the runs' record, the app and its runtime on the fixture's transport."""
    clock = Clock()
    runs: list[tuple[int, str | None, datetime]] = []
    app = _app(runs)
    return clock, runs, app, make(app, clock)


# -- a standing cancellation request -----------------------------------------------------------------


async def test_an_identical_enqueue_is_not_discarded_against_a_version_whose_cancel_stands(
    make: Make,
) -> None:
    """The request stands, the history still says the version waits (off SQL: the cancel's history
    write failed; on SQL: the cancel stopped before it took the row out of the queue)."""
    clock, runs, app, rt = _start(make)
    async with rt:
        first = await app.enqueue(Price(sku="A", cents=1))
        await rt.control.set_cancel(first.message_id, True, clock())
        assert (await rt.tracker.get(first.message_id)).status == MessageStatus.PENDING
        again = await app.enqueue(Price(sku="A", cents=1))
        await run_until_idle(rt)
        first_status = (await app.status(first.message_id)).status
        again_status = (await app.status(again.message_id)).status
    assert again.outcome == "enqueued", f"discarded against {first.message_id}, which ended {first_status}"
    assert again.message_id != first.message_id
    assert [r[0] for r in runs] == [1]
    assert first_status == MessageStatus.CANCELLED  # the cancel holds for the version it named
    assert again_status == MessageStatus.SUCCEEDED


async def test_a_cancel_whose_history_write_failed_does_not_swallow_the_next_enqueue() -> None:
    """The review's case as a caller meets it (off SQL): ``app.cancel`` fails after its request was
    written, and the caller asks for the same work again."""
    runs: list[tuple[int, str | None, datetime]] = []
    app = _app(runs)
    rt = Runtime(app, InProcessProvider())
    async with rt:
        first = await app.enqueue(Price(sku="B", cents=2))
        real = rt.tracker.change_if_unchanged  # type: ignore[attr-defined]
        failed = []

        async def unreachable(seen, changes):
            if not failed:
                failed.append(True)
                raise ConnectionError("history store briefly unreachable")
            return await real(seen, changes)

        rt.tracker.change_if_unchanged = unreachable  # type: ignore[attr-defined]
        with pytest.raises(ConnectionError):
            await app.cancel(first.tracking_id)
        rt.tracker.change_if_unchanged = real  # type: ignore[attr-defined]
        assert (await rt.tracker.get(first.message_id)).status == MessageStatus.PENDING
        again = await app.enqueue(Price(sku="B", cents=2))
        await run_until_idle(rt)
        first_status = (await rt.tracker.get(first.message_id)).status
    assert again.outcome == "enqueued"
    assert again.supersedes == first.message_id
    assert [r[0] for r in runs] == [2]
    assert first_status == MessageStatus.CANCELLED


# -- a waiting version due later than the enqueue asks --------------------------------------------------


async def test_an_identical_enqueue_asking_to_run_now_runs_now_not_when_the_sleeping_version_is_due(
    make: Make,
) -> None:
    clock, runs, app, rt = _start(make)
    async with rt:
        later = await app.enqueue(
            Price(sku="C", cents=3), delay=timedelta(days=3), expires_at=clock() + timedelta(days=4)
        )
        assert later.status == MessageStatus.SLEEPING
        asap = await app.enqueue(Price(sku="C", cents=3))  # no delay: run now (default expiry: hours)
        assert asap.not_before is None
        if _sql(rt):
            # the waiting row stands for it, brought forward to now
            assert asap.outcome == "discarded"
            assert asap.message_id == later.message_id
            row = await rt.tracker.get(later.message_id)
            assert row.status == MessageStatus.PENDING
            assert row.not_before is None
            assert as_utc(row.expires_at) >= as_utc(asap.expires_at)  # it lives as long as asked
        else:
            # the queued message cannot be brought forward: the new one is sent and supersedes it
            assert asap.outcome == "enqueued"
            assert asap.supersedes == later.message_id
        assert await run_until_idle(rt) >= 1
        assert [r[0] for r in runs] == [3]  # the run asked for now, now
        status = (await app.status(asap.tracking_id)).status
    assert status == MessageStatus.SUCCEEDED


async def test_an_earlier_delay_brings_a_later_sleeping_version_forward(make: Make) -> None:
    """Asked for in one day, against a version due in three: due in one day (no sooner, no later)."""
    clock, runs, app, rt = _start(make)
    async with rt:
        later = await app.enqueue(
            Price(sku="D", cents=4), delay=timedelta(days=3), expires_at=clock() + timedelta(days=4)
        )
        sooner = await app.enqueue(
            Price(sku="D", cents=4), delay=timedelta(days=1), expires_at=clock() + timedelta(days=4)
        )
        assert sooner.not_before == clock() + timedelta(days=1)
        if _sql(rt):
            assert sooner.outcome == "discarded"
            row = await rt.tracker.get(later.message_id)
            assert row.status == MessageStatus.SLEEPING
            assert as_utc(row.not_before) == sooner.not_before
            assert await run_until_idle(rt) == 0  # not due yet
            clock.now += timedelta(days=1, seconds=1)
            assert await run_until_idle(rt) == 1
            assert [r[0] for r in runs] == [4]
        else:
            assert sooner.outcome == "enqueued"
            assert sooner.supersedes == later.message_id
            assert (await rt.tracker.get(sooner.message_id)).not_before == sooner.not_before
            assert await run_until_idle(rt) == 0  # not due yet (the in-process clock is the real one)


async def test_an_identical_enqueue_is_still_discarded_against_a_version_due_no_later(make: Make) -> None:
    """Bringing forward changes nothing where the waiting version is due no later than asked."""
    _, runs, app, rt = _start(make)
    async with rt:
        now = await app.enqueue(Price(sku="E", cents=5))
        in_an_hour = await app.enqueue(Price(sku="E", cents=5), delay=timedelta(hours=1))
        sleeping = await app.enqueue(Price(sku="F", cents=6), delay=timedelta(hours=1))
        in_two = await app.enqueue(Price(sku="F", cents=6), delay=timedelta(hours=2))
        row = await rt.tracker.get(sleeping.message_id)
        assert await run_until_idle(rt) == 1
    assert (in_an_hour.outcome, in_an_hour.message_id) == ("discarded", now.message_id)
    assert (in_two.outcome, in_two.message_id) == ("discarded", sleeping.message_id)
    assert as_utc(row.not_before) == sleeping.not_before  # left as it was
    assert [r[0] for r in runs] == [5]


async def test_a_version_waiting_for_its_retry_does_not_hold_back_a_run_asked_for_now(make: Make) -> None:
    clock = Clock()
    runs: list[int] = []
    app = QueueingApp("idem-waiting-retry")

    @app.handler()
    async def handle(msg: Price) -> None:
        runs.append(msg.cents)
        if len(runs) == 1:
            from queueing_core.errors import Retry

            raise Retry(timedelta(days=2), "downstream down for the weekend")

    rt = make(app, clock)
    async with rt:
        first = await app.enqueue(Price(sku="G", cents=7))
        await run_until_idle(rt, raise_errors=False)
        assert (await app.status(first.message_id)).status == MessageStatus.FAILED
        again = await app.enqueue(Price(sku="G", cents=7))
        await run_until_idle(rt, raise_errors=False)
    assert again.outcome == ("discarded" if _sql(rt) else "enqueued")
    assert runs == [7, 7]  # the second run now, not in two days


async def test_a_brought_forward_row_wakes_a_listening_worker_elsewhere(pg_db) -> None:
    """PostgreSQL: a worker in another process, idle until the old due time, is told at the commit."""
    clock = Clock()
    app = _app([])
    rt = Runtime(app, pg_db.provider(clock=clock), clock=clock)
    other = pg_db.provider(clock=clock)
    async with rt:
        await other.open(app)
        assert other._listener is not None
        await asyncio.wait_for(other._listener.connected.wait(), 10)
        await app.enqueue(
            Price(sku="H", cents=8), delay=timedelta(days=3), expires_at=clock() + timedelta(days=4)
        )
        sub = app.subscription("Price")
        assert sub is not None
        other._wakeups[sub.queue].clear()
        other._next_due.pop(sub.queue, None)
        asap = await app.enqueue(Price(sku="H", cents=8))
        assert asap.outcome == "discarded"
        began = time.monotonic()
        await other.wait_for_work(sub, 20.0)
        waited = time.monotonic() - began
    assert waited < 10.0, f"the other worker slept {waited:.1f}s: it was not woken"


async def test_a_brought_forward_row_wakes_a_worker_of_this_process(tmp_path) -> None:
    """SQLite (no NOTIFY): a worker of the enqueuing process looks again at once."""
    clock = Clock()
    app = _app([])
    db = SqlDb("sqlite", f"sqlite:///{tmp_path}/q.db", None)
    p = db.provider(clock=clock)
    rt = Runtime(app, p, clock=clock)
    async with rt:
        await app.enqueue(
            Price(sku="I", cents=9), delay=timedelta(days=3), expires_at=clock() + timedelta(days=4)
        )
        sub = app.subscription("Price")
        assert sub is not None
        p._wakeups[sub.queue].clear()
        p._next_due.pop(sub.queue, None)
        assert (await app.enqueue(Price(sku="I", cents=9))).outcome == "discarded"
        began = time.monotonic()
        await p.wait_for_work(sub, 20.0)
        waited = time.monotonic() - began
    await p.close()
    assert waited < 10.0, f"the worker slept {waited:.1f}s: it was not woken"


# -- a changed body: the new version's correlation id and creation time -----------------------------------


async def test_a_changed_version_carries_its_own_correlation_id_and_creation_time(make: Make) -> None:
    clock, runs, app, rt = _start(make)
    made_first, made_second = clock() - timedelta(minutes=2), clock() - timedelta(minutes=1)
    async with rt:
        first = await app.enqueue(
            Price(sku="J", cents=1, created_at=made_first), correlation_id="req-1", headers={"tenant": "t1"}
        )
        second = await app.enqueue(Price(sku="J", cents=2, created_at=made_second), correlation_id="req-2")
        rec = await rt.tracker.get(second.message_id)
        await run_until_idle(rt)
    if _sql(rt):
        assert (second.outcome, second.message_id) == ("replaced", first.message_id)
    else:
        assert (second.outcome, second.supersedes) == ("enqueued", first.message_id)
    assert rec.body == {"sku": "J", "cents": 2}
    assert rec.correlation_id == "req-2"
    assert as_utc(rec.created_at) == made_second
    assert rec.headers == {}
    assert runs == [(2, "req-2", made_second)]  # as the handler sees it


async def test_an_outbox_discard_brings_the_sleeping_row_forward_in_the_callers_transaction(sql_db) -> None:
    """The outbox runs the same plan in the caller's transaction: the row is brought forward there, and
    on PostgreSQL a listening worker is told at the caller's commit."""
    from sqlalchemy.orm import Session

    from queueing_core.providers.sql import SqlOutbox

    clock = Clock()
    runs: list[tuple[int, str | None, datetime]] = []
    app = _app(runs)
    rt = Runtime(app, sql_db.provider(clock=clock), clock=clock)
    listening = sql_db.provider(clock=clock) if sql_db.backend == "postgresql" else None
    async with rt:
        later = await app.enqueue(
            Price(sku="K", cents=1), delay=timedelta(days=3), expires_at=clock() + timedelta(days=4)
        )
        sub = app.subscription("Price")
        assert sub is not None
        if listening is not None:
            await listening.open(app)
            assert listening._listener is not None
            await asyncio.wait_for(listening._listener.connected.wait(), 10)
            listening._wakeups[sub.queue].clear()
            listening._next_due.pop(sub.queue, None)
        outbox = SqlOutbox(app, schema=sql_db.schema, clock=clock)
        engine = sql_db.sync_engine()
        with Session(engine) as session, session.begin():
            [again] = outbox.enqueue(session, Price(sku="K", cents=1))
        engine.dispose()
        if listening is not None:
            began = time.monotonic()
            await listening.wait_for_work(sub, 20.0)
            assert time.monotonic() - began < 10.0, "the listening worker was not woken"
        row = await rt.tracker.get(later.message_id)
        assert await run_until_idle(rt) == 1
    assert (again.outcome, again.message_id) == ("discarded", later.message_id)
    assert (row.status, row.not_before) == (MessageStatus.PENDING, None)
    assert [r[0] for r in runs] == [1]


# -- every transport ------------------------------------------------------------------------------------


async def test_on_every_transport_a_standing_cancel_and_a_later_due_time_do_not_hold_back_a_run(harness):
    """The two cases above on every transport of the contract suite (the control stores that keep the
    requests and the identities differ: memory, Azure Tables, the database's tables)."""
    from tests.contract.harness import running, wait_until

    app = harness.app()
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Price) -> None:
        runs.append(msg.cents)

    rt = await harness.runtime(app)
    sql = rt.provider.capabilities.durable_history
    # a standing request, the history still saying the version waits
    cancelled = await app.enqueue(Price(sku="L", cents=1))
    await rt.control.set_cancel(cancelled.message_id, True, rt.clock())
    again = await app.enqueue(Price(sku="L", cents=1))
    # a version due in ten minutes, and the same asked for now
    later = await app.enqueue(Price(sku="M", cents=2), delay=timedelta(minutes=10), ttl=timedelta(hours=1))
    asap = await app.enqueue(Price(sku="M", cents=2))
    assert again.outcome == "enqueued"
    assert again.message_id != cancelled.message_id
    assert asap.outcome == ("discarded" if sql else "enqueued")
    if sql:
        assert asap.message_id == later.message_id
    else:
        assert asap.supersedes == later.message_id
    try:
        async with running(rt):
            await wait_until(lambda: sorted(runs) == [1, 2], what="both runs asked for now")
            await wait_until(
                lambda: _status_is(rt, cancelled.message_id, MessageStatus.CANCELLED), what="cancelled"
            )
    finally:
        await rt.close()
    assert sorted(runs) == [1, 2]


async def _status_is(rt: Runtime, message_id: uuid.UUID, status: str) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == status


async def test_a_run_asked_for_now_lives_as_long_as_the_later_version_it_stands_for(make: Make) -> None:
    """The waiting version runs in 3 days and lives 4; the identical request asked for now lives hours.
    Off SQL the new one is sent and supersedes the waiting one: it must live as long, or a queue not
    worked for those hours (a pause, an outage) had it expire unrun, and the superseded version was
    settled unrun when it came. On SQL the waiting row, brought forward, keeps its own life."""
    clock, runs, app, rt = _start(make)
    async with rt:
        later = await app.enqueue(
            Price(sku="E", cents=5), delay=timedelta(seconds=1), expires_at=clock() + timedelta(days=4)
        )
        asap = await app.enqueue(Price(sku="E", cents=5))  # no delay; the default life (hours)
        clock.now += timedelta(hours=6)  # nobody works the queue for longer than the new one's life
        await asyncio.sleep(1.2)  # (the in-process transport delays by the real clock)
        await run_until_idle(rt, raise_errors=False)
        assert [r[0] for r in runs] == [5]  # one run, for both requests
        final = {(await rt.tracker.get(r.message_id)).status for r in (later, asap)}  # type: ignore[union-attr]
    assert MessageStatus.SUCCEEDED in final
    assert MessageStatus.EXPIRED not in final
