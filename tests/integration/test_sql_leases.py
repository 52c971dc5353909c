"""Leases on the SQL provider, on SQLite and PostgreSQL: each claim is fenced by its own token, the
lease is renewed until the settlement is committed, and the sweeper covers every queue in the table."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import sqlalchemy as sa

from queueing_core import DeadLetterReason, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, DeadLetter, Release, RetryAfter
from queueing_core.ops import OpsService
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql import schema as sql_schema
from queueing_core.providers.sql.maintenance import UNREGISTERED_GRACE
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from tests.contract.harness import running, wait_until


@queue("fenced-jobs", lease_duration=timedelta(seconds=30), max_attempts=5)
class Fenced(QueueMessage):
    n: int = 0


async def _one_worker(sql_db) -> tuple[QueueingApp, SqlProvider, Runtime]:
    """An app handling Fenced on one provider: one process, one worker id."""
    app = QueueingApp("fencing")
    app.handler(Fenced)(lambda msg: None)
    prov = sql_db.provider(worker_id="the-only-worker")
    rt = Runtime(app, prov)
    await rt.open()
    return app, prov, rt


async def _one(prov: SqlProvider, app: QueueingApp, type_name: str = "Fenced"):
    [d] = await prov.receive(app.subscription(type_name), 10)
    return d


async def _leased_by_a_dead_worker(
    prov: SqlProvider, message_id, worker: str, ago: timedelta = timedelta(seconds=1)
) -> None:
    """The row as a worker that died holding it leaves it: Leased, its lease run out ``ago``."""
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(
            sa.update(m)
            .where(m.c.message_id == message_id)
            .values(status="Leased", locked_by=worker, locked_until=prov.clock() - ago)
        )


async def _row(prov: SqlProvider, message_id):
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        return (await conn.execute(sa.select(m).where(m.c.message_id == message_id))).one()


async def test_a_released_run_cannot_settle_once_the_same_process_claimed_again(sql_db):
    """An operator releases the lease, the same process (same worker id) claims the row again: the
    first run's settlement, renewal and release are refused; the live run's outcome stands."""
    app, prov, rt = await _one_worker(sql_db)
    r = await app.enqueue(Fenced())
    stale = await _one(prov, app)
    await OpsService(rt).release_lease(r.message_id)
    live = await _one(prov, app)
    assert live.envelope.message_id == stale.envelope.message_id == r.message_id
    live_until = (await _row(prov, r.message_id)).locked_until

    assert await prov.renew([stale]) == [stale]  # the stale run's renewal is refused...
    assert (await _row(prov, r.message_id)).locked_until == live_until  # ...and extends nothing
    await prov.settle([Settlement(stale, Release("host shutting down"))])
    assert (await _row(prov, r.message_id)).status == "Leased"  # the live lease was not given back
    await prov.settle([Settlement(stale, DeadLetter(DeadLetterReason.NON_RETRYABLE, "stale run"))])
    assert (await _row(prov, r.message_id)).status == "Leased"
    assert stale.refused

    assert await prov.renew([live]) == []
    await prov.settle([Settlement(live, Complete({"by": "live"}))])
    assert not live.refused
    rec = await rt.tracker.get(r.message_id)
    assert (rec.status, rec.reason, rec.result) == ("Succeeded", None, {"by": "live"})
    await rt.close()


async def test_a_released_run_cannot_write_over_the_live_runs_progress(sql_db):
    """Progress is fenced like a settlement: once the row is claimed again, the first run's reports
    are refused and the live run's stay, even in the same process (same worker id)."""
    app, prov, rt = await _one_worker(sql_db)
    r = await app.enqueue(Fenced())
    stale = await _one(prov, app)
    await rt.store_progress(stale, {"step": 1, "by": "stale"})
    assert (await _row(prov, r.message_id)).progress["by"] == "stale"  # its own lease: written
    await OpsService(rt).release_lease(r.message_id)
    live = await _one(prov, app)
    await rt.store_progress(live, {"step": 1, "by": "live"})
    await rt.store_progress(stale, {"step": 9, "by": "stale"})
    assert (await _row(prov, r.message_id)).progress["by"] == "live"
    await prov.settle([Settlement(live, Complete())])
    await rt.store_progress(live, {"step": 2, "by": "late"})  # after its settlement: refused too
    assert (await rt.tracker.get(r.message_id)).progress["by"] == "live"
    await rt.close()


