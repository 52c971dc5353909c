"""A lease renewal changes no indexed column (schema migration 13): on PostgreSQL it is a HOT update, so
a handler that runs for minutes renews without adding index entries every 10 seconds; on SQLite the
renewal's program writes no index. Held against the databases' own accounts: PostgreSQL's table
statistics (``n_tup_hot_upd``) and the program SQLite compiles for the renewal (``EXPLAIN``)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from datetime import UTC, datetime

import psycopg
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.statements import leases_of
from queueing_core.runtime import Runtime

from ..services import POSTGRES_URL


@queue("renewing")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("renewals")
    a.handler(Job)(lambda msg: None)
    return a


def updates(schema: str, before: tuple[int, int] | None = None, at_least: int = 1) -> tuple[int, int]:
    """(rows updated, of which HOT) on the schema's messages table, as the server counts them; with
    ``before``, waits (up to 10 s) until the counts have moved ``at_least`` past it: a backend reports
    its counts when it ends or goes idle, a moment after its statements, and each backend on its own
    (a first report alone ended the wait, and the test failed by the reports still on their way)."""
    deadline = time.monotonic() + 10
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE schemaname = %s AND relname = 'queueing_messages'",
                (schema,),
            ).fetchone()
            assert row is not None
            got = (int(row[0]), int(row[1]))
            if before is None or got[0] >= before[0] + at_least or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


#: messages, renewals of each, and progress reports: every row version they make fits on the table's
#: first page (about 180 bytes a version, 8 KiB a page) without pruning, which needs every snapshot
#: on the server to have moved past the dead versions: on a server that other tests share, one of
#: their transactions held it back and a renewal that found the page full went to another page, not
#: HOT, which says nothing of the renewal's columns
MESSAGES, RENEWALS, REPORTS = 6, 3, 3


async def test_renewals_and_progress_reports_are_hot_updates(pg_db):
    a = app()
    # one worker in two providers: the second renews the first's leases after its backends ended
    prov = pg_db.provider(listen=False, worker_id="w-renewals")
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(MESSAGES)])
    got = await prov.receive(a.subscription("Job"), MESSAGES)
    assert len(got) == MESSAGES
    await rt.close()  # (its backends end: their counts are reported)
    claimed = updates(pg_db.schema, (0, 0), at_least=MESSAGES)
    assert claimed[0] == MESSAGES, claimed  # the claim's updates: not HOT, as the docs say

    prov = pg_db.provider(listen=False, worker_id="w-renewals")
    await prov.open(a)
    for _ in range(RENEWALS):
        assert await prov.renew(got) == []
    for d in got[:REPORTS]:
        await prov.store_progress(d, {"step": 1, "total": 2, "text": None, "at": None})
    await prov.close()
    made = RENEWALS * MESSAGES + REPORTS
    total, hot = updates(pg_db.schema, claimed, at_least=made)
    assert total - claimed[0] == made, (claimed, total)
    # every renewal and every report is HOT (the page's room kept by the fill factor); before
    # migration 13 the sweeper's index held locked_until and no renewal was
    assert hot - claimed[1] == made, (claimed, total, hot)


async def test_the_sqlite_renewal_writes_no_index(tmp_path):
    path = tmp_path / "q.db"
    a = app()
    prov = SqlProvider(f"sqlite:///{path}", listen=False)
    await prov.open(a)
    try:
        assert prov._hot is not None
        renew = prov._hot.renew
        values = renew.params(
            leases_of("sqlite", [1, 2], [1, 1]) | {"b_until": datetime(2030, 1, 1, tzinfo=UTC)}
        )
    finally:
        await prov.close()
    with sqlite3.connect(path) as conn:
        roots = dict(
            conn.execute("SELECT rootpage, name FROM sqlite_master WHERE tbl_name = 'queueing_messages'")
        )

        def written(sql: str, values: object = ()) -> set[str]:
            """The b-trees (the table, its indexes) the statement's program opens for writing."""
            program = conn.execute(f"EXPLAIN {sql}", values).fetchall()
            return {roots[p2] for _, op, _, p2, *_ in program if op == "OpenWrite"}

        assert written(renew.sql, values) == {"queueing_messages"}
        # (the same check sees the indexes that a change of locked_until and status rewrites: not blind)
        claim = "UPDATE queueing_messages SET status = 'Leased', locked_until = '2030-01-01' WHERE id = 1"
        assert "ix_queueing_messages_leased" in written(claim), written(claim)


