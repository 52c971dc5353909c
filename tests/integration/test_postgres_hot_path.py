"""The PostgreSQL hot path runs on psycopg's own connection: claims, renewals and settlements are
prepared on the server at their first use there, and none of them goes through SQLAlchemy's execute
(its greenlet bridge). Settlements keep their lease fence: a stale lease is refused, row by row."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from queueing_core import QueueingApp, QueueMessage, queue, retry_policy
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, RetryAfter
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.sql.driver import DriverPath
from queueing_core.providers.sql.rows import Lease
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from queueing_core.transport import Settlement


@queue("hot")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("hot")

    @a.handler()
    async def handle(msg: Job) -> None:
        return None

    return a


async def prepared(prov) -> list[str]:
    """The statements prepared on the provider's one pooled connection."""
    async with prov.engine.connect() as conn:
        rows = await conn.execute(sa.text("SELECT statement FROM pg_prepared_statements"))
        return [str(r[0]) for r in rows]


async def until_the_server_shows(engine: sa.Engine, count_sql: str, params: dict, failure: str) -> None:
    """Polls ``count_sql`` (a count of server sessions) until it is not zero: 30 s at most."""
    for _ in range(300):
        with engine.connect() as conn:
            if conn.execute(sa.text(count_sql), params).scalar_one():
                return
        await asyncio.sleep(0.1)
    raise AssertionError(failure)


async def test_claim_renew_and_settle_run_prepared_on_the_driver_connection(pg_db, monkeypatch):
    # one connection in all: the statements prepared on it are the hot path's (SQLAlchemy's own
    # statements would need psycopg's threshold of 5 executions first)
    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(4)])

    through_sqlalchemy: list[str] = []
    original = AsyncConnection.execute

    async def spy(self, statement, *args, **kwargs):
        through_sqlalchemy.append(str(statement)[:60])
        return await original(self, statement, *args, **kwargs)

    monkeypatch.setattr(AsyncConnection, "execute", spy)
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 4
    assert await prov.renew(got) == []
    await prov.settle(
        [
            Settlement(got[0], Complete()),
            Settlement(got[1], Complete()),
            Settlement(got[2], RetryAfter(delay=timedelta(seconds=60), error="x")),
            Settlement(got[3], DeadLetter(DeadLetterReason.NON_RETRYABLE, "no")),
        ]
    )
    assert through_sqlalchemy == []  # claim, renewal and settlement: none through SQLAlchemy
    monkeypatch.setattr(AsyncConnection, "execute", original)
    assert not any(d.refused for d in got)

    texts = await prepared(prov)
    assert any("FOR UPDATE SKIP LOCKED" in t for t in texts), texts  # the claim
    assert any("SET locked_until" in t for t in texts), texts  # the renewal
    assert any("unnest" in t and "settled_at" in t for t in texts), texts  # the batch of successes
    assert any("last_error" in t for t in texts), texts  # the retry settlement
    statuses = {r.status for r in (await rt.tracker.query(MessageQuery(queue="hot"))).items}
    assert statuses == {"Succeeded", "Failed", "DeadLettered"}


async def test_a_stale_lease_is_refused_in_the_pipeline_and_the_rest_commit(pg_db):
    prov = pg_db.provider(listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(3)])
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 3
    # the first two carry a token another claim has since replaced (one plain success, one retry)
    for d in got[:2]:
        d.handle = Lease(d.handle.row, d.handle.token - 1)
    await prov.settle(
        [
            Settlement(got[0], Complete()),
            Settlement(got[1], RetryAfter(delay=timedelta(seconds=60), error="x")),
            Settlement(got[2], RetryAfter(delay=timedelta(seconds=60), error="y")),
        ]
    )
    assert [d.refused for d in got] == [True, True, False]
    async with prov.engine.connect() as conn:
        m = prov.tables.messages
        rows = dict((await conn.execute(sa.select(m.c.id, m.c.status))).all())
    assert rows[got[0].handle.row] == "Leased"
    assert rows[got[1].handle.row] == "Leased"
    assert rows[got[2].handle.row] == "Failed"


async def test_without_prepared_statements_nothing_is_prepared(pg_db):
    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False, prepared_statements=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(2)])
    for _ in range(7):  # past psycopg's automatic threshold as well
        got = await prov.receive(a.subscription("Job"), 1)
        await prov.settle([Settlement(d, RetryAfter(delay=timedelta(0), error="again")) for d in got])
    assert await prepared(prov) == []
    async with prov.engine.connect() as conn:  # nor would SQLAlchemy's own statements be, ever
        raw = await conn.get_raw_connection()
        assert raw.driver_connection.prepare_threshold is None


