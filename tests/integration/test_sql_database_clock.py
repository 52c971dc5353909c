"""The SQL provider's leases on the database's clock, on SQLite and PostgreSQL.

Hosts claim, renew and sweep on one table; a host whose clock is wrong must neither sweep another
host's live lease (``test_sql_upkeep_hosts.py``: a clock ahead) nor write leases that another host
reads as lapsed (a clock behind, here). The worker renews on the provider's time, and the clock's own
rules (a tolerance, the midpoint of a round trip, a reading once a minute) are held here too."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.decisions import Complete
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.db_clock import READ_EVERY, TOLERANCE, DatabaseClock
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Worker
from tests.contract.harness import wait_until


@queue("db_clock_jobs", lease_duration=timedelta(seconds=30), max_attempts=1)
class OneTry(QueueMessage):
    n: int = 0


@queue("db_clock_short", lease_duration=timedelta(seconds=1.5), max_attempts=1)
class Slow(QueueMessage):
    n: int = 0


async def _row(prov: SqlProvider, message_id):
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        return (await conn.execute(sa.select(m).where(m.c.message_id == message_id))).one()


async def test_a_host_whose_clock_runs_behind_writes_leases_the_others_read_as_live(sql_db):
    """A host a minute behind wrote ``locked_until`` a minute early: its 30 s lease read as lapsed
    half a minute ago on every other host, whose sweep took the live run's only attempt."""
    app = QueueingApp("db-clock")
    app.handler(OneTry)(lambda msg: None)
    slow = DatabaseClock(lambda: utcnow() - timedelta(minutes=1))
    behind = sql_db.provider(worker_id="slow-clock", clock=slow)
    other = sql_db.provider(worker_id="other-host")
    rt = Runtime(app, behind)
    await rt.open()
    await other.open(app)
    sent = await app.enqueue(OneTry())
    [d] = await behind.receive(app.subscription("OneTry"), 10)
    assert d.lease_until is not None
    assert abs((d.lease_until - (utcnow() + timedelta(seconds=30))).total_seconds()) < 5
    await other.maintain(app)
    await behind.settle([Settlement(d, Complete())])
    assert not d.refused
    row = await _row(behind, sent.message_id)
    assert (row.status, row.reason, row.attempt) == ("Succeeded", None, 1)
    await rt.close()


async def test_the_worker_renews_on_the_providers_time(sql_db):
    """The worker compared a lease's end, written on the provider's clock, with its host's: here the
    provider's time is an hour ahead (as a database's is to a host an hour behind), the lease seemed
    an hour long, was never renewed, and the provider's own sweep took the run after 1.5 s."""
    ran: list[int] = []

    app = QueueingApp("db-clock-renew")

    @app.handler(Slow)
    async def slow(msg: Slow) -> None:
        ran.append(msg.n)
        await asyncio.sleep(4)

    prov = sql_db.provider(clock=lambda: utcnow() + timedelta(hours=1))
    rt = Runtime(app, prov)
    await rt.open()
    sent = await app.enqueue(Slow())
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, schedules=False)
    await worker.start()
    try:

        async def settled() -> bool:
            return (await _row(prov, sent.message_id)).status not in ("Pending", "Leased")

        await wait_until(settled, timeout=15, what="the slow run to settle")
    finally:
        await worker.shutdown()
    row = await _row(prov, sent.message_id)
    assert (row.status, row.reason) == ("Succeeded", None), row.description
    assert ran == [0]


async def test_a_failed_reading_keeps_the_last_difference_and_maintenance_goes_on(sql_db, caplog):
    clock = DatabaseClock(lambda: utcnow() + timedelta(seconds=20))
    prov = sql_db.provider(clock=clock)
    app = QueueingApp("db-clock-fail")
    app.handler(OneTry)(lambda msg: None)
    await prov.open(app)
    assert abs(clock.offset.total_seconds() + 20) < 1
    clock._read_at = None  # due again
    prov.statements.database_now = sa.select(sa.text("no_such_column"))
    with caplog.at_level(logging.WARNING, logger="queueing.sql"):
        await prov.maintain(app)
    assert "could not read the database's clock" in caplog.text
    assert abs(clock.offset.total_seconds() + 20) < 1
    assert abs((clock() - utcnow()).total_seconds()) < 1


@queue("review_dbclock_delayed", max_attempts=3)
class Later(QueueMessage):
    n: int = 0


async def test_a_delayed_message_on_a_host_behind_the_database_is_claimed_once(sql_db):
    """Only leases are on the database's time: a message's ``not_before`` is stamped and judged on the
    host's clock, and its claim reads it on that clock too. Were the claim on the database's time, a
    host behind it would claim a delayed message, defer it as not due, and claim it again at once."""
    ran: list[int] = []
    app = QueueingApp("review-dbclock-delayed")

    @app.handler(Later)
    async def later(msg: Later) -> None:
        ran.append(msg.n)

    def behind():  # this host's clock, everywhere it is read
        return utcnow() - timedelta(seconds=30)

    prov = sql_db.provider(clock=DatabaseClock(behind))
    # the claims of the message, counted where they are made (a lease token is no counter of them)
    claims: list[object] = []
    receive = prov.receive

    async def counted(sub, max_messages):
        got = await receive(sub, max_messages)
        claims.extend(d.envelope.message_id for d in got)
        return got

    prov.receive = counted
    rt = Runtime(app, prov, clock=behind)
    await rt.open()
    sent = await app.enqueue(Later(), delay=timedelta(seconds=2))
    worker = Worker(rt, poll_min=0.01, poll_max=0.1, schedules=False)
    await worker.start()
    m = prov.tables.messages
    try:

        async def done() -> bool:
            return bool(ran)

        await wait_until(done, timeout=20, what="the delayed message to run")
        await asyncio.sleep(0.3)
    finally:
        await worker.shutdown()
    async with prov.engine.connect() as conn:
        row = (await conn.execute(sa.select(m).where(m.c.message_id == sent.message_id))).one()
    assert row.status == "Succeeded"
    # one claim to run it (two at most, were it claimed once just before it was due)
    times = claims.count(sent.message_id)
    assert 1 <= times <= 2, f"claimed {times} times in a claim/defer spin"
    await rt.close()


