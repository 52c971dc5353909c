"""The SQL provider's upkeep against live work and other hosts, on SQLite and PostgreSQL: the lease
sweeper against renewals and other sweepers, a sweep that fails part-way, hosts that do not register a
queue (they leave its lapsed leases to the hosts that do, and never end its retries on their own
defaults), and hosts whose clocks disagree."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import sqlalchemy as sa

from queueing_core import DeadLetterReason, QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.decisions import Complete
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.db_clock import DatabaseClock
from queueing_core.providers.sql.maintenance import UNREGISTERED_GRACE, sweep_leases
from queueing_core.providers.sql.statements import bind, leases_of
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from tests.contract.harness import wait_until


@queue("review_upkeep", lease_duration=timedelta(seconds=30), max_attempts=10)
class Job(QueueMessage):
    n: int = 0


@queue("review_upkeep_other", lease_duration=timedelta(seconds=30))
class Other(QueueMessage):
    n: int = 0


@queue("review_upkeep_last", lease_duration=timedelta(seconds=30), max_attempts=1)
class LastTry(QueueMessage):
    n: int = 0


@queue("review_upkeep_abandon", lease_duration=timedelta(seconds=30), lease_expired="abandon")
class Careful(QueueMessage):
    n: int = 0


def _app(*types: type[QueueMessage]) -> QueueingApp:
    app = QueueingApp("review-upkeep")
    for t in types:
        app.handler(t)(lambda msg: None)
    return app


async def _claimed(prov: SqlProvider, app: QueueingApp, type_name: str) -> Delivery:
    [d] = await prov.receive(app.subscription(type_name), 10)
    return d


async def _set(prov: SqlProvider, message_id, **values) -> None:
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).where(m.c.message_id == message_id).values(**values))


async def _row(prov: SqlProvider, message_id):
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        return (await conn.execute(sa.select(m).where(m.c.message_id == message_id))).one()


async def _lock_waiters(prov: SqlProvider, table: str) -> int:
    async with prov.engine.connect() as conn:
        waiting = await conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"),
            {"q": f"%{table}%"},
        )
        return int(waiting.scalar() or 0)


# -- the sweeper against live work (PostgreSQL: two real connections) ---------------------------------


async def test_a_renewal_committed_while_the_sweeper_waited_keeps_its_lease(pg_db):
    """The worker's renewal holds the row when the sweeper (another host) reaches it: once the renewal
    commits, the sweeper's own WHERE, checked again on the row's new version, no longer matches. The
    lease stays with the live run, no attempt is counted, and the live run settles."""
    app = _app(Job)
    worker = pg_db.provider(worker_id="live-worker")
    sweeper = pg_db.provider(worker_id="other-host")
    rt = Runtime(app, worker)
    await rt.open()
    await sweeper.open(app)
    sent = await app.enqueue(Job())
    d = await _claimed(worker, app, "Job")
    await _set(worker, sent.message_id, locked_until=utcnow() - timedelta(seconds=1))  # a slow renewal
    async with worker.engine.connect() as conn:
        await conn.begin()
        params = {
            **leases_of(worker.backend, [d.handle.row], [d.handle.token]),
            **bind(until=utcnow() + timedelta(seconds=30)),
        }
        assert len((await conn.execute(worker.statements.renew, params)).all()) == 1
        sweep = asyncio.create_task(sweep_leases(sweeper, app, utcnow()))
        await wait_until(
            lambda: _lock_waiters(sweeper, f"{pg_db.schema}.queueing_messages"),
            what="the sweeper waiting for the renewed row",
        )
        await conn.commit()
    assert (await asyncio.wait_for(sweep, 10))["leases_retried"] == 0
    row = await _row(worker, sent.message_id)
    assert (row.status, row.attempt, row.locked_by) == ("Leased", 0, "live-worker")
    await worker.settle([Settlement(d, Complete())])
    assert not d.refused
    assert (await _row(worker, sent.message_id)).status == "Succeeded"
    await rt.close()


async def test_two_hosts_sweeping_at_once_count_a_lapsed_lease_once(pg_db):
    """Two sweepers wait for the same lapsed row: the first counts the attempt, the second finds the
    row no longer Leased and leaves it (no second count, no dead letter from a doubled count)."""
    app = _app(LastTry, Job)
    hosts = [pg_db.provider(worker_id=f"host-{i}") for i in range(2)]
    rt = Runtime(app, hosts[0])
    await rt.open()
    await hosts[1].open(app)
    sent = await app.enqueue(Job())
    await _set(
        hosts[0],
        sent.message_id,
        status="Leased",
        locked_by="died",
        locked_until=utcnow() - timedelta(seconds=1),
        attempt=8,  # one more count is the 9th of 10 attempts; two would dead-letter it
    )
    m = hosts[0].tables.messages
    async with hosts[0].engine.connect() as holder:
        await holder.begin()
        await holder.execute(sa.select(m.c.id).where(m.c.message_id == sent.message_id).with_for_update())
        now = utcnow()
        sweeps = [asyncio.create_task(sweep_leases(h, app, now)) for h in hosts]

        async def both_wait() -> bool:
            return await _lock_waiters(hosts[0], f"{pg_db.schema}.queueing_messages") >= 2

        await wait_until(both_wait, what="both sweepers waiting for the row")
        await holder.rollback()
    done = await asyncio.wait_for(asyncio.gather(*sweeps), 10)
    assert sum(d["leases_retried"] for d in done) == 1
    row = await _row(hosts[0], sent.message_id)
    assert (row.status, row.attempt) == ("Failed", 9)
    await rt.close()


# -- a sweep that fails part-way --------------------------------------------------------------------


async def test_a_sweep_that_fails_part_way_changes_nothing_and_the_next_counts_once(sql_db, monkeypatch):
    """Every queue's sweep is one transaction: a failure after some queues' rows were swept (here, at
    the wake-ups, after the last UPDATE) rolls all of them back, and the next pass counts each once."""
    app = _app(Job, Other)
    prov = sql_db.provider(worker_id="host")
    rt = Runtime(app, prov)
    await rt.open()
    sent = await app.enqueue_many([Job(), Other()])
    for r in sent:
        await _set(
            prov,
            r.message_id,
            status="Leased",
            locked_by="died",
            locked_until=utcnow() - timedelta(seconds=1),
        )

    async def broken(conn, queues) -> None:
        raise ConnectionError("the database went away mid-sweep")

    monkeypatch.setattr(prov, "notify_statements", broken)
    with pytest.raises(ConnectionError):
        await sweep_leases(prov, app, utcnow())
    for r in sent:
        row = await _row(prov, r.message_id)
        assert (row.status, row.attempt) == ("Leased", 0)
    monkeypatch.undo()
    assert (await sweep_leases(prov, app, utcnow()))["leases_retried"] == 2
    assert [(await _row(prov, r.message_id)).attempt for r in sent] == [1, 1]
    await rt.close()


# -- hosts that do not register the queue ---------------------------------------------------------------


def _lapsed(ago: timedelta) -> dict:
    """A row as a worker that died holding it leaves it, its lease lapsed ``ago``."""
    return {"status": "Leased", "locked_by": "died", "locked_until": utcnow() - ago}


async def test_a_host_that_does_not_register_a_queue_never_dead_letters_it_on_its_defaults(sql_db):
    """Mid-rollout (or another app on the same table), a host that does not register a queue sweeps
    its lapsed leases with options that are not the queue's: counting the attempt and retrying is
    safe, but dead-lettering at the defaults' max_attempts (5) a message whose queue allows 10 ends
    its retries early. It waits the grace first (the queue's own hosts sweep by its options), then
    only counts and retries; a host that registers it dead-letters by the queue's own max."""
    new = _app(Job)
    old = _app(Other)  # the same table, an app that does not know Job
    prov = sql_db.provider(worker_id="host")
    rt = Runtime(new, prov)
    await rt.open()
    sent = await new.enqueue(Job())
    await _set(prov, sent.message_id, attempt=4, **_lapsed(timedelta(seconds=1)))  # its 5th lapsed
    assert (await sweep_leases(prov, old, utcnow()))["leases_retried"] == 0, "swept within the grace"
    await _set(prov, sent.message_id, **_lapsed(UNREGISTERED_GRACE + timedelta(seconds=1)))
    assert (await sweep_leases(prov, old, utcnow()))["leases_retried"] == 1
    row = await _row(prov, sent.message_id)
    assert (row.status, row.attempt, row.reason) == ("Failed", 5, None), "dead-lettered with attempts left"
    # the queue's own host still dead-letters at the queue's own max
    await _set(prov, sent.message_id, attempt=9, **_lapsed(timedelta(seconds=1)))
    await sweep_leases(prov, new, utcnow())
    row = await _row(prov, sent.message_id)
    assert (row.status, row.attempt, row.reason) == ("DeadLettered", 10, DeadLetterReason.MAX_ATTEMPTS.value)
    await rt.close()


async def test_attempts_used_up_under_a_host_that_does_not_register_the_queue_end_unrun(sql_db):
    """A message that kills every worker that runs it, while only a host that does not register its
    queue sweeps (the queue's own workers are the ones dying): that host never dead-letters it, so the
    next worker that claims it must, without running it, or it would crash-loop for ever."""
    new = QueueingApp("review-upkeep")
    runs: list[int] = []
    new.handler(Job)(lambda msg: runs.append(msg.n))
    old = _app(Other)
    prov = sql_db.provider(worker_id="host")
    rt = Runtime(new, prov)
    await rt.open()
    sent = await new.enqueue(Job(n=7))
    await _set(prov, sent.message_id, attempt=9, **_lapsed(UNREGISTERED_GRACE + timedelta(seconds=1)))
    await sweep_leases(prov, old, utcnow())  # the 10th of 10 lapsed: counted, Failed
    assert (await _row(prov, sent.message_id)).attempt == 10
    d = await _claimed(prov, new, "Job")
    settlement = await rt.process(d)
    await prov.settle([settlement])
    assert runs == [], "ran after its attempts were used up"
    row = await _row(prov, sent.message_id)
    assert (row.status, row.reason) == ("DeadLettered", DeadLetterReason.MAX_ATTEMPTS.value)
    assert "without a settlement" in row.description
    await rt.close()


async def test_a_host_that_does_not_register_an_abandon_queue_leaves_it_to_a_host_that_does(sql_db):
    """A queue that says lease_expired="abandon" wants a person to look before its message runs again.
    A host that does not register it (mid-rollout) leaves its lapsed lease to a host that does."""
    new = _app(Careful)
    old = _app(Other)
    prov = sql_db.provider(worker_id="host")
    rt = Runtime(new, prov)
    await rt.open()
    sent = await new.enqueue(Careful())
    await _set(prov, sent.message_id, **_lapsed(timedelta(seconds=1)))
    await sweep_leases(prov, old, utcnow())  # the old host happens to sweep first
    await sweep_leases(prov, new, utcnow())
    assert (await _row(prov, sent.message_id)).status == "Abandoned"
    await rt.close()


# -- clocks --------------------------------------------------------------------------------------------


async def test_a_host_whose_clock_runs_ahead_leaves_a_live_lease_alone(sql_db):
    """The worker renews when less than 2/3 of a lease is left, every third of one: a 30 s lease may
    have 12 s left between renewals. Another host's clock, 15 s ahead, swept it on its own time: the
    live run's only attempt was counted as lapsed, the message dead-lettered, and the run's success
    refused. The provider's default clock (``DatabaseClock``) corrects the host's by the database's."""
    app = _app(LastTry)
    worker = sql_db.provider(worker_id="live-worker")
    fast = DatabaseClock(lambda: utcnow() + timedelta(seconds=15))
    ahead = sql_db.provider(worker_id="fast-clock", clock=fast)
    rt = Runtime(app, worker)
    await rt.open()
    await ahead.open(app)
    sent = await app.enqueue(LastTry())
    d = await _claimed(worker, app, "LastTry")
    await _set(worker, sent.message_id, locked_until=utcnow() + timedelta(seconds=12))
    await ahead.maintain(app)
    await worker.settle([Settlement(d, Complete())])
    row = await _row(worker, sent.message_id)
    assert (row.status, row.reason) == ("Succeeded", None)
    await rt.close()