async def test_migration_13_keys_the_sweepers_index_by_queue(sql_db):
    prov = sql_db.provider(listen=False)
    await prov.open(app())
    name = "ix_queueing_messages_leased"
    prefix = f"{sql_db.schema}." if sql_db.schema else ""
    versions = prov.tables.schema_versions
    async with prov.engine.begin() as conn:
        # as version 12 left it: keyed by the lease's end
        await conn.exec_driver_sql(f"DROP INDEX {prefix}{name}")
        await conn.exec_driver_sql(
            f"CREATE INDEX {name} ON {prefix}queueing_messages (locked_until) WHERE status = 'Leased'"
        )
        await conn.execute(sa.delete(versions).where(versions.c.version == 13))
    await prov.close()
    prov = sql_db.provider(listen=False)
    await prov.open(app())
    async with prov.engine.connect() as conn:
        if sql_db.backend == "sqlite":
            query, values = "SELECT sql FROM sqlite_master WHERE name = ?", (name,)
        else:
            query = "SELECT indexdef FROM pg_indexes WHERE schemaname = %(s)s AND indexname = %(n)s"
            values = {"s": sql_db.schema, "n": name}  # type: ignore[assignment]
        ddl = (await conn.exec_driver_sql(query, values)).scalar_one()
    assert "(queue)" in ddl.replace('"', ""), ddl
    assert "locked_until" not in ddl, ddl


async def test_migration_13_lets_reads_go_on_while_it_waits_for_the_table(pg_db):
    """The new index is built before the old one is dropped: while the build waits for a writer's
    transaction, a claim's read of the table goes on. Dropping first (found in review) asked for the
    table's exclusive lock at once, and every read queued behind it until the migration committed."""
    prov = pg_db.provider(listen=False)
    rt = Runtime(app(), prov)
    await rt.open()
    await rt.app.enqueue(Job(n=1))
    await rt.close()
    table = f'"{pg_db.schema}".queueing_messages'
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'DROP INDEX "{pg_db.schema}".ix_queueing_messages_leased')
        conn.execute(
            f"CREATE INDEX ix_queueing_messages_leased ON {table} (locked_until) WHERE status = 'Leased'"
        )
        conn.execute(f'DELETE FROM "{pg_db.schema}".queueing_schema WHERE version = 13')
    with psycopg.connect(POSTGRES_URL) as writer, psycopg.connect(POSTGRES_URL, autocommit=True) as reader:
        writer.execute(f"UPDATE {table} SET updated_at = updated_at")  # (its transaction stays open)
        upgraded = pg_db.provider(listen=False)
        migrating = asyncio.create_task(upgraded.open(app()))
        try:
            deadline = time.monotonic() + 5
            while not reader.execute(
                "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = %s::regclass", (table,)
            ).fetchone()[0]:  # type: ignore[index]
                assert time.monotonic() < deadline, "the migration never waited for the table"
                await asyncio.sleep(0.05)
            reader.execute("SET lock_timeout = '1s'")
            # a read while the migration waits: it would time out behind a waiting exclusive lock
            assert reader.execute(f"SELECT count(*) FROM {table}").fetchone() == (1,)
        finally:
            writer.commit()
            await migrating
    with psycopg.connect(POSTGRES_URL) as conn:
        ddl = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
            (pg_db.schema, "ix_queueing_messages_leased"),
        ).fetchone()
    assert ddl is not None
    assert "(queue)" in ddl[0], ddl
    # the index built on the way is not left in the tables' metadata (a later create_all would make it)
    assert sorted(i.name for i in upgraded.tables.messages.indexes if "leased" in str(i.name)) == [
        "ix_queueing_messages_leased"
    ]