async def test_driver_errors_become_the_kits_errors(pg_db, monkeypatch):
    import psycopg

    prov = pg_db.provider(listen=False)
    a = app()
    await Runtime(a, prov).open()

    async def broken(self, pg, work):
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(DriverPath, "round_trip", broken)
    with pytest.raises(ProviderUnavailable, match="claim"):
        await prov.receive(a.subscription("Job"), 10)


async def test_a_round_trip_cancelled_midway_leaves_the_pool_usable(pg_db):
    """A cancelled task (a host shutting down) can leave psycopg's connection inside a statement; it
    must not go back to the pool as it is: the next claim on the same one-connection pool works."""
    from queueing_core.providers.sql.driver import Compiled

    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    await Runtime(a, prov).open()
    await a.enqueue_many([Job(n=1)])
    slow = Compiled(sa.select(sa.func.pg_sleep(20)), prov.engine.dialect)
    task = asyncio.create_task(prov._driver.run(prov.auto, "a slow statement", [(slow, {})]))
    engine = pg_db.sync_engine()
    try:
        await until_the_server_shows(
            engine,
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'",
            {},
            "the slow statement never started",
        )
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        engine.dispose()
    got = await asyncio.wait_for(prov.receive(a.subscription("Job"), 10), 30)
    assert [d.envelope.body["n"] for d in got if d.envelope is not None] == [1]


def positional(sql: str) -> tuple[str, list[str]]:
    """A statement compiled for psycopg (``%(name)s``) with ``$n`` parameters, for ``PREPARE``, and the
    names in their order."""
    import re

    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    return re.sub(r"%\((\w+)\)s", number, sql), names


async def test_the_prepared_claims_generic_plan_reads_no_whole_table(pg_db):
    """The server keeps a generic plan (no values) for a prepared statement once it costs no more than
    planning each time. The claim's must fetch the claimed rows by key, not hash a scan of the table."""

    import psycopg

    prov = pg_db.provider(listen=False)
    a = app()
    await Runtime(a, prov).open()
    for _ in range(5):
        await a.enqueue_many([Job(n=i) for i in range(1000)])
    assert prov._hot is not None
    sql, names = positional(prov._hot.claim.sql)
    async with await psycopg.AsyncConnection.connect(
        pg_db.url.replace("+psycopg", ""), autocommit=True
    ) as pg:
        await pg.execute(f"SET search_path = {pg_db.schema}")
        await pg.execute(f"ANALYZE {pg_db.schema}.queueing_messages")
        await pg.execute("SET plan_cache_mode = force_generic_plan")
        await pg.execute(f"PREPARE claim AS {sql}")
        now = "now()"
        values = {"b_queue": "'hot'", "b_now": now, "b_lease_until": now, "b_limit": "10", "b_step": "40000"}
        args = ", ".join(values.get(n, repr(prov._hot.claim.defaults[n])) for n in names)
        async with pg.transaction(force_rollback=True):
            plan = [r[0] for r in await (await pg.execute(f"EXPLAIN EXECUTE claim({args})")).fetchall()]
    text = "\n".join(plan)
    assert "Seq Scan on queueing_messages" not in text, text
    assert "queueing_messages_pkey" in text, text