async def test_in_a_batch_only_the_stale_settlement_is_refused(sql_db):
    """Settlements of one kind go together; the one whose lease passed on is refused, the rest apply."""
    app, prov, rt = await _one_worker(sql_db)
    receipts = await app.enqueue_many([Fenced(n=i) for i in range(3)])
    first = await prov.receive(app.subscription("Fenced"), 10)
    victim = receipts[1].message_id
    await OpsService(rt).release_lease(victim)
    [live] = await prov.receive(app.subscription("Fenced"), 10)
    failing = RetryAfter(timedelta(minutes=5), "stale or not")
    await prov.settle([Settlement(d, failing) for d in first])
    assert [d.refused for d in first] == [d.envelope.message_id == victim for d in first]
    assert [(await rt.tracker.get(r.message_id)).status for r in receipts] == ["Failed", "Leased", "Failed"]
    await prov.settle([Settlement(live, Complete({"ok": True}))])
    assert (await rt.tracker.get(victim)).status == "Succeeded"
    await rt.close()


async def test_a_swept_run_cannot_settle_once_the_same_process_claimed_again(sql_db):
    """The lease lapses (a long pause), the sweeper counts the attempt, the same process claims the
    row again: the first run's late success is refused and the live run's failure is what counts."""
    app, prov, rt = await _one_worker(sql_db)
    r = await app.enqueue(Fenced())
    stale = await _one(prov, app)
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).values(locked_until=prov.clock() - timedelta(seconds=5)))
    assert (await prov.maintain(app))["leases_retried"] == 1
    live = await _one(prov, app)
    assert live.attempt == 2
    await prov.settle([Settlement(stale, Complete())])  # the fast path (many completions at once)
    await prov.settle([Settlement(live, RetryAfter(timedelta(minutes=5), "live failure"))])
    rec = await rt.tracker.get(r.message_id)
    assert (rec.status, rec.attempt, rec.last_error) == ("Failed", 2, "live failure")
    assert stale.refused
    assert not live.refused
    await rt.close()


async def test_rows_of_an_older_schema_migrate_and_are_fenced(sql_db, monkeypatch):
    """A database at the previous schema version, with a leased and a pending row, is migrated in
    place: both rows keep their data, the leased one is swept, and new claims are fenced."""
    app = QueueingApp("fencing")
    app.handler(Fenced)(lambda msg: None)
    old = sql_db.provider(worker_id="old-worker")
    monkeypatch.setattr(sql_schema, "MIGRATIONS", sql_schema.MIGRATIONS[:3])
    await old.open(app)
    rt_old = Runtime(app, old)
    leased, pending = await app.enqueue_many([Fenced(n=1), Fenced(n=2)])
    await _leased_by_a_dead_worker(old, leased.message_id, "old-worker")
    await rt_old.close()
    monkeypatch.undo()

    prov = sql_db.provider(worker_id="new-worker")
    rt = Runtime(app, prov)
    await rt.open()
    async with prov.engine.connect() as conn:
        versions = list((await conn.execute(sa.select(prov.tables.schema_versions.c.version))).scalars())
    assert max(versions) == sql_schema.LATEST > 3
    assert (await prov.maintain(app))["leases_retried"] == 1
    ds = await prov.receive(app.subscription("Fenced"), 10)
    assert sorted(d.envelope.body["n"] for d in ds) == [1, 2]
    await OpsService(rt).release_lease(pending.message_id)
    [again] = await prov.receive(app.subscription("Fenced"), 10)
    stale = next(d for d in ds if d.envelope.message_id == pending.message_id)
    await prov.settle(
        [Settlement(stale, Complete()), *(Settlement(d, Complete()) for d in ds if d is not stale)]
    )
    assert stale.refused
    assert (await rt.tracker.get(pending.message_id)).status == "Leased"
    assert (await rt.tracker.get(leased.message_id)).status == "Succeeded"
    await prov.settle([Settlement(again, Complete())])
    assert (await rt.tracker.get(pending.message_id)).status == "Succeeded"
    await rt.close()


