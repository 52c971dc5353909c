"""Schema set-up on PostgreSQL: several hosts migrating a new schema at once, and schema names up to
PostgreSQL's 63-character limit (wake-up channels included)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.naming import Transport
from queueing_core.providers.delayed.store import channel_for as delayed_channel
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql import schema as schema_module
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sql.provider import channel_for
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from tests.envelopes import an_envelope
from tests.services import POSTGRES_URL, drop_schema, require

MIGRATE_AT = textwrap.dedent(
    """
    import asyncio, sys, time
    from queueing_core.providers.sql import SqlProvider

    url, schema, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
    provider = SqlProvider(url, schema=schema, listen=False, connect_retries=0)
    time.sleep(max(0.0, start - time.time()))  # everything imported: start together

    async def main():
        await provider.open()
        await provider.close()

    asyncio.run(main())
    """
)


def test_three_hosts_migrating_a_new_schema_at_once_all_succeed():
    """Three processes start on a schema that does not exist yet, at the same moment, five times:
    every one of them succeeds (the schema is created under the migration lock)."""
    require("PostgreSQL", "127.0.0.1", 5432)
    for _ in range(5):
        schema = f"qm_{uuid.uuid4().hex[:10]}"
        start = time.time() + 2.5
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", MIGRATE_AT, POSTGRES_URL, schema, str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=os.getcwd(),
            )
            for _ in range(3)
        ]
        try:
            results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
        finally:
            asyncio.run(drop_schema(schema))
        assert [rc for rc, _ in results] == [0, 0, 0], [err[-2000:] for _, err in results]


def test_channel_names_fit_postgres_and_stay_apart():
    from queueing_core.providers.sql.listener import MAX_IDENTIFIER, channel_name

    assert channel_for(None) == "queueing_public"
    assert channel_for("tenant_a") == "queueing_tenant_a"  # short names as before: hosts agree
    long_a, long_b = "a" * 50 + "_first_one", "a" * 50 + "_other_one"
    names = {channel_for(long_a), channel_for(long_b), delayed_channel(long_a), delayed_channel(long_b)}
    assert len(names) == 4
    assert all(len(n.encode()) <= MAX_IDENTIFIER for n in names)
    assert channel_name("queueing", long_a) == channel_for(long_a)  # stable: every host derives the same


@queue("long-named")
class Ping(QueueMessage):
    n: int = 0


async def test_a_63_character_schema_enqueues_and_wakes_a_waiting_worker():
    """A schema name at PostgreSQL's limit: enqueue works (its NOTIFY channel fits) and a worker
    waiting on LISTEN is woken by it; the delayed store's channel fits too."""
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = "q" + uuid.uuid4().hex + uuid.uuid4().hex[:30]
    assert len(schema) == 63
    app = QueueingApp("long")
    app.handler(Ping)(lambda msg: None)
    consumer = SqlProvider(POSTGRES_URL, schema=schema)
    producer = SqlProvider(POSTGRES_URL, schema=schema, listen=False)
    stores = SideStores(POSTGRES_URL, schema=schema)
    try:
        await consumer.open(app)
        rt = Runtime(app, producer)
        await rt.open()
        sub = app.subscription("Ping")
        # LISTEN up before the enqueue (waited for: a loaded machine may be slow to connect)
        await asyncio.wait_for(consumer._listener.connected.wait(), 30)
        waiting = asyncio.create_task(consumer.wait_for_work(sub, 120))
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        await app.enqueue(Ping())
        await asyncio.wait_for(waiting, 60)
        assert time.monotonic() - t0 < 60  # woken by NOTIFY, not by the 120 s timeout
        assert len(await consumer.receive(sub, 10)) == 1
        await stores.open()
        now = utcnow()
        env = an_envelope("Ping", "long-named", created_at=now, body={"n": 0})
        delayed = stores.delayed_store(Transport.RABBITMQ)
        await delayed.store(env, "long-named", now + timedelta(minutes=1))  # its NOTIFY fits as well
        await rt.close()
    finally:
        await consumer.close()
        await stores.close()
        await drop_schema(schema)


