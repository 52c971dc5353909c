"""SQLite keeps no index on the messages that its planner never reads: each one is rewritten by every
claim and settlement that changes a column it names. The listings by status (which SQLite serves from
``ix_queueing_messages_created``) and the claim path still read an index on a large table."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.schema import MIGRATIONS, migrate
from queueing_core.providers.sql.sqlite_driver import SqliteCompiled, named_dialect
from queueing_core.providers.sql.statements import claim_params
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery

from .history_rows import fill

BY_STATUS = ("ix_queueing_messages_status", "ix_queueing_messages_queue_status")
#: what the versions before the migration that drops them created on SQLite, as on PostgreSQL
OLD_DDL = (
    "CREATE INDEX ix_queueing_messages_status ON queueing_messages (status, created_at, id) "
    "WHERE status <> 'Succeeded'",
    "CREATE INDEX ix_queueing_messages_queue_status ON queueing_messages (queue, status, created_at, id) "
    "WHERE status <> 'Succeeded'",
)


@queue("idx")
class Job(QueueMessage):
    n: int


async def indexes(prov: Any) -> set[str]:
    m = prov.tables.messages

    def read(sync: sa.Connection) -> set[str]:
        return {i["name"] for i in sa.inspect(sync).get_indexes(m.name, schema=m.schema)}

    async with prov.engine.connect() as conn:
        return await conn.run_sync(read)


async def test_the_listing_indexes_by_status_exist_on_postgresql_only(sql_db):
    prov = sql_db.provider()
    await prov.open(QueueingApp("idx"))
    have = await indexes(prov)
    kept = ("ix_queueing_messages_claim", "ix_queueing_messages_leased", "ix_queueing_messages_created")
    assert set(kept) <= have
    if sql_db.backend == "sqlite":
        assert not have & set(BY_STATUS)
    else:
        assert set(BY_STATUS) <= have


async def test_a_sqlite_database_of_the_previous_version_loses_them_and_keeps_its_rows(tmp_path):
    version = next(n for n, text, _ in MIGRATIONS if text.startswith("SQLite: no listing indexes"))
    app = QueueingApp("idx")
    app.handler(Job)(lambda msg: None)
    prov = SqlProvider(f"sqlite:///{tmp_path}/old.db", listen=False)
    rt = Runtime(app, prov)
    await rt.open()
    await app.enqueue_many([Job(n=i) for i in range(3)])
    t = prov.tables
    async with prov.engine.begin() as conn:  # back to what the version before it left
        for ddl in OLD_DDL:
            await conn.exec_driver_sql(ddl)
        await conn.execute(sa.delete(t.schema_versions).where(t.schema_versions.c.version == version))
    assert set(BY_STATUS) <= await indexes(prov)
    assert await migrate(prov.engine, t, now=prov.clock) == [version]
    assert not await indexes(prov) & set(BY_STATUS)
    claimed = await prov.receive(app.subscription("Job"), 10)
    assert sorted(d.envelope.body["n"] for d in claimed) == [0, 1, 2]
    await rt.close()


async def test_listings_by_status_and_the_claim_read_an_index_on_100k_rows(tmp_path):
    prov = SqlProvider(f"sqlite:///{tmp_path}/big.db", listen=False)
    await prov.open(QueueingApp("idx"))
    await fill(prov, ("idx0", "idx1"))
    m = prov.tables.messages
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("SELECT") and m.name in statement:
            seen.append((statement, parameters))

    sa.event.listen(prov.engine.sync_engine, "before_cursor_execute", record)
    tracker = prov.tracker()
    for query in (
        MessageQuery(status=("DeadLettered",)),
        MessageQuery(queue="idx0", status=("DeadLettered", "Pending")),
        MessageQuery(status=("Leased",)),
        MessageQuery(queue="idx1"),
        MessageQuery(),
    ):
        page = await tracker.query(query, limit=50)
        assert len(page.items) == 50, query
    sa.event.remove(prov.engine.sync_engine, "before_cursor_execute", record)
    assert len(seen) == 5
    now = prov.clock()
    # the claim as the SQLite hot path runs it (named parameters, values processed as it binds them)
    hot = SqliteCompiled(prov.statements.claim, named_dialect(prov.engine))
    claim, params = hot.sql, hot.params(claim_params("idx0", 10, now, now))
    async with prov.engine.connect() as conn:
        plans = []
        for statement, values in [*seen, (claim, params)]:
            rows = (await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", values)).all()
            plans.append([str(r[3]) for r in rows])
        await conn.rollback()
    for plan in plans:
        # every read of the messages table goes through an index, never a scan of the whole table
        on_messages = [p for p in plan if f" {m.name}" in p]
        assert on_messages, plan
        assert all("USING" in p for p in on_messages), plan  # (an index, or the primary key)
    assert any("ix_queueing_messages_claim" in p for p in plans[-1]), plans[-1]
    await prov.close()
