"""Schema migrations 15 and 16: a claim writes no entry in the listing indexes by status nor in the
listing index by time (they leave out Leased, PostgreSQL), and neither a claim nor a success writes one
in the tracking index (it holds only the rows whose tracking id is not their own message id, the
default since 15). The lookups and listings those indexes served still read an index under a long
history, and a database made before is upgraded, each migration on its own."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import create_engine
from queueing_core.providers.sql import schema as sql_schema
from queueing_core.providers.sql.schema import LISTING_INDEXES
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

from ..services import POSTGRES_URL
from .history_rows import fill
from .test_sql_history_plan import nodes
from .test_sql_upkeep_plans import sqlite_reads


@queue("entries")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("entries")
    a.message(Job)
    return a


def _recorder(prov: Any, seen: list[tuple[str, Any]]) -> Any:
    m = prov.tables.messages

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if m.name in statement and statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, parameters))

    return record


async def _plans(prov: Any, seen: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each recorded statement with its plan: SQLite's lines, or PostgreSQL's nodes."""
    out = []
    async with prov.engine.connect() as conn:
        for statement, values in seen:
            said = " ".join(statement.split())
            if prov.backend == "sqlite":
                rows = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", values)
                out.append((said, [str(r[3]) for r in rows]))
            else:
                raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", values)).scalar_one()
                plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
                # (every node: the index scans under a BitmapOr name no relation)
                out.append((said, nodes(plan)))
    return out


async def test_a_lookup_by_tracking_id_reads_two_indexes_and_finds_every_kind_of_row(sql_db):
    """100,000 rows sent before migration 15 (each tracking id its own), then messages of the kit's
    (tracking id = message id) and one sent again under another's tracking id: a lookup by tracking id
    finds the right rows of both kinds, through the unique message id and the tracking index."""
    prov = sql_db.provider(listen=False)
    rt = Runtime(app(), prov)
    await rt.open()
    try:
        await fill(prov, ("entries",))
        first = await rt.app.enqueue(Job(n=1))
        other = await rt.app.enqueue(Job(n=2))
        again = await rt.app.enqueue(Job(n=3), tracking_id=first.tracking_id)
        m = prov.tables.messages
        async with prov.engine.connect() as conn:
            old = (await conn.execute(sa.select(m.c.message_id, m.c.tracking_id).limit(1))).one()
        assert old.tracking_id != old.message_id  # (a row as sent before: in the tracking index)
        if prov.backend == "postgresql":
            async with prov.engine.connect() as conn:
                await conn.execution_options(isolation_level="AUTOCOMMIT")
                await conn.execute(sa.text(f"ANALYZE {m.fullname}"))
        seen: list[tuple[str, Any]] = []
        record = _recorder(prov, seen)
        sa.event.listen(prov.engine.sync_engine, "before_cursor_execute", record)
        try:
            found = {
                name: {r.message_id for r in (await rt.tracker.query(MessageQuery(tracking_id=t))).items}
                for name, t in (
                    ("first", first.tracking_id),
                    ("other", other.tracking_id),
                    ("old", old.tracking_id),
                )
            }
            named = (await rt.app.status(first.tracking_id)).message_id
        finally:
            sa.event.remove(prov.engine.sync_engine, "before_cursor_execute", record)
        assert found == {
            "first": {first.message_id, again.message_id},
            "other": {other.message_id},
            "old": {old.message_id},
        }
        assert named == again.message_id  # the newest of the tracking id's messages
        plans = await _plans(prov, seen)
        assert len([said for said, _ in plans if "tracking_id" in said.partition(" WHERE ")[2]]) >= 4
        for said, plan in plans:
            if prov.backend == "sqlite":
                assert not sqlite_reads(plan, m.name), (said, plan)
                continue
            assert any(n.get("Relation Name") == m.name for n in plan), (said, plan)
            assert not [n for n in plan if n["Node Type"] == "Seq Scan"], (said, plan)
            if "tracking_id" in said.partition(" WHERE ")[2]:  # (a lookup by tracking id, not by message id)
                names = {n.get("Index Name") for n in plan}
                assert {"queueing_messages_message_id_key", "ix_queueing_messages_tracking"} <= names, (
                    said,
                    plan,
                )
    finally:
        await rt.close()