def _to_v9(sync: sa.Connection, provider: SqlProvider) -> None:
    """Make the database what version 9 left: no awaited column, no wake-up of result waiters in the
    triggers (version 10's row trigger, or the counts trigger's since version 14), no identities table."""
    m, t = provider.tables.messages, provider.tables
    if sync.dialect.name == "postgresql":
        schema = t.metadata.schema
        sync.exec_driver_sql(f"DROP TRIGGER IF EXISTS queueing_notify_done ON {m.fullname}")
        sync.exec_driver_sql(
            f"DROP FUNCTION IF EXISTS {schema + '.' if schema else ''}queueing_notify_done()"
        )
        sync.exec_driver_sql(schema_module._count_function_sql(t, "UPDATE"))  # version 2's, as it was
    sync.exec_driver_sql(f"ALTER TABLE {m.fullname} DROP COLUMN awaited")
    sync.exec_driver_sql(f"DROP TABLE {t.identities.fullname}")
    sync.execute(sa.delete(t.schema_versions).where(t.schema_versions.c.version.in_([10, 14])))


def _triggers(sync: sa.Connection, table: sa.Table) -> set[str]:
    found = sync.execute(
        sa.text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgrelid = CAST(:t AS regclass)"),
        {"t": f'"{table.schema}".{table.name}'},
    )
    return set(found.scalars())


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
async def test_migration_10_upgrades_a_version_9_database_with_messages_in_it(backend, tmp_path):
    """A database at version 9 with a waiting message: migration 10 adds the awaited column (false on
    the existing row) and the identities table, and on PostgreSQL migration 14 has the counts trigger
    tell result waiters (no row trigger left); the message still runs and an awaited result is woken
    by that trigger."""
    schema = f"qv9_{uuid.uuid4().hex[:10]}" if backend == "postgresql" else None
    if backend == "postgresql":
        require("PostgreSQL", "127.0.0.1", 5432)
        url = POSTGRES_URL
    else:
        url = f"sqlite+aiosqlite:///{tmp_path / 'v9.db'}"
    app = QueueingApp("v9")
    done: list[int] = []
    app.handler(Ping)(lambda msg: done.append(msg.n))
    old = SqlProvider(url, schema=schema, listen=False)
    try:
        rt = Runtime(app, old)
        await rt.open()
        sent = await app.enqueue(Ping(n=9))
        async with old.engine.begin() as conn:
            await conn.run_sync(_to_v9, old)
        await rt.close()

        new = SqlProvider(url, schema=schema)
        rt = Runtime(app, new)
        await rt.open()  # migrates 9 -> 10
        m = new.tables.messages

        def shape(sync: sa.Connection) -> tuple[set[str], bool]:
            inspector = sa.inspect(sync)
            cols = {c["name"] for c in inspector.get_columns(m.name, schema=m.schema)}
            return cols, inspector.has_table(new.tables.identities.name, schema=m.schema)

        async with new.engine.connect() as conn:
            cols, identities = await conn.run_sync(shape)
            awaited = (
                await conn.execute(sa.select(m.c.awaited).where(m.c.message_id == sent.message_id))
            ).scalar()
            versions = set((await conn.execute(sa.select(new.tables.schema_versions.c.version))).scalars())
            triggers = await conn.run_sync(_triggers, m) if backend == "postgresql" else set()
        assert "awaited" in cols
        assert awaited is False
        assert identities
        assert {10, 14} <= versions
        if backend == "postgresql":
            # waiters are woken by the counts trigger (version 14), not by version 10's row trigger
            assert "queueing_notify_done" not in triggers
            assert "queueing_count_update" in triggers
            await asyncio.wait_for(new._listener.connected.wait(), 30)
        poll = 600 if backend == "postgresql" else None
        waiter = asyncio.ensure_future(app.result(sent.tracking_id, timeout=120, poll=poll))
        await asyncio.sleep(0.3)
        await run_until_idle(rt)
        await asyncio.wait_for(waiter, 60)  # poll=600 on PostgreSQL: the counts trigger's NOTIFY woke it
        assert done == [9]
        await rt.close()
    finally:
        if schema is not None:
            await drop_schema(schema)


