"""The SQL provider's own promises beyond the contract suite (the outbox too), on SQLite and
PostgreSQL: outbox, idempotent enqueue, leases and their owner, the sweeper, retention, start-up."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.errors import ConfigurationError, ProviderUnavailable
from queueing_core.providers.sql import RetentionPolicy, SqlOutbox, SqlProvider
from queueing_core.providers.sql.maintenance import run_maintenance
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from tests.contract.harness import running, wait_until


@queue("sql-jobs", lease_duration=timedelta(seconds=1), max_attempts=3)
class Job(QueueMessage):
    n: int = 0


# the renewer looks every lease/3 (4 s) and renews what has less than 2 x that left: a renewal comes
# with between 4 and 8 s of the lease left, slack against a stalled event loop or a disk busy with
# another process's syncs on a loaded machine (a 3 s lease left 1 s at worst, and a 6 s one 2 s: each
# lost it once in CI)
@queue("sql-long", lease_duration=timedelta(seconds=12), max_attempts=3)
class LongJob(QueueMessage):
    pass


def app_with(handler=None, **kw) -> QueueingApp:
    app = QueueingApp("sql-tests")
    if handler is None:
        app.message(Job)
    else:
        app.handler(Job, **kw)(handler)
    return app


async def status_of(prov: SqlProvider, message_id) -> MessageStatus | str:
    rec = await prov.tracker().get(message_id)
    assert rec is not None
    return rec.status


async def test_outbox_message_exists_only_if_the_callers_transaction_commits(sql_db):
    prov = sql_db.provider()
    app = app_with()
    await prov.open(app)  # creates the schema
    outbox = SqlOutbox(app, schema=sql_db.schema)
    engine = sql_db.sync_engine()
    committed, rolled_back = Job(n=1), Job(n=2)

    def sync_web_request() -> None:  # what a Flask/Django view does, on its own thread
        with Session(engine) as session, session.begin():
            session.execute(sa.text("SELECT 1"))  # the caller's own business write would go here
            outbox.enqueue(session, committed)
        with (  # noqa: PT012 - the enqueue and the failure are the transaction under test
            pytest.raises(RuntimeError, match="business failure"),
            Session(engine) as session,
            session.begin(),
        ):
            outbox.enqueue(session, rolled_back)
            raise RuntimeError("business failure")

    await asyncio.to_thread(sync_web_request)
    engine.dispose()
    assert await prov.tracker().get(committed.message_id) is not None
    assert await prov.tracker().get(rolled_back.message_id) is None

    # the async flavour on an AsyncConnection
    async with prov.engine.connect() as conn:
        trans = await conn.begin()
        await outbox.enqueue_async(conn, [Job(n=3), Job(n=4)])
        await trans.rollback()
    assert (await prov.tracker().counts()).get(("sql-jobs", "Pending")) == 1


async def test_outbox_commit_wakes_a_waiting_postgres_worker(pg_db):
    seen = asyncio.Event()

    async def handle(msg: Job) -> None:
        seen.set()

    app = app_with(handle)
    rt = Runtime(app, pg_db.provider())
    outbox = SqlOutbox(app, schema=pg_db.schema)
    # idle polls two minutes apart: only the NOTIFY sent at commit can wake the worker within the wait
    async with running(rt, poll_min=120.0, poll_max=120.0):
        # LISTEN up first (a fixed sleep is not enough on a loaded machine: the NOTIFY would be missed)
        await asyncio.wait_for(rt.provider._listener.connected.wait(), 30)
        async with rt.provider.engine.begin() as conn:
            await outbox.enqueue_async(conn, Job(n=1))
        await asyncio.wait_for(seen.wait(), 30)


async def test_enqueue_is_idempotent_per_message_id(sql_db):
    app = app_with()
    rt = Runtime(app, sql_db.provider())
    msg = Job(n=7)
    await app.enqueue(msg)
    await app.enqueue(msg)  # a producer retrying after an unclear failure
    await app.enqueue_many([msg, Job(n=8)])
    counts = await rt.tracker.counts()
    assert counts == {("sql-jobs", "Pending"): 2}
    await rt.close()


async def test_long_handler_keeps_its_lease_by_renewal(sql_db):
    handled: list[int] = []

    async def slow(msg: LongJob, ctx) -> None:
        handled.append(ctx.attempt)
        await asyncio.sleep(20)  # the lease is 12 s: only renewal keeps it

    app = QueueingApp("sql-tests")
    app.handler(LongJob)(slow)
    rt1, rt2 = Runtime(app, sql_db.provider()), Runtime(app, sql_db.provider())
    r = await app.enqueue(LongJob())
    async with running(rt1), running(rt2):
        await wait_until(lambda: _is(rt1, r.message_id, "Succeeded"), timeout=60, what="success")
    assert handled == [1]


async def _is(rt, mid, status) -> bool:
    rec = await rt.tracker.get(mid)
    return rec is not None and rec.status == status


async def test_an_old_owner_never_overwrites_the_new_owners_outcome(sql_db, caplog):
    app = app_with(lambda msg: None)
    a, b = sql_db.provider(worker_id="worker-a"), sql_db.provider(worker_id="worker-b")
    await a.open(app)
    await b.open(app)
    rt = Runtime(app, a)
    r = await app.enqueue(Job())
    sub = app.subscription("Job")
    [da] = await a.receive(sub, 10)
    # a stalls past its lease; the sweeper counts the attempt and b takes the message over
    m = a.tables.messages
    async with a.engine.begin() as conn:
        await conn.execute(sa.update(m).values(locked_until=a.clock() - timedelta(seconds=5)))
    swept = await b.maintain(app)
    assert swept["leases_retried"] == 1
    [db] = await b.receive(sub, 10)
    assert db.attempt == 2
    assert da.attempt == 1
    await b.settle([Settlement(db, Complete())])
    with caplog.at_level(logging.WARNING, logger="queueing.sql"):
        await a.settle([Settlement(da, RetryAfter(timedelta(seconds=1), "late failure"))])
    rec = await rt.tracker.get(r.message_id)
    assert rec.status == "Succeeded"
    assert rec.attempt == 2
    assert rec.last_error.startswith("lease expired: worker worker-a")
    assert "not recorded: their lease had passed to another run" in caplog.text


@pytest.mark.parametrize(
    ("policy", "attempts_before", "expected"),
    [
        ("retry", 0, "Failed"),
        ("retry", 2, "DeadLettered"),
        ("abandon", 0, "Abandoned"),
    ],
)
async def test_sweeper_applies_the_queues_lease_policy(sql_db, policy, attempts_before, expected):
    @queue("sweep-q", lease_duration=timedelta(seconds=1), max_attempts=3, lease_expired=policy)
    class Swept(QueueMessage):
        pass

    app = QueueingApp()
    app.handler(Swept)(lambda msg: None)
    prov = sql_db.provider(worker_id="crashed")
    await prov.open(app)
    r = await Runtime(app, prov).producer.enqueue(Swept())
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).values(attempt=attempts_before))
    await prov.receive(app.subscription("Swept"), 1)
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).values(locked_until=prov.clock() - timedelta(seconds=1)))
    await prov.maintain(app)
    rec = await prov.tracker().get(r.message_id)
    assert rec.status == expected
    assert rec.attempt == attempts_before + 1
    assert rec.locked_by is None
    if expected == "DeadLettered":
        assert rec.reason == "max-attempts-exceeded"


async def test_waiting_rows_stay_unleased_and_expire_when_overdue(sql_db):
    app = app_with()
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    r = await app.enqueue(Job(), ttl=timedelta(seconds=1))
    assert await prov.receive(app.subscription("Job"), 10) == []
    rec = await prov.tracker().get(r.message_id)
    assert rec.status == "WaitingForHandler"
    assert rec.locked_by is None
    assert rec.locked_until is None
    await asyncio.sleep(1.1)
    await prov.maintain(app)
    assert await status_of(prov, r.message_id) == "Expired"


async def test_retention_archives_deletes_and_keeps_processed_for(sql_db):
    @queue("short-lived", keep_processed_for=timedelta(seconds=1))
    class ShortLived(QueueMessage):
        pass

    app = QueueingApp()
    app.handler(Job)(lambda m: None)
    app.handler(ShortLived)(lambda m: None)
    prov = sql_db.provider(
        retention=RetentionPolicy(
            archive_after=timedelta(seconds=1), delete_archived_after=timedelta(seconds=2), batch=2
        )
    )
    rt = Runtime(app, prov)
    jobs = await app.enqueue_many([Job(n=i) for i in range(5)])
    short = await app.enqueue(ShortLived())
    async with running(rt):
        await wait_until(lambda: _is(rt, short.message_id, "Succeeded"), what="processing")
        await wait_until(lambda: _is(rt, jobs[-1].message_id, "Succeeded"), what="processing")
    await asyncio.sleep(1.2)
    done = await prov.maintain(app)
    assert done["deleted_processed"] == 1  # short-lived: gone after keep_processed_for
    assert done["archived"] == 5  # several batches of 2
    rec = await prov.tracker().get(jobs[0].message_id)
    assert rec.archived
    assert rec.status == "Succeeded"
    await asyncio.sleep(2.1)
    assert (await prov.maintain(app))["deleted_archived"] == 5
    assert await prov.tracker().get(jobs[0].message_id) is None


async def test_a_queue_that_keeps_its_successes_a_while_has_them_deleted_on_time_not_archived(sql_db):
    """Kept longer than the archive's age, a success stays where it is until its queue's time is up
    (archived first, it would have outlived it by the archive's age); one archived by hand goes once
    it has been archived that long, which is never before it has been settled that long."""

    @queue("kept-a-while", keep_processed_for=timedelta(hours=3))
    class KeptAWhile(QueueMessage):
        pass

    app = QueueingApp()
    app.handler(Job)(lambda m: None)
    app.handler(KeptAWhile)(lambda m: None)
    prov = sql_db.provider(
        retention=RetentionPolicy(archive_after=timedelta(hours=1), delete_archived_after=None)
    )
    rt = Runtime(app, prov)
    job = await app.enqueue(Job(n=1))
    kept, by_hand = [await app.enqueue(KeptAWhile()) for _ in range(2)]
    async with running(rt):
        for sent in (job, kept, by_hand):
            await wait_until(lambda s=sent: _is(rt, s.message_id, "Succeeded"), what="processing")
    settled = prov.clock()
    record = await prov.tracker().get(by_hand.message_id)
    assert record is not None
    assert await prov.ops_archive(record, settled + timedelta(hours=1))  # an hour after it settled

    done = await run_maintenance(prov, app, settled + timedelta(hours=2))
    assert done["archived"] == 1  # the other queue's success
    assert (await prov.tracker().get(job.message_id)).archived
    assert not (await prov.tracker().get(kept.message_id)).archived
    assert done["deleted_processed"] == 0
    # three hours after settling: the kept success goes; the one archived an hour later stays an hour more
    done = await run_maintenance(prov, app, settled + timedelta(hours=3, minutes=1))
    assert done["deleted_processed"] == 1
    assert await prov.tracker().get(kept.message_id) is None
    assert await prov.tracker().get(by_hand.message_id) is not None
    done = await run_maintenance(prov, app, settled + timedelta(hours=4, minutes=1))
    assert done["deleted_processed"] == 1
    assert await prov.tracker().get(by_hand.message_id) is None
    assert await prov.tracker().get(job.message_id) is not None  # archived, not the kept queue's


async def test_unreachable_database_retries_then_fails_with_one_clear_error(caplog):
    prov = SqlProvider("postgresql://nobody@127.0.0.1:1/none", connect_retries=2)
    with (
        caplog.at_level(logging.WARNING, logger="queueing.sql"),
        pytest.raises(ProviderUnavailable, match=r"unreachable after 3 tries") as info,
    ):
        await prov.open(QueueingApp())
    assert "127.0.0.1:1" in str(info.value)
    assert "Traceback" not in str(info.value)
    assert [r.getMessage() for r in caplog.records].count  # two warnings, one per retry
    assert sum("retry" in r.getMessage() for r in caplog.records) == 2
    await prov.close()


async def test_without_auto_migrate_an_old_schema_is_refused(sql_db):
    prov = sql_db.provider(auto_migrate=False)
    with pytest.raises(ConfigurationError, match="queueing migrate"):
        await prov.open(QueueingApp())
    migrated = sql_db.provider()
    await migrated.open(QueueingApp())
    again = sql_db.provider(auto_migrate=False)
    await again.open(QueueingApp())  # now fine


async def test_claim_query_stays_on_its_index(pg_db):
    prov = pg_db.provider()
    app = app_with()
    await prov.open(app)
    m = prov.tables.messages
    # a long-running system: mostly successes, a good share of dead letters and failures kept for
    # inspection, and a few rows to claim
    async with prov.engine.begin() as conn:
        await conn.execute(
            sa.text(f"""
            INSERT INTO {m.fullname} (message_id, tracking_id, queue, type, status, attempt, created_at,
                updated_at, available_at, headers, body, archived)
            SELECT gen_random_uuid(), gen_random_uuid(), 'q' || (i % 5), 'Job',
                   CASE WHEN i % 1000 = 0 THEN 'Pending' WHEN i % 3 = 0 THEN 'DeadLettered'
                        WHEN i % 7 = 0 THEN 'Abandoned' ELSE 'Succeeded' END,
                   1, now(), now(), now(), '{{}}'::jsonb, '{{}}'::jsonb, false
            FROM generate_series(1, 60000) AS i""")
        )
        await conn.execute(sa.text(f"ANALYZE {m.fullname}"))
    now = prov.clock()
    sql, params = prov.claim_sql("q0", 100, now, now + timedelta(seconds=30))
    async with prov.engine.connect() as conn:  # values bound by the driver, as when workers claim
        plan = "\n".join(r[0] for r in await conn.exec_driver_sql(f"EXPLAIN {sql}", params))
    assert "ix_queueing_messages_claim" in plan, plan
    assert "Seq Scan on queueing_messages" not in plan, plan