async def test_listings_by_status_read_an_index_without_leased_rows_in_the_listing_indexes(pg_db):
    """PostgreSQL: the rows running now are listed through the lease sweeper's index, the others by
    status through the listing index, and both together through both, under 100,000 rows of history
    (about 100 of them leased and 100 waiting)."""
    prov = pg_db.provider(listen=False)
    rt = Runtime(app(), prov)
    await rt.open()
    try:
        await fill(prov, ("entries",))
        leased, pending = MessageStatus.LEASED.value, MessageStatus.PENDING.value
        for statuses, index in (
            ((leased,), "ix_queueing_messages_leased"),
            ((pending,), None),
            ((leased, pending), "ix_queueing_messages_leased"),  # (each status on its own index)
        ):
            for queue in (None, "entries"):
                seen: list[tuple[str, Any]] = []
                record = _recorder(prov, seen)
                sa.event.listen(prov.engine.sync_engine, "before_cursor_execute", record)
                try:
                    page = await rt.tracker.query(MessageQuery(status=statuses, queue=queue), limit=150)
                finally:
                    sa.event.remove(prov.engine.sync_engine, "before_cursor_execute", record)
                assert len(page.items) == (150 if len(statuses) == 2 else 100)
                assert {r.status for r in page.items} == set(statuses)
                [(said, plan)] = await _plans(prov, seen)
                names = {n.get("Index Name") for n in plan}
                assert not [n for n in plan if n["Node Type"] == "Seq Scan"], (said, plan)
                # (not a walk of the whole history newest first)
                assert "ix_queueing_messages_created" not in names, (said, plan)
                if index is not None:
                    assert index in names, (said, plan)
    finally:
        await rt.close()


async def test_listings_that_may_show_running_rows_merge_the_time_index_and_the_leased_index(pg_db):
    """PostgreSQL: the listing index by time leaves out the rows running now (migration 16), so a
    listing that may show them and that no index by status serves (no status filter, archived rows,
    Leased with Succeeded) reads the rest through it, newest first, and those through the lease
    sweeper's index, and merges them: under 100,000 rows of history whose creation times repeat and
    run against their ids, three pages of each listing are, row for row, what one ORDER BY over the
    table gives, the leased rows in their places, and no page scans the table. A filter naming Leased
    twice lists the leased rows only."""
    prov = pg_db.provider(listen=False)
    rt = Runtime(app(), prov)
    await rt.open()
    try:
        await fill(prov, ("entries", "other"))
        m = prov.tables.messages
        async with prov.engine.begin() as conn:
            # 5,000 creation times, about 20 rows each, in an order of their own (the fill's are one)
            await conn.exec_driver_sql(
                f"UPDATE {m.fullname} "
                "SET created_at = created_at + mod(id * 7919, 5000) * interval '1 second'"
            )
        async with prov.engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.exec_driver_sql(f"VACUUM ANALYZE {m.fullname}")
        leased, succeeded = MessageStatus.LEASED.value, MessageStatus.SUCCEEDED.value
        archived = MessageStatus.ARCHIVED.value
        for query, where, merged in (
            (MessageQuery(), "true", True),
            (MessageQuery(queue="entries"), "queue = 'entries'", True),
            (MessageQuery(type="Job", archived=False), "type = 'Job' AND NOT archived", True),
            (MessageQuery(status=(leased, succeeded)), "status IN ('Leased', 'Succeeded')", True),
            (MessageQuery(status=(archived,)), "archived", True),
            (MessageQuery(status=(leased, leased)), "status = 'Leased'", False),
        ):
            seen: list[tuple[str, Any]] = []
            record = _recorder(prov, seen)
            listed: list[Any] = []
            cursor = None
            sa.event.listen(prov.engine.sync_engine, "before_cursor_execute", record)
            try:
                for _ in range(3):
                    page = await rt.tracker.query(query, limit=1000, cursor=cursor)
                    listed += page.items
                    cursor = page.next_cursor
                    if cursor is None:
                        break
            finally:
                sa.event.remove(prov.engine.sync_engine, "before_cursor_execute", record)
            async with prov.engine.connect() as conn:
                expected = (
                    await conn.exec_driver_sql(
                        f"SELECT message_id FROM {m.fullname} WHERE {where} "
                        "ORDER BY created_at DESC, id DESC LIMIT 3000"
                    )
                ).scalars()
                assert [r.message_id for r in listed] == list(expected), query
            if "archived" not in where:
                assert sum(r.status == leased for r in listed) >= 2, query
            for said, plan in await _plans(prov, seen):
                names = {n.get("Index Name") for n in plan}
                assert not [n for n in plan if n["Node Type"] == "Seq Scan"], (said, plan)
                assert "ix_queueing_messages_leased" in names, (said, plan)
                # the rest walked newest first on the index by time, not read whole and sorted
                walked = [
                    n
                    for n in plan
                    if n.get("Index Name") == "ix_queueing_messages_created"
                    and n.get("Scan Direction") == "Backward"
                ]
                assert bool(walked) == merged, (said, plan)
    finally:
        await rt.close()