async def test_a_migration_meeting_a_long_transaction_retries_and_never_holds_up_other_sessions(
    monkeypatch, caplog
):
    """A host of version 9 holds a long transaction on the messages table while a new host migrates:
    the migration's ALTER waits at most the lock timeout, is rolled back and tried again (logged),
    the other sessions' statements on that table keep completing meanwhile, and once the long
    transaction ends the migration succeeds."""
    import logging

    from queueing_core.providers.sql import schema as schema_module

    require("PostgreSQL", "127.0.0.1", 5432)
    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TIMEOUT", 0.5, raising=False)
    monkeypatch.setattr(schema_module, "MIGRATION_RETRY_PAUSE", (0.2, 0.5), raising=False)
    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TRIES", 1000, raising=False)
    caplog.set_level(logging.WARNING, logger="queueing.sql")
    schema = f"qlk_{uuid.uuid4().hex[:10]}"
    app = QueueingApp("locks")
    app.handler(Ping)(lambda msg: None)
    old = SqlProvider(POSTGRES_URL, schema=schema, listen=False)
    new = SqlProvider(POSTGRES_URL, schema=schema, listen=False)
    holder = None
    migrating: asyncio.Task[None] | None = None
    try:
        await old.open(app)
        async with old.engine.begin() as conn:
            await conn.run_sync(_to_v9, old)
        m = old.tables.messages
        holder = await old.engine.connect()
        await holder.begin()
        # a long transaction of a running host: it read the table, so it holds a lock the ALTER needs
        await holder.execute(sa.text(f"SELECT count(*) FROM {m.fullname}"))
        migrating = asyncio.create_task(new.open(app))

        def retries() -> int:
            return sum("trying again" in r.getMessage() for r in caplog.records)

        deadline = time.monotonic() + 60
        served = 0
        while retries() < 3:
            assert not migrating.done(), migrating.exception()
            assert time.monotonic() < deadline, "the migration never gave up waiting for its lock"
            # another session's statement on the table: it queues behind the ALTER's pending lock at
            # most the ALTER's lock timeout; its own 20 s lock timeout fails it if it queued longer
            async with old.auto.connect() as other:
                await other.execute(sa.text("SET lock_timeout = '20s'"))
                await other.execute(sa.text(f"SELECT count(*) FROM {m.fullname}"))
            served += 1
            await asyncio.sleep(0.1)
        assert served >= 1
        assert not migrating.done()
        await holder.rollback()  # the long transaction ends
        await holder.close()
        holder = None
        await asyncio.wait_for(migrating, 60)
        async with new.engine.connect() as conn:
            versions = set((await conn.execute(sa.select(new.tables.schema_versions.c.version))).scalars())
            cols = await conn.run_sync(
                lambda sync: {c["name"] for c in sa.inspect(sync).get_columns(m.name, schema=schema)}
            )
        assert 10 in versions
        assert "awaited" in cols
    finally:
        if holder is not None:
            await holder.rollback()
            await holder.close()
        if migrating is not None and not migrating.done():
            migrating.cancel()
            with contextlib.suppress(BaseException):
                await migrating
        await old.close()
        await new.close()
        await drop_schema(schema)


async def test_an_upgrade_that_cannot_lock_a_table_gives_up_saying_so_and_keeps_what_it_finished(monkeypatch):
    """A long transaction holds the messages table through every try: the upgrade gives up with the
    kit's error for a service not available now (one line from ``queueing migrate``), saying which
    version the schema stays at, and the migration it finished before the busy one stays applied."""
    from queueing_core.errors import ProviderUnavailable

    require("PostgreSQL", "127.0.0.1", 5432)
    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TIMEOUT", 0.3)
    monkeypatch.setattr(schema_module, "MIGRATION_RETRY_PAUSE", (0.1, 0.1))
    monkeypatch.setattr(schema_module, "MIGRATION_LOCK_TRIES", 2)
    schema = f"qlk_{uuid.uuid4().hex[:10]}"
    prov = SqlProvider(POSTGRES_URL, schema=schema, listen=False)
    holder = None
    try:
        app = QueueingApp("locks")
        await prov.open(app)
        versions = prov.tables.schema_versions
        async with prov.engine.begin() as conn:
            # 13 finds its index made and takes no lock; 14 drops 10's trigger (an exclusive lock)
            await conn.run_sync(lambda sync: schema_module._v10(sync, prov.tables))
            await conn.execute(sa.delete(versions).where(versions.c.version >= 13))
        holder = await prov.engine.connect()
        await holder.begin()
        await holder.execute(sa.text(f"SELECT count(*) FROM {prov.tables.messages.fullname}"))
        with pytest.raises(ProviderUnavailable, match="stays at version 13") as raised:
            await schema_module.migrate(prov.engine, prov.tables, now=utcnow)
        assert "end the long transaction" in str(raised.value)
        await holder.rollback()
        await holder.close()
        holder = None
        async with prov.engine.connect() as conn:
            done = set((await conn.execute(sa.select(versions.c.version))).scalars())
        assert done == set(range(1, 14))
        assert await schema_module.migrate(prov.engine, prov.tables, now=utcnow) == list(
            range(14, schema_module.LATEST + 1)
        )
    finally:
        if holder is not None:
            await holder.rollback()
            await holder.close()
        await prov.close()
        await drop_schema(schema)