async def test_a_slow_wait_for_a_connection_is_not_read_as_a_clock_difference(sql_db):
    """Only the statement is timed: a wait for the pool's one connection (SQLite) or a busy pool
    would otherwise read as half its length of difference (here the two clocks are one)."""
    clock = DatabaseClock()
    kw = {} if sql_db.backend == "sqlite" else {"pool_size": 1, "max_overflow": 0}
    prov = sql_db.provider(clock=clock, **kw)
    await prov.open(QueueingApp("review-dbclock-measure"))
    assert abs(clock.offset) <= TOLERANCE

    held = asyncio.Event()

    async def busy() -> None:  # another coroutine's transaction (a retention batch, a big send)
        async with prov.engine.connect():
            held.set()
            await asyncio.sleep(4)

    task = asyncio.create_task(busy())
    await held.wait()
    clock._read_at = None  # the minute is up
    await prov.lease_time()
    await task
    assert abs(clock.offset) <= TOLERANCE, f"a false offset of {clock.offset.total_seconds():.2f} s"


def test_by_default_only_leases_are_on_the_databases_clock():
    """The default's other times stayed on the database-corrected clock too (a review found
    ``provider.clock`` was the ``DatabaseClock`` itself when no clock was passed), so the claim read a
    message's ``not_before`` on another clock than the pipeline: the spin above, on every default host."""
    prov = SqlProvider("sqlite:///unused.db")
    assert isinstance(prov.lease_clock, DatabaseClock)
    assert not isinstance(prov.clock, DatabaseClock)
    assert prov.clock is prov.lease_clock.host
    own = DatabaseClock(lambda: utcnow() - timedelta(seconds=30))
    assert SqlProvider("sqlite:///unused.db", clock=own).clock is own.host
    plain = SqlProvider("sqlite:///unused.db", clock=utcnow)  # a plain clock: as it is, for both
    assert plain.clock is plain.lease_clock is utcnow


# -- the clock's rules ----------------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_a_difference_within_the_tolerance_is_left_alone():
    clock = DatabaseClock(lambda: T0)
    clock.correct(T0 + timedelta(milliseconds=900), T0, T0)
    assert clock.offset == timedelta(0)
    assert clock() == T0
    clock.correct(T0 - timedelta(seconds=3), T0, T0)
    assert clock.offset == timedelta(seconds=-3)
    assert clock() == T0 - timedelta(seconds=3)


def test_the_reading_is_set_against_the_round_trips_midpoint():
    clock = DatabaseClock(lambda: T0)
    # the database read 00:00:10 while the host's clock went from 00:00:00 to 00:00:00.8
    clock.correct(T0 + timedelta(seconds=10), T0, T0 + timedelta(seconds=0.8))
    assert clock.offset == timedelta(seconds=9.6)


def test_the_difference_is_read_again_once_a_minute():
    ticks = [100.0]
    clock = DatabaseClock(lambda: T0, monotonic=lambda: ticks[0])
    assert clock.due()
    clock.correct(T0, T0, T0)
    ticks[0] += READ_EVERY - 1
    assert not clock.due()
    ticks[0] += 1
    assert clock.due()


def test_a_correction_holds_until_the_difference_falls_under_half_a_second():
    """No switching on and off at every reading for a difference near a second."""
    clock = DatabaseClock(lambda: T0)
    clock.correct(T0 + timedelta(seconds=1.1), T0, T0)
    assert clock.offset == timedelta(seconds=1.1)
    clock.correct(T0 + timedelta(seconds=0.9), T0, T0)
    assert clock.offset == timedelta(seconds=0.9)
    clock.correct(T0 + timedelta(seconds=0.4), T0, T0)
    assert clock.offset == timedelta(0)
    clock.correct(T0 + timedelta(seconds=0.9), T0, T0)
    assert clock.offset == timedelta(0)


def test_a_reading_over_a_slow_round_trip_is_not_taken():
    clock = DatabaseClock(lambda: T0)
    clock.correct(T0 + timedelta(seconds=5), T0, T0 + timedelta(seconds=4))
    assert clock.offset == timedelta(0)
    assert not clock.due()  # read, if not taken: the next in a minute


def test_a_failed_reading_is_tried_again_a_minute_later():
    ticks = [0.0]
    clock = DatabaseClock(lambda: T0, monotonic=lambda: ticks[0])
    clock.failed()
    assert not clock.due()
    ticks[0] += READ_EVERY
    assert clock.due()


def test_a_new_difference_is_logged_once(caplog):
    clock = DatabaseClock(lambda: T0)
    with caplog.at_level(logging.INFO, logger="queueing.sql"):
        clock.correct(T0 + timedelta(seconds=30), T0, T0)
        clock.correct(T0 + timedelta(seconds=30.2), T0, T0)
        clock.correct(T0, T0, T0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "30.0 s behind the database's" in messages[0]
    assert "agrees with the database's again" in messages[1]