async def _opened_seeing(rt: Runtime, hook: Any) -> Runtime:
    """``rt`` opened (migrating its database) with ``hook`` called before each statement it says."""
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", hook)
    try:
        await rt.open()
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", hook)
    return rt


async def _a_database_before(db: Any, version: int, n: int) -> tuple[QueueingApp, list[int], Any, Any]:
    """A database as the migrations before ``version`` left it (see ``_as_before``), with a message
    ``Job(n)`` in it: the app, the list its handler appends to, the receipt, the provider (closed)."""
    prov = db.provider(listen=False)
    a = app()
    ran: list[int] = []
    a.handler(Job)(lambda msg: ran.append(msg.n))
    rt = Runtime(a, prov)
    await rt.open()
    sent = await a.enqueue(Job(n=n))
    await _as_before(prov, version)
    await rt.close()
    return a, ran, sent, prov


async def test_migrations_15_and_16_make_the_indexes_again_and_the_rows_stay_found(sql_db):
    """A database as version 14 left it (a tracking index of every row; on PostgreSQL listing indexes
    and the index by time holding Leased rows) with a message in it: migrations 15 and 16 make the
    indexes as they are now defined, each building before it drops, and the message is still found by
    its tracking id and runs."""
    a, ran, sent, prov = await _a_database_before(sql_db, 15, 7)
    m = prov.tables.messages

    ddl_said: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if " INDEX " in statement.upper():
            ddl_said.append(" ".join(statement.split()))

    prov = sql_db.provider(listen=False)
    rt = await _opened_seeing(Runtime(a, prov), record)  # migrates 14 -> the latest
    try:
        made = [i for i, s in enumerate(ddl_said) if s.upper().startswith("CREATE INDEX")]
        dropped = [i for i, s in enumerate(ddl_said) if s.upper().startswith("DROP INDEX")]
        assert len(made) == (4 if sql_db.backend == "postgresql" else 1), ddl_said
        if sql_db.backend == "postgresql":
            # each migration's builds before its first drop of an old index: a drop's lock stops reads
            # as well, and is held to the commit, so a build after it would stop them for its whole read
            for version, names in (
                (15, ("ix_queueing_messages_tracking", *LISTING_INDEXES)),
                (16, ("ix_queueing_messages_created",)),
            ):
                builds = [i for i in made if f"_v{version} ON " in ddl_said[i]]
                old = [i for i in dropped if ddl_said[i].endswith(names)]
                assert len(builds) == len(old) == len(names), ddl_said
                assert max(builds) < min(old), ddl_said
        async with prov.engine.connect() as conn:
            if sql_db.backend == "sqlite":
                query = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ?"
                values: Any = (m.name,)
            else:
                query = (
                    "SELECT indexname, indexdef FROM pg_indexes "
                    "WHERE schemaname = %(s)s AND tablename = %(t)s"
                )
                values = {"s": sql_db.schema, "t": m.name}
            ddl = dict((await conn.exec_driver_sql(query, values)).all())
            done = set((await conn.execute(sa.select(prov.tables.schema_versions.c.version))).scalars())
        assert done == set(range(1, sql_schema.LATEST + 1))
        assert "tracking_id <> message_id" in ddl["ix_queueing_messages_tracking"], ddl
        assert not [n for n in ddl if n[-4:] in ("_v15", "_v16")], ddl  # (nothing left of the builds)
        if sql_db.backend == "postgresql":
            assert "<> 'Leased'" in ddl["ix_queueing_messages_created"], ddl
            for name in LISTING_INDEXES:
                assert "'Leased'" in ddl[name], ddl[name]
                assert "'Succeeded'" in ddl[name], ddl[name]
        assert (await a.status(sent.tracking_id)).message_id == sent.message_id
        await run_until_idle(rt)
        assert ran == [7]
    finally:
        await rt.close()