class SlowSettlement(SqlProvider):
    """The real provider on a busy database: every settlement takes 7.5 s to be committed."""

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        await asyncio.sleep(7.5)
        await super().settle(settlements)


# the renewer looks every lease/3 (2 s) and renews what has less than 2 x that left: a renewal
# comes with 2-4 s of the lease left (a 3 s lease left 1-2 s, and a stalled event loop on a
# loaded machine lost it)
@queue("brief-lease", lease_duration=timedelta(seconds=6), max_attempts=50, max_concurrency=20)
class Brief(QueueMessage):
    n: int


async def test_the_lease_is_renewed_until_the_settlement_is_committed(sql_db):
    """A 6 s lease and a settlement that takes 7.5 s to commit: the sweeper must not take back a
    message whose success is being written, so each of the 20 messages runs exactly once."""
    runs: Counter[int] = Counter()
    app = QueueingApp("renewal")

    @app.handler()
    async def handle(msg: Brief) -> None:
        runs[msg.n] += 1

    prov = SlowSettlement(sql_db.url, schema=sql_db.schema, maintenance_interval=0.2)
    sql_db.providers.append(prov)
    rt = Runtime(app, prov)
    receipts = await app.enqueue_many([Brief(n=i) for i in range(20)])
    ids = [x.message_id for x in receipts]

    async def all_succeeded() -> bool:
        return await rt.tracker.counts() == {("brief-lease", "Succeeded"): 20}

    async with running(rt, settle_linger=0.05):
        await wait_until(all_succeeded, timeout=120, what="20 successes")
        await asyncio.sleep(3.5)  # a sweep of a lapsed lease would show up as a second run by now
    assert sum(runs.values()) == 20, dict(runs)
    assert all(n == 1 for n in runs.values())
    assert {(await rt.tracker.get(i)).attempt for i in ids} == {1}


async def test_the_sweeper_and_expiry_cover_queues_no_longer_registered(sql_db):
    """A type removed from the app while one of its rows was leased (its worker died): the sweeper
    still takes the lease back (once the grace for queues it does not register is over: a host that
    registers it would have gone first), and its overdue waiting rows still expire."""

    @queue("retired", lease_duration=timedelta(seconds=30))
    class Retired(QueueMessage):
        pass

    before = QueueingApp("removal")
    before.handler(Retired)(lambda msg: None)
    prov = sql_db.provider(worker_id="gone")
    rt = Runtime(before, prov)
    await rt.open()
    held, waiting = await before.enqueue_many([Retired(), Retired()])
    await before.enqueue(Retired(), ttl=timedelta(milliseconds=1))
    await _leased_by_a_dead_worker(prov, held.message_id, "gone", UNREGISTERED_GRACE + timedelta(seconds=1))
    after = QueueingApp("removal")
    after.handler(Fenced)(lambda msg: None)  # Retired is no longer registered
    done = await prov.maintain(after)
    assert done["leases_retried"] == 1
    assert done["expired"] == 1
    rec = await rt.tracker.get(held.message_id)
    assert (rec.status, rec.attempt, rec.locked_by) == (MessageStatus.FAILED, 1, None)
    assert (await rt.tracker.get(waiting.message_id)).status == "Pending"
    await rt.close()