async def test_a_settlements_generic_plan_finds_its_rows_by_key_when_the_statistics_saw_no_lease(pg_db):
    """A settlement keeps its generic plan for as long as the connection lives. Planned when the
    statistics saw no Leased row (a large table, few leases), a fence spelled ``status = 'Leased'``
    looked cheapest on an index of leased rows, and every settlement then walked every leased row of
    every worker and filtered by id (10,000 leased rows: 9-13 ms a settlement). It must find its rows
    on the primary key whatever the statistics say."""

    import psycopg

    prov = pg_db.provider(listen=False)
    a = app()
    await Runtime(a, prov).open()
    for _ in range(5):
        await a.enqueue_many([Job(n=i) for i in range(1000)])
    m = f"{pg_db.schema}.queueing_messages"
    assert prov._hot is not None
    sql, names = positional(prov._hot.complete_many.sql)
    async with await psycopg.AsyncConnection.connect(
        pg_db.url.replace("+psycopg", ""), autocommit=True
    ) as pg:
        await pg.execute(f"SET search_path = {pg_db.schema}")
        await pg.execute(f"ANALYZE {m}")  # the statistics see no Leased row
        # then other workers lease most of the table
        await pg.execute(
            f"UPDATE {m} SET status = 'Leased', locked_by = 'w' || (id % 100), lease_token = 1, "
            "locked_until = now() + interval '1 hour' WHERE id % 5 <> 0"
        )
        await pg.execute("SET plan_cache_mode = force_generic_plan")
        await pg.execute(f"PREPARE settle AS {sql}")
        ids = [
            r[0]
            for r in await (
                await pg.execute(f"SELECT id FROM {m} WHERE locked_by = 'w1' LIMIT 10")
            ).fetchall()
        ]
        # the worker's id is compiled in as a default: the settling worker here is one of the others
        values = {
            "b_ids": f"ARRAY{ids}::bigint[]",
            "b_tokens": f"ARRAY{[1] * len(ids)}::integer[]",
            "b_now": "now()",
            "locked_by": "NULL",
            "locked_until": "NULL",
            "locked_by_1": "'w1'",
        }
        defaults = prov._hot.complete_many.defaults
        args = ", ".join(values.get(n, repr(defaults[n])) for n in names)
        async with pg.transaction(force_rollback=True):
            plan = [r[0] for r in await (await pg.execute(f"EXPLAIN EXECUTE settle({args})")).fetchall()]
    text = "\n".join(plan)
    assert "queueing_messages_pkey" in text, text
    assert "ix_queueing_messages_status" not in text, text
    assert "ix_queueing_messages_leased" not in text, text


async def test_claims_and_settlements_keep_their_generic_plans(pg_db):
    """PostgreSQL plans a prepared statement's first five calls for their values, then keeps its
    generic plan (planned once) while that plan is estimated no dearer. The claim's generic plan read
    a bare LIMIT parameter as a tenth of the due rows, and the settlement's the ``Leased`` status as an
    unknown value: both lost to every call's own plan, and were planned again on every call."""
    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    for _ in range(3):
        await a.enqueue_many([Job(n=i) for i in range(1000)])
    async with prov.engine.connect() as conn:
        await conn.execute(sa.text(f"ANALYZE {pg_db.schema}.queueing_messages"))
    for _ in range(12):
        got = await prov.receive(a.subscription("Job"), 10)
        assert len(got) == 10
        await prov.settle([Settlement(d, Complete()) for d in got])
    async with prov.engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.text("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
            )
        ).all()
    claims = [(g, c) for t, g, c in rows if "FOR UPDATE SKIP LOCKED" in t]
    settlements = [(g, c) for t, g, c in rows if "unnest" in t and "settled_at" in t]
    # (at least one call on the generic plan, not exactly seven: an autovacuum ANALYZE of the table
    # mid-test invalidates the plans and the server plans a few calls again; main had none at all)
    assert len(claims) == 1, rows
    assert claims[0][0] >= 1, rows
    assert len(settlements) == 1, rows
    assert settlements[0][0] >= 1, rows


# -- the pooled connection the hot path borrows: straight from the pool, back as it was lent ----------


async def pooled_state(prov) -> tuple[object, bool, bool]:
    """Of the provider's one pooled connection, as an ordinary SQLAlchemy user gets it: psycopg's
    transaction status, its autocommit, and whether it still carries the hot path's clean mark."""
    from queueing_core.providers.sql.engine import RETURNED_CLEAN

    async with prov.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        pg = raw.driver_connection
        return pg.info.transaction_status, pg.autocommit, RETURNED_CLEAN in raw.info


async def a_transaction_still_rolls_back(prov) -> None:
    """An ordinary SQLAlchemy transaction on the pool's connection: what it rolls back is not kept (it
    would be, committed statement by statement, on a connection left in autocommit)."""
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        async with conn.begin() as tx:
            await conn.execute(sa.update(m).values(reason="rolled back"))
            await tx.rollback()
        assert (
            await conn.execute(sa.select(sa.func.count()).where(m.c.reason == "rolled back"))
        ).scalar() == 0