async def test_the_counts_trigger_tells_result_waiters_once_per_final_status_of_an_awaited_row():
    """The NOTIFY that wakes result waiters (sent by the UPDATE statements' counts trigger since
    migration 14): for each awaited row that reaches a final status, in any statement that changes
    several rows; none for a row nobody waits for, none for an awaited row that is not final, none when
    final rows of different statuses are changed again together (each row's old version paired with
    its own new one), and the counts stay exact throughout. (PostgreSQL folds identical NOTIFYs of one
    transaction into one, so "once" is shown by the triggers left: no row trigger beside the counts.)"""
    import psycopg
    from psycopg import sql

    from queueing_core.providers.sql.schema import DONE_PREFIX

    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qdn_{uuid.uuid4().hex[:10]}"
    provider = SqlProvider(POSTGRES_URL, schema=schema, listen=False)
    app = QueueingApp("done")
    app.handler(Ping)(lambda msg: None)
    rt = Runtime(app, provider)
    await rt.open()
    conninfo = sa.make_url(POSTGRES_URL).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        a, b, c = [await app.enqueue(Ping(n=n)) for n in range(3)]
        m = sql.Identifier(schema, "queueing_messages")
        channel = provider.done_channel
        with (
            psycopg.connect(conninfo, autocommit=True) as listener,
            psycopg.connect(conninfo, autocommit=True) as writer,
        ):
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

            def step(statement: sql.Composable, marker: str) -> list[str]:
                """Run ``statement``, then read what the channel carried up to a marker sent after it
                (notifications arrive in commit order)."""
                writer.execute(statement, {"a": a.message_id, "b": b.message_id, "c": c.message_id})
                writer.execute("SELECT pg_notify(%s, %s)", (channel, marker))
                heard: list[str] = []
                for note in listener.notifies(timeout=30):
                    if note.payload == marker:
                        return heard
                    heard.append(note.payload)
                raise AssertionError(f"the marker {marker!r} never came; heard {heard}")

            def done(*sent: Any) -> list[str]:
                return sorted(f"{DONE_PREFIX}{e.message_id}" for e in sent)

            # flagged as awaited: a change, but nothing final
            flag = sql.SQL("UPDATE {} SET awaited = true WHERE message_id IN (%(a)s, %(c)s)").format(m)
            assert step(flag, "flagged") == []
            # one statement: a (awaited) and b (not) succeed, c (awaited) fails for a retry
            settle = sql.SQL(
                "UPDATE {} SET status = CASE WHEN message_id = %(c)s THEN 'Failed' ELSE 'Succeeded' END "
                "WHERE message_id IN (%(a)s, %(b)s, %(c)s)"
            ).format(m)
            assert sorted(step(settle, "settled")) == done(a)
            # a final row changed again: no second NOTIFY
            archive = sql.SQL("UPDATE {} SET archived = true WHERE message_id = %(a)s").format(m)
            assert step(archive, "archived") == []
            # c reaches its final status later, in a statement of its own
            dead = sql.SQL("UPDATE {} SET status = 'DeadLettered' WHERE message_id = %(c)s").format(m)
            assert step(dead, "dead") == done(c)
            # two final rows of different statuses changed again in one statement: a row's old version
            # paired with another row's new one would see a status change that did not happen
            again = sql.SQL("UPDATE {} SET archived = true WHERE message_id IN (%(a)s, %(c)s)").format(m)
            assert step(again, "archived again") == []
            counts = writer.execute(
                sql.SQL(
                    "SELECT status, archived, sum(n) FROM {} GROUP BY status, archived HAVING sum(n) <> 0"
                ).format(sql.Identifier(schema, "queueing_counts"))
            ).fetchall()
            truth = writer.execute(
                sql.SQL("SELECT status, archived, count(*) FROM {} GROUP BY status, archived").format(m)
            ).fetchall()
            assert sorted(counts) == sorted(truth)
            assert sorted(truth) == [
                ("DeadLettered", True, 1),
                ("Succeeded", False, 1),
                ("Succeeded", True, 1),
            ]
            triggers = {
                r[0]
                for r in writer.execute(
                    "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal AND tgrelid = %s::regclass",
                    (f'"{schema}".queueing_messages',),
                )
            }
            # statement-level triggers only: no row trigger's fixed cost on every UPDATE statement
            assert triggers == {"queueing_count_insert", "queueing_count_update", "queueing_count_delete"}
    finally:
        await rt.close()
        await drop_schema(schema)
