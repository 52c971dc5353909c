"""A message's row id is never given to another message, so a run of a deleted message can never
settle or renew a new one. The fence is (row id, lease token, worker): a new row's first claim could
get the token the deleted row's first claim did (always, when tokens were counted from 0), so a
reused id would let the old run through. SQLite
reuses the highest id once its row is deleted unless the table says AUTOINCREMENT (PostgreSQL's
sequence never repeats); both databases run these, and the migration that rebuilds an older SQLite
table keeps its rows and ids. Found in review: both scenarios failed on SQLite before."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.ops import OpsService
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.maintenance import retain, sweep_leases
from queueing_core.providers.sql.schema import MIGRATIONS, migrate
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from queueing_core.transport import Settlement

from .older_schema import without_autoincrement


@queue("row_ids")
class Job(QueueMessage):
    n: int


@queue("row_ids_kept", keep_processed_for=timedelta(minutes=5))
class Kept(QueueMessage):
    n: int


async def test_a_run_released_and_purged_cannot_settle_the_next_message(sql_db):
    app = QueueingApp("row-ids")
    app.handler(Job)(lambda msg: None)
    prov = sql_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    try:
        sub = app.subscription("Job")
        ops = OpsService(rt)
        a = (await app.enqueue_many([Job(n=1)]))[0]
        [stale] = await prov.receive(sub, 1)  # a run that hangs
        await ops.release_lease(a.message_id)  # the operator takes it back ...
        assert (await ops.purge(MessageQuery(queue="row_ids"))).deleted == 1  # ... and deletes it
        b = (await app.enqueue_many([Job(n=2)]))[0]
        [fresh] = await prov.receive(sub, 1)  # the same worker claims the next message
        assert fresh.envelope.message_id == b.message_id
        assert fresh.handle != stale.handle
        assert await prov.renew([stale]) == [stale]  # its renewal is refused ...
        await prov.settle([Settlement(stale, Complete())])  # ... and so is its outcome
        assert stale.refused
        record = await rt.tracker.get(b.message_id)
        assert record is not None
        assert record.status == "Leased"
        # the live run's failure is still its own to settle: the message is retried, not lost
        await prov.settle([Settlement(fresh, RetryAfter(timedelta(0), "boom"))])
        assert not fresh.refused
        record = await rt.tracker.get(b.message_id)
        assert record is not None
        assert record.status == "Failed"
    finally:
        await rt.close()


async def test_a_lapsed_run_cannot_settle_a_message_enqueued_after_retention(sql_db):
    """No operator: the run's lease lapses, a second run succeeds, retention deletes the row, and a
    new message is claimed by the same worker before the first run returns."""
    now = [datetime.now(UTC)]
    app = QueueingApp("row-ids-kept")
    app.handler(Kept)(lambda msg: None)
    prov = sql_db.provider(clock=lambda: now[0])
    rt = Runtime(app, prov)
    await rt.open()
    try:
        sub = app.subscription("Kept")
        await app.enqueue_many([Kept(n=1)])
        [first] = await prov.receive(sub, 1)
        now[0] += sub.options.lease_duration + timedelta(seconds=1)
        assert (await sweep_leases(prov, app, now[0]))["leases_retried"] == 1
        [second] = await prov.receive(sub, 1)
        await prov.settle([Settlement(second, Complete())])
        now[0] += timedelta(minutes=6)
        assert (await retain(prov, app, now[0]))["deleted_processed"] == 1
        c = (await app.enqueue_many([Kept(n=3)]))[0]
        [third] = await prov.receive(sub, 1)
        assert third.envelope.message_id == c.message_id
        await prov.settle([Settlement(first, Complete())])
        assert first.refused
        record = await rt.tracker.get(c.message_id)
        assert record is not None
        assert record.status == "Leased"
    finally:
        await rt.close()


def _table_sql(sync: sa.Connection, name: str) -> str:
    return str(sync.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{name}'").scalar())


async def test_an_older_sqlite_table_is_rebuilt_with_its_rows_ids_and_indexes(tmp_path):
    version = next(n for n, text, _ in MIGRATIONS if "AUTOINCREMENT" in text)
    app = QueueingApp("row-ids-old")
    app.handler(Job)(lambda msg: None)
    prov = SqlProvider(f"sqlite:///{tmp_path}/old.db", listen=False)
    rt = Runtime(app, prov)
    await rt.open()
    try:
        sent = await app.enqueue_many([Job(n=i) for i in range(5)])
        m, versions = prov.tables.messages, prov.tables.schema_versions

        def make_old(sync: sa.Connection) -> dict[str, str]:
            indexes = without_autoincrement(sync, m.name)  # the table as versions before this one made it
            # what a user may have added on the table: a view, a trigger, an index of their own
            sync.exec_driver_sql(
                f"CREATE VIEW waiting AS SELECT id, status FROM {m.name} WHERE status = 'Pending'"
            )
            sync.exec_driver_sql("CREATE TABLE gone (id INTEGER)")
            # (its ON clause in another case: SQLite keeps the name as written for a trigger)
            sync.exec_driver_sql(
                "CREATE TRIGGER audit AFTER DELETE ON Queueing_Messages "
                "BEGIN INSERT INTO gone VALUES (old.id); END"
            )
            # and what a try of this migration that failed part-way on a caller's engine left behind
            sync.exec_driver_sql(f"CREATE TABLE {m.name}_v12 (id INTEGER)")
            sync.exec_driver_sql(f"CREATE INDEX mine ON {m.name} (type)")
            sync.execute(sa.delete(versions).where(versions.c.version == version))
            return {**indexes, "mine": f"CREATE INDEX mine ON {m.name} (type)"}

        async with prov.engine.begin() as conn:
            indexes = await conn.run_sync(make_old)
            ids = dict((await conn.execute(sa.select(m.c.message_id, m.c.id))).all())
        # the old table reuses the newest id once its row is gone: what the migration ends
        newest = max(ids.values())
        async with prov.engine.begin() as conn:
            await conn.execute(sa.delete(m).where(m.c.id == newest))
        reused = (await app.enqueue_many([Job(n=5)]))[0]
        async with prov.engine.begin() as conn:
            got = (await conn.execute(sa.select(m.c.id).where(m.c.message_id == reused.message_id))).scalar()
        assert got == newest
        ids[reused.message_id] = newest

        assert await migrate(prov.engine, prov.tables, now=prov.clock) == [version]

        async with prov.engine.begin() as conn:
            assert "AUTOINCREMENT" in await conn.run_sync(_table_sql, m.name)
            after = dict((await conn.execute(sa.select(m.c.message_id, m.c.id))).all())
            now_indexes = dict(
                (
                    await conn.exec_driver_sql(
                        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
                        f"AND tbl_name = '{m.name}'"
                    )
                ).all()
            )
            left = (
                await conn.exec_driver_sql(
                    "SELECT count(*) FROM sqlite_master WHERE name LIKE 'queueing_messages_v1%'"
                )
            ).scalar()
            waiting = (await conn.exec_driver_sql("SELECT count(*) FROM waiting")).scalar()
        assert after == {k: v for k, v in ids.items() if v != newest or k == reused.message_id}
        assert {k: v.replace('"', "") for k, v in now_indexes.items()} == indexes  # the same, each
        assert left == 0
        assert waiting == 5  # the user's view reads the new table
        # the newest row deleted again: its id is not given to the next message (and the user's
        # trigger, made again, saw the delete)
        async with prov.engine.begin() as conn:
            await conn.exec_driver_sql("DELETE FROM gone")  # (the delete before the migration)
            await conn.execute(sa.delete(m).where(m.c.id == newest))
            assert (await conn.exec_driver_sql("SELECT id FROM gone")).scalars().all() == [newest]
        later = (await app.enqueue_many([Job(n=6)]))[0]
        async with prov.engine.begin() as conn:
            got = (await conn.execute(sa.select(m.c.id).where(m.c.message_id == later.message_id))).scalar()
        assert got == newest + 1
        # and every message still runs
        claimed = await prov.receive(app.subscription("Job"), 10)
        assert sorted(d.envelope.body["n"] for d in claimed) == [0, 1, 2, 3, 6]
        assert {d.envelope.message_id for d in claimed} >= {s.message_id for s in sent[:4]}
    finally:
        await rt.close()


async def test_a_database_made_at_this_version_is_not_rebuilt(tmp_path):
    prov = SqlProvider(f"sqlite:///{tmp_path}/new.db", listen=False)
    await prov.open(QueueingApp("row-ids-new"))
    try:
        async with prov.engine.begin() as conn:
            before = await conn.run_sync(_table_sql, prov.tables.messages.name)
            assert "AUTOINCREMENT" in before
            version = next(n for n, text, _ in MIGRATIONS if "AUTOINCREMENT" in text)
            await conn.execute(
                sa.delete(prov.tables.schema_versions).where(prov.tables.schema_versions.c.version == version)
            )
        assert await migrate(prov.engine, prov.tables, now=prov.clock) == [version]
        async with prov.engine.begin() as conn:
            assert await conn.run_sync(_table_sql, prov.tables.messages.name) == before
    finally:
        await prov.close()