async def test_the_hot_path_returns_its_connection_idle_unmarked_and_as_sqlalchemy_left_it(
    pg_db, monkeypatch
):
    """The hot path borrows straight from the pool and gives its connection back out of any
    transaction, with autocommit as SQLAlchemy left it, marked clean for the pool's reset (which then
    rolls nothing back) and that mark gone after the return."""
    from psycopg.pq import TransactionStatus
    from sqlalchemy.dialects.postgresql.psycopg import AsyncAdapt_psycopg_connection

    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(3)])
    rollbacks: list[object] = []
    original = AsyncAdapt_psycopg_connection.rollback

    def counted(self):
        rollbacks.append(self)
        return original(self)

    monkeypatch.setattr(AsyncAdapt_psycopg_connection, "rollback", counted)
    got = await prov.receive(a.subscription("Job"), 10)
    assert await prov.renew(got) == []
    await prov.settle(
        [
            Settlement(got[0], Complete()),
            Settlement(got[1], RetryAfter(delay=timedelta(seconds=60), error="x")),
        ]
    )
    await prov.settle([Settlement(got[2], Complete())])
    # claim, renewal, two settlements: no rollback on their returns (the pool's reset listener found
    # them marked clean; SQLAlchemy's own reset would roll each back)
    assert rollbacks == []
    monkeypatch.undo()
    status, autocommit, marked = await pooled_state(prov)
    assert (status, autocommit, marked) == (TransactionStatus.IDLE, False, False)
    await a_transaction_still_rolls_back(prov)


async def test_a_connection_returned_inside_a_transaction_is_still_rolled_back(pg_db):
    """The kit's engines leave the pool's rollback on return to their ``reset`` listener (the hot
    path's connections come back marked clean): any other connection returned inside a transaction is
    rolled back by it, as SQLAlchemy's own reset would."""
    from psycopg.pq import TransactionStatus

    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    await Runtime(a, prov).open()
    await a.enqueue_many([Job(n=1)])
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        # a transaction SQLAlchemy does not know of: its Connection ends none on its close
        pg = (await conn.get_raw_connection()).driver_connection
        await pg.execute(f"UPDATE {m.fullname} SET reason = 'left behind'")
        assert pg.info.transaction_status == TransactionStatus.INTRANS
    status, autocommit, marked = await pooled_state(prov)
    assert (status, autocommit, marked) == (TransactionStatus.IDLE, False, False)
    async with prov.engine.connect() as conn:  # (the same connection: a pool of one)
        assert (
            await conn.execute(sa.select(sa.func.count()).where(m.c.reason == "left behind"))
        ).scalar() == 0
    # and the hot path takes it as it takes any: a claim in autocommit, committed
    assert len(await prov.receive(a.subscription("Job"), 10)) == 1


