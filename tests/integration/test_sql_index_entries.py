"""Schema migration 15: a claim writes no entry in the listing indexes by status (they leave out Leased,
PostgreSQL), and neither a claim nor a success writes one in the tracking index (it holds only the rows
whose tracking id is not their own message id, the default since then). The lookups those indexes
served still read an index under a long history, and a database made before is upgraded."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

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


async def test_migration_15_makes_the_indexes_again_and_the_rows_stay_found(sql_db):
    """A database as version 14 left it (a tracking index of every row; on PostgreSQL listing indexes
    holding Leased rows) with a message in it: migration 15 makes the indexes as they are now defined,
    and the message is still found by its tracking id and runs."""
    prov = sql_db.provider(listen=False)
    a = app()
    ran: list[int] = []
    a.handler(Job)(lambda msg: ran.append(msg.n))
    rt = Runtime(a, prov)
    await rt.open()
    sent = await a.enqueue(Job(n=7))
    m = prov.tables.messages
    prefix = f"{sql_db.schema}." if sql_db.schema else ""
    table = f"{prefix}{m.name}"
    async with prov.engine.begin() as conn:
        await conn.exec_driver_sql(f"DROP INDEX {prefix}ix_queueing_messages_tracking")
        await conn.exec_driver_sql(f"CREATE INDEX ix_queueing_messages_tracking ON {table} (tracking_id)")
        if sql_db.backend == "postgresql":
            for name, cols in (
                ("ix_queueing_messages_status", "status, created_at, id"),
                ("ix_queueing_messages_queue_status", "queue, status, created_at, id"),
            ):
                await conn.exec_driver_sql(f"DROP INDEX {prefix}{name}")
                await conn.exec_driver_sql(
                    f"CREATE INDEX {name} ON {table} ({cols}) WHERE status <> 'Succeeded'"
                )
        versions = prov.tables.schema_versions
        await conn.execute(sa.delete(versions).where(versions.c.version == 15))
    await rt.close()

    ddl_said: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if " INDEX " in statement.upper():
            ddl_said.append(" ".join(statement.split()))

    prov = sql_db.provider(listen=False)
    rt = Runtime(a, prov)
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        await rt.open()  # migrates 14 -> 15
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)
    try:
        made = [i for i, s in enumerate(ddl_said) if s.upper().startswith("CREATE INDEX")]
        dropped = [i for i, s in enumerate(ddl_said) if s.upper().startswith("DROP INDEX")]
        assert len(made) == (3 if sql_db.backend == "postgresql" else 1), ddl_said
        if sql_db.backend == "postgresql":
            # every build before the first drop of an old index: a drop's lock stops reads as well,
            # and is held to the commit, so a build after it would stop them for its whole read
            old = [i for i in dropped if not ddl_said[i].endswith("_v15")]
            assert max(made) < min(old), ddl_said
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
        assert 15 in done
        assert "tracking_id <> message_id" in ddl["ix_queueing_messages_tracking"], ddl
        assert not [n for n in ddl if n.endswith("_v15")], ddl  # (nothing left of the build)
        if sql_db.backend == "postgresql":
            for name in ("ix_queueing_messages_status", "ix_queueing_messages_queue_status"):
                assert "'Leased'" in ddl[name], ddl[name]
                assert "'Succeeded'" in ddl[name], ddl[name]
        assert (await a.status(sent.tracking_id)).message_id == sent.message_id
        await run_until_idle(rt)
        assert ran == [7]
    finally:
        await rt.close()