async def _as_before(prov: Any, version: int) -> None:
    """The database as the migrations before ``version`` (14 or 15) left it: the indexes that 15 and 16
    replace as 14 had them (a tracking index of every row; on PostgreSQL listing indexes and the index
    by time holding Leased rows), and before 14 the row trigger that woke result waiters (``_v10``'s)."""
    m = prov.tables.messages
    prefix = f"{prov.tables.metadata.schema}." if prov.tables.metadata.schema else ""
    table = f"{prefix}{m.name}"
    async with prov.engine.begin() as conn:
        await conn.exec_driver_sql(f"DROP INDEX {prefix}ix_queueing_messages_tracking")
        await conn.exec_driver_sql(f"CREATE INDEX ix_queueing_messages_tracking ON {table} (tracking_id)")
        if prov.backend == "postgresql":
            for name, cols in (
                ("ix_queueing_messages_status", "status, created_at, id"),
                ("ix_queueing_messages_queue_status", "queue, status, created_at, id"),
            ):
                await conn.exec_driver_sql(f"DROP INDEX {prefix}{name}")
                await conn.exec_driver_sql(
                    f"CREATE INDEX {name} ON {table} ({cols}) WHERE status <> 'Succeeded'"
                )
            await conn.exec_driver_sql(f"DROP INDEX {prefix}ix_queueing_messages_created")
            await conn.exec_driver_sql(
                f"CREATE INDEX ix_queueing_messages_created ON {table} (created_at, id)"
            )
        if version <= 14:  # 10's row trigger, and 2's UPDATE counts function (14 replaced both)
            await conn.run_sync(lambda sync: sql_schema._v10(sync, prov.tables))
            await conn.exec_driver_sql(sql_schema._count_function_sql(prov.tables, "UPDATE"))
        versions = prov.tables.schema_versions
        await conn.execute(sa.delete(versions).where(versions.c.version >= version))


async def _state(prov: Any) -> tuple[set[int], bool, dict[str, str]]:
    """The versions applied, whether _v10's row trigger is there, and the messages table's indexes
    (name: definition)."""
    m = prov.tables.messages
    # (an engine of its own: the provider's is closed, or never opened when its start failed)
    engine = create_engine(POSTGRES_URL)
    async with engine.connect() as conn:
        done = set((await conn.execute(sa.select(prov.tables.schema_versions.c.version))).scalars())
        trigger = (
            await conn.exec_driver_sql(
                "SELECT count(*) FROM pg_trigger WHERE tgname = 'queueing_notify_done' "
                "AND tgrelid = %(t)s::regclass",
                {"t": f"{prov.tables.metadata.schema}.{m.name}"},
            )
        ).scalar_one()
        indexes = dict(
            (
                await conn.exec_driver_sql(
                    "SELECT indexname, indexdef FROM pg_indexes "
                    "WHERE schemaname = %(s)s AND tablename = %(t)s",
                    {"s": prov.tables.metadata.schema, "t": m.name},
                )
            ).all()
        )
    await engine.dispose()
    return done, bool(trigger), indexes


def _as_15_made_them(indexes: dict[str, str], made: bool) -> None:
    """The three indexes of migration 15 as it makes them (``made``) or as 14 left them, and nothing
    left of a build under another name either way."""
    assert not [n for n in indexes if n[-4:] in ("_v15", "_v16")], indexes
    assert ("tracking_id <> message_id" in indexes["ix_queueing_messages_tracking"]) == made, indexes
    for name in ("ix_queueing_messages_status", "ix_queueing_messages_queue_status"):
        assert ("'Leased'" in indexes[name]) == made, indexes[name]