async def test_a_settlement_cancelled_in_a_lock_wait_leaves_the_pool_clean_and_settles_once(pg_db):
    """A settlement batch (one pipeline) cancelled while the server waits for a row lock: the
    connection goes back out of any transaction and with autocommit as SQLAlchemy left it, or out of
    the pool; the batch is not half applied, and settled again it applies once."""
    from psycopg.pq import TransactionStatus

    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    await Runtime(a, prov).open()
    await a.enqueue_many([Job(n=i) for i in range(2)])
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 2
    m = prov.tables.messages
    blocker = pg_db.sync_engine()
    try:
        with blocker.connect() as lock:
            lock.execute(sa.select(m.c.id).where(m.c.id == got[0].handle.row).with_for_update())
            lock_pid = lock.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            batch = [
                Settlement(got[0], Complete()),
                Settlement(got[1], RetryAfter(delay=timedelta(seconds=60), error="once")),
            ]
            task = asyncio.create_task(prov.settle(batch))
            # this test's settlement alone (the server is shared: another session's lock wait must
            # not pass for it): a lock wait on this schema's table, not the blocker
            await until_the_server_shows(
                blocker,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND pid <> :blocker AND query LIKE :table",
                {"blocker": lock_pid, "table": f"%{m.schema}%{m.name}%"},
                "the settlement never waited for the lock",
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            lock.rollback()
    finally:
        blocker.dispose()
    status, autocommit, marked = await pooled_state(prov)
    assert (status, autocommit, marked) == (TransactionStatus.IDLE, False, False)
    await a_transaction_still_rolls_back(prov)
    async with prov.engine.connect() as conn:
        rows = (
            await conn.execute(sa.select(m.c.status, m.c.attempt, m.c.lease_token).order_by(m.c.id))
        ).all()
    assert [r.status for r in rows] == ["Leased", "Leased"]  # nothing of the cancelled batch applied
    for d in got:
        d.refused = False
    await prov.settle(batch)
    assert not any(d.refused for d in got)
    await prov.settle(batch)  # a second time: refused, row by row (its leases are gone)
    assert all(d.refused for d in got)
    async with prov.engine.connect() as conn:
        after = (
            await conn.execute(sa.select(m.c.status, m.c.attempt, m.c.last_error).order_by(m.c.id))
        ).all()
    assert [(r.status, r.attempt) for r in after] == [
        ("Succeeded", rows[0].attempt + 1),  # (one attempt counted per settled message)
        ("Failed", rows[1].attempt + 1),
    ]
    assert after[1].last_error == "once"


async def test_an_engine_of_the_callers_keeps_sqlalchemys_reset_and_no_mark(pg_db):
    """An engine the caller built has no ``reset`` listener of the kit's: the hot path does not mark
    its connections (a mark nobody pops would outlive the return) and its pool's own rollback runs."""
    from psycopg.pq import TransactionStatus
    from sqlalchemy.ext.asyncio import create_async_engine

    from queueing_core.providers.sql import SqlProvider
    from queueing_core.providers.sql.engine import normalize_url

    engine = create_async_engine(normalize_url(pg_db.url), pool_size=1, max_overflow=0)
    prov = SqlProvider(pg_db.url, schema=pg_db.schema, engine=engine, listen=False)
    pg_db.providers.append(prov)
    try:
        a = app()
        await Runtime(a, prov).open()
        await a.enqueue_many([Job(n=1)])
        got = await prov.receive(a.subscription("Job"), 10)
        await prov.settle([Settlement(got[0], Complete())])
        assert not got[0].refused
        status, autocommit, marked = await pooled_state(prov)
        assert (status, autocommit, marked) == (TransactionStatus.IDLE, False, False)
    finally:
        await engine.dispose()


@pytest.mark.parametrize("durable", [True, False])
async def test_the_hot_paths_connections_keep_their_engines_settings(pg_db, durable):
    """Claims and settlements run in autocommit (a statement, or a pipeline, commits at its end), the
    claims of relaxed providers with ``synchronous_commit=off`` (their own pool), the rest durable."""
    prov = pg_db.provider(durable_claims=durable, listen=False)
    await Runtime(app(), prov).open()
    seen = {}
    for name, engine in (("claims", prov.claims), ("settlements", prov.auto)):
        async with prov._driver.connection(engine) as pg:
            setting = (await (await pg.execute("SHOW synchronous_commit")).fetchone())[0]
            # (the kit's connect timeout too: the relaxed claims' own settings add to it)
            timeout = pg.info.get_parameters().get("connect_timeout")
            seen[name] = (pg.autocommit, setting, timeout)
    limit = str(retry_policy.PG_CONNECT_TIMEOUT)
    assert seen == {
        "claims": (True, "on" if durable else "off", limit),
        "settlements": (True, "on", limit),
    }


@pytest.mark.parametrize("left", ["in a transaction", "inside a statement"])
async def test_a_connection_left_in_use_goes_out_of_the_pool_and_the_cancellation_through(pg_db, left):
    """A hot-path call interrupted (here, cancelled) with its connection inside a transaction or inside
    a statement: that connection is closed and out of the pool, never given back with autocommit on nor
    marked clean, and the caller sees its own cancellation, not psycopg's refusal to change autocommit
    there."""
    from psycopg.pq import TransactionStatus

    prov = pg_db.provider(pool_size=1, max_overflow=0, listen=False)
    a = app()
    await Runtime(a, prov).open()
    await a.enqueue_many([Job(n=1)])
    lent = []

    async def interrupted() -> None:
        async with prov._driver.connection(prov.auto) as pg:
            lent.append(pg)
            if left == "in a transaction":
                await pg.execute("BEGIN")
                await pg.execute("SELECT 1")
            else:
                pg.pgconn.send_query(b"SELECT pg_sleep(0.2)")  # (sent; its result never read)
            assert pg.info.transaction_status != TransactionStatus.IDLE
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await interrupted()
    [pg] = lent
    assert pg.closed
    status, autocommit, marked = await pooled_state(prov)
    assert (status, autocommit, marked) == (TransactionStatus.IDLE, False, False)
    await a_transaction_still_rolls_back(prov)
    got = await asyncio.wait_for(prov.receive(a.subscription("Job"), 10), 30)
    assert [d.envelope.body["n"] for d in got if d.envelope is not None] == [1]