async def _upgraded_and_runs(
    prov: Any, rt: Runtime, a: QueueingApp, sent: Any, ran: list[int], n: int
) -> None:
    """Every migration applied, the message sent before found by its tracking id, and run once."""
    done, trigger, indexes = await _state(prov)
    assert done == set(range(1, sql_schema.LATEST + 1))
    assert not trigger
    _as_15_made_them(indexes, True)
    assert "'Leased'" in indexes["ix_queueing_messages_created"]  # (16's)
    assert (await a.status(sent.tracking_id)).message_id == sent.message_id
    await run_until_idle(rt)
    assert ran == [n]


async def test_an_upgrade_from_before_14_builds_the_indexes_of_15_while_reads_go_on(pg_db):
    """Each migration commits before the next begins: 14's DROP TRIGGER takes the table's exclusive
    lock, which stops reads as well, and had it been held to a commit after 15's index builds, reads
    would have waited for every build. Another session reads the table, with a lock timeout, just
    before each of 15's and 16's builds; and a message sent before the upgrade is found and runs after it."""
    import psycopg

    a, ran, sent, prov = await _a_database_before(pg_db, 14, 3)
    assert (await _state(prov))[:2] == ({v for v in range(1, 14)}, True)
    table = f"{pg_db.schema}.{prov.tables.messages.name}"
    conninfo = sa.make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    reads: list[str] = []

    def read_beside(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
    ) -> None:
        said = " ".join(statement.split())
        if not (said.upper().startswith("CREATE INDEX") and ("_v15 " in said or "_v16 " in said)):
            return
        with psycopg.connect(conninfo, autocommit=True) as other:
            other.execute("SET lock_timeout = '2s'")
            try:
                other.execute(f"SELECT count(*) FROM {table}")
                reads.append("read")
            except psycopg.errors.LockNotAvailable:
                reads.append("waited")

    prov = pg_db.provider(listen=False)
    rt = await _opened_seeing(Runtime(a, prov), read_beside)  # migrates 13 -> the latest
    try:
        assert reads == ["read"] * 4, reads  # (15's three builds, 16's one)
        await _upgraded_and_runs(prov, rt, a, sent, ran, 3)
    finally:
        await rt.close()


@pytest.mark.parametrize("failing", [14, 15, 16])
async def test_a_migration_that_fails_rolls_back_alone_and_the_next_start_goes_on(
    pg_db, monkeypatch, failing
):
    """A fault at the end of migration 14, 15 or 16 (every statement of it run, its version not yet
    written): the start fails, the migrations before it stay applied, nothing of it is left, and the
    message sent before is kept; the next start applies what is left and the message runs once."""
    a, ran, sent, prov = await _a_database_before(pg_db, 14, 5)

    def broken(step: Any) -> Any:
        def run(conn: sa.Connection, tables: Any) -> None:
            step(conn, tables)
            raise RuntimeError("injected: the host died at the end of a migration")

        return run

    monkeypatch.setattr(
        sql_schema,
        "MIGRATIONS",
        [(v, d, broken(step) if v == failing else step) for v, d, step in sql_schema.MIGRATIONS],
    )
    prov = pg_db.provider(listen=False)
    with pytest.raises(RuntimeError, match="injected"):
        await Runtime(a, prov).open()
    done, trigger, indexes = await _state(prov)
    assert done == set(range(1, failing))
    assert trigger == (failing == 14)  # 14 (which drops it) applied only when a later one failed
    _as_15_made_them(indexes, failing > 15)  # 15's indexes only when it was applied
    assert "'Leased'" not in indexes["ix_queueing_messages_created"]  # 16 left nothing
    monkeypatch.undo()

    prov = pg_db.provider(listen=False)
    rt = Runtime(a, prov)
    await rt.open()
    try:
        await _upgraded_and_runs(prov, rt, a, sent, ran, 5)
    finally:
        await rt.close()
