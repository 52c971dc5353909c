"""The SQLite hot path runs on sqlite3 itself: claims, renewals and settlements go through none of
SQLAlchemy's execute, a settlement batch is one call and one transaction (all of it or none of it), on
the event loop's thread or in one hop to aiosqlite's (see test_sqlite_inline.py for which), a stale lease
is refused, and sqlite3's errors become the kit's as SQLAlchemy's wrapping of them does. Real SQLite
files throughout."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.clock import as_utc
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, Defer, Expire, Release, RetryAfter
from queueing_core.errors import ProviderError, ProviderUnavailable
from queueing_core.providers.sql import SqlProvider, statements
from queueing_core.providers.sql.engine import BUSY_TIMEOUT_MS
from queueing_core.providers.sql.errors import db_boundary
from queueing_core.providers.sql.rows import Lease
from queueing_core.providers.sql.sqlite_driver import SqliteDriverPath
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement


@queue("lite-hot")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("lite-hot")

    @a.handler()
    async def handle(msg: Job) -> None:
        return None

    return a


class Clock:
    """A fixed clock that steps on demand: two providers given the same steps write the same times."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


async def opened(path: str, **kw: Any) -> tuple[SqlProvider, QueueingApp, Runtime]:
    prov = SqlProvider(f"sqlite:///{path}", **kw)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    return prov, a, rt


def rows_of(path: str) -> list[dict[str, Any]]:
    with sqlite3.connect(path) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM queueing_messages ORDER BY id")]


def batch(got: list[Delivery], until: datetime) -> list[Settlement]:
    """Every kind of outcome: plain successes, a success with a result, retry, dead letter, defer,
    release and expiry."""
    return [
        Settlement(got[0], Complete()),
        Settlement(got[1], Complete()),
        Settlement(got[2], Complete(result={"total": 3})),
        Settlement(got[3], RetryAfter(delay=timedelta(seconds=60), error="boom?")),
        Settlement(got[4], DeadLetter(DeadLetterReason.NON_RETRYABLE, "no")),
        Settlement(got[5], Defer(until=until, status=MessageStatus.SLEEPING, reason="later")),
        Settlement(got[6], Release(reason="shutting down")),
        Settlement(got[7], Expire(expired_at=until)),
    ]


async def test_claim_renew_and_settle_run_on_sqlite3_one_transaction_per_call(tmp_path, monkeypatch):
    import aiosqlite

    from queueing_core.providers.sql import sqlite_driver

    prov, a, rt = await opened(str(tmp_path / "q.db"))
    await a.enqueue_many([Job(n=i) for i in range(8)])
    through_sqlalchemy: list[str] = []
    original = AsyncConnection.execute

    async def spy(self, statement, *args, **kwargs):
        through_sqlalchemy.append(str(statement)[:60])
        return await original(self, statement, *args, **kwargs)

    hops: list[str] = []
    original_hop = aiosqlite.Connection._execute

    async def count(self, fn, *args, **kwargs):
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await original_hop(self, fn, *args, **kwargs)

    transactions: list[int] = []
    original_call = sqlite_driver._round_trip

    def one(db, work):
        transactions.append(len(work))
        return original_call(db, work)

    monkeypatch.setattr(AsyncConnection, "execute", spy)
    monkeypatch.setattr(aiosqlite.Connection, "_execute", count)
    monkeypatch.setattr(sqlite_driver, "_round_trip", one)
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 8
    assert await prov.renew(got) == []
    hops.clear()
    transactions.clear()
    await prov.settle(batch(got, prov.clock() + timedelta(hours=1)))
    # the whole batch, seven statements, is one transaction, and that is all: no rollback on the
    # connection's return to the pool, no isolation level set and reset, and (the connection being
    # free) not even the hop to aiosqlite's thread (see test_sqlite_inline.py)
    assert transactions == [7]
    assert hops == []
    assert through_sqlalchemy == []  # claim, renewal and settlement: none through SQLAlchemy
    monkeypatch.undo()
    assert not any(d.refused for d in got)
    statuses = [r["status"] for r in rows_of(str(tmp_path / "q.db"))]
    assert statuses == [
        "Succeeded",
        "Succeeded",
        "Succeeded",
        "Failed",
        "DeadLettered",
        "Sleeping",
        "Pending",
        "Expired",
    ]
    await rt.close()


async def test_the_hot_path_writes_and_reads_the_rows_the_sqlalchemy_path_does(tmp_path, monkeypatch):
    """The same claims, renewals and settlements, at the same clock, through the hot path and through
    SQLAlchemy (the provider without its hot statements): the same rows, column by column, and the
    same deliveries."""
    # the same lease tokens on both paths: each claim's token step is random otherwise
    monkeypatch.setattr(statements, "claim_step", lambda: 123_457)
    results: dict[str, tuple[list[dict[str, Any]], list[tuple[Any, ...]]]] = {}
    for path in ("hot", "engine"):
        clock = Clock()
        file = str(tmp_path / f"{path}.db")
        prov, a, rt = await opened(file, clock=clock, worker_id="w-1")
        if path == "engine":
            prov._hot = None
        assert (prov._hot is None) == (path == "engine")
        await a.enqueue_many([Job(n=i) for i in range(8)])
        clock.now += timedelta(seconds=1)
        got = await prov.receive(a.subscription("Job"), 10)
        clock.now += timedelta(seconds=1)
        assert await prov.renew(got) == []
        clock.now += timedelta(seconds=1)
        await prov.settle(batch(got, clock.now + timedelta(hours=1)))
        seen = [
            (
                d.attempt,
                d.handle.token,
                d.lease_until,
                d.envelope.body["n"] if d.envelope else None,
                d.refused,
            )
            for d in got
        ]
        # the ids differ between the two databases (uuid4), and the message's own times (its clock,
        # not the provider's): everything else must match
        rows = [
            {k: v for k, v in r.items() if k not in ("message_id", "tracking_id", "created_at", "expires_at")}
            for r in rows_of(file)
        ]
        results[path] = (rows, seen)
        await rt.close()
    assert results["hot"][0] == results["engine"][0]
    assert results["hot"][1] == results["engine"][1]
    lease_until = results["hot"][1][0][2]
    assert lease_until is not None
    assert lease_until.tzinfo is not None


async def test_a_claim_reads_its_timestamps_as_utc_times_and_leaves_uuids_to_the_envelope(tmp_path):
    """The claimed rows' timestamps come back aware, in UTC (as psycopg gives them), and are the times
    that were written: the envelope validation no longer marks each of them UTC itself. Their UUIDs
    stay text, which the envelope's validation parses: the delivery carries the ids that were sent."""
    prov, a, rt = await opened(str(tmp_path / "q.db"))
    sent = await a.enqueue(Job(n=1))
    hot = prov._hot
    assert hot is not None
    now = prov.clock()
    until = now + a.subscription("Job").options.lease_duration
    [claimed] = await prov._driver.run(
        prov.claims, "a claim", [(hot.claim, prov._claim_params(a.subscription("Job"), 10, now, until))]
    )
    [row] = claimed.rows
    for column in ("created_at", "expires_at", "locked_until"):
        assert row[column].tzinfo is UTC, column
    assert row["not_before"] is None
    [stored] = rows_of(str(tmp_path / "q.db"))
    assert row["created_at"] == datetime.fromisoformat(stored["created_at"]).replace(tzinfo=UTC)
    assert row["locked_until"] == until
    assert row["message_id"] == sent.message_id.hex == stored["message_id"]
    # through the provider's claim: the envelope of the message that was sent
    await a.enqueue(Job(n=2))
    [delivery] = await prov.receive(a.subscription("Job"), 10)
    assert delivery.envelope is not None
    assert delivery.envelope.body == {"n": 2}
    assert isinstance(delivery.envelope.message_id, UUID)
    assert delivery.envelope.created_at.tzinfo is UTC
    await rt.close()


async def test_a_damaged_row_is_dead_lettered_alone_and_the_rest_of_its_claim_runs(tmp_path):
    """A row whose stored id or time no longer reads (damaged outside the kit) is claimed as a malformed
    delivery and dead-lettered, fenced by its own lease, with its text kept; the other rows of the same
    claim run. Neither fails the claim: before, a bad time failed every claim of the queue, reported as
    a closed connection."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(3)])
    first, second, _ = rows_of(file)
    with sqlite3.connect(file) as db:
        db.execute("UPDATE queueing_messages SET message_id = 'not-a-uuid' WHERE id = ?", (first["id"],))
        db.execute("UPDATE queueing_messages SET created_at = 'garbage' WHERE id = ?", (second["id"],))
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 3
    damaged = [d for d in got if d.envelope is None]
    assert sorted(d.handle.row for d in damaged) == sorted([first["id"], second["id"]])
    assert all(d.malformed is not None for d in damaged)
    for delivery in got:
        await rt.process_and_settle(delivery)
    by_id = {r["id"]: r for r in rows_of(file)}
    assert [r["status"] for r in by_id.values()].count(str(MessageStatus.SUCCEEDED)) == 1
    for row_id in (first["id"], second["id"]):
        assert by_id[row_id]["status"] == str(MessageStatus.DEAD_LETTERED), by_id[row_id]
    # nothing is left to claim, and nothing is lost: every row is settled
    assert await prov.receive(a.subscription("Job"), 10) == []
    await rt.close()


@pytest.mark.parametrize(
    "text",
    [
        "2026-01-02 03:04:05.123456",  # what SQLAlchemy writes
        "2026-01-02 03:04:05",  # a whole second
        "2026-01-02T03:04:05.123456",
        "2026-01-02 03:04:05.123456+00:00",  # not the kit's: SQLAlchemy's reading, then UTC
        "2026-01-02 05:04:05.123456+02:00",  # an offset: the same instant, in UTC
        "2026-01-02",
    ],
)
def test_the_utc_reader_reads_what_sqlalchemy_reads(text):
    from sqlalchemy.dialects.sqlite import aiosqlite

    from queueing_core.providers.sql.sqlite_driver import _utc_reader

    dialect = aiosqlite.dialect(paramstyle="named")
    sqlalchemys = sa.DateTime(timezone=True)._cached_result_processor(dialect, None)
    assert sqlalchemys is not None
    read = _utc_reader(sqlalchemys)
    assert read(text) == as_utc(sqlalchemys(text))
    assert read(text).tzinfo is UTC
    assert read(None) is None


def test_the_utc_reader_leaves_text_that_does_not_read_to_the_envelope():
    """A damaged time is handed on as it is (the envelope's validation refuses that row alone)."""
    from sqlalchemy.dialects.sqlite import aiosqlite

    from queueing_core.providers.sql.sqlite_driver import _utc_reader

    sqlalchemys = sa.DateTime(timezone=True)._cached_result_processor(aiosqlite.dialect(), None)
    assert sqlalchemys is not None
    assert _utc_reader(sqlalchemys)("garbage") == "garbage"


async def test_a_failing_statement_rolls_back_the_whole_batch(tmp_path):
    """A statement that fails midway (here a trigger refuses the retry's row) undoes the statements
    before it in the same call: no partial settlement; the batch settles whole once the cause is gone."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(3)])
    got = await prov.receive(a.subscription("Job"), 10)
    with sqlite3.connect(file) as db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE UPDATE ON queueing_messages WHEN NEW.last_error = 'refuse' "
            "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
        )
    settlements = [
        Settlement(got[0], Complete()),  # the batch of successes runs first...
        Settlement(got[1], Complete()),
        Settlement(got[2], RetryAfter(delay=timedelta(seconds=60), error="refuse")),  # ...this fails
    ]
    with pytest.raises(ProviderError, match="refused by a trigger"):
        await prov.settle(settlements)
    assert [r["status"] for r in rows_of(file)] == ["Leased", "Leased", "Leased"]
    # the call ran on the event loop's thread, which changes two settings for its span: both are the
    # connection's own again for its next user (see test_sqlite_inline.py)
    async with prov.engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar() == BUSY_TIMEOUT_MS
        assert (await conn.exec_driver_sql("PRAGMA wal_autocheckpoint")).scalar() == 1000
    # the connection is usable and out of any transaction: the same batch settles once allowed
    with sqlite3.connect(file) as db:
        db.execute("DROP TRIGGER refuse")
    await prov.settle(settlements)
    assert [r["status"] for r in rows_of(file)] == ["Succeeded", "Succeeded", "Failed"]
    await rt.close()


async def test_a_stale_lease_is_refused_and_the_rest_commit(tmp_path):
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(4)])
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 4
    # the first and third carry a token another claim has since replaced (a success and a retry)
    for d in (got[0], got[2]):
        d.handle = Lease(d.handle.row, d.handle.token - 1)
    await prov.settle(
        [
            Settlement(got[0], Complete()),
            Settlement(got[1], Complete()),
            Settlement(got[2], RetryAfter(delay=timedelta(seconds=60), error="x")),
            Settlement(got[3], RetryAfter(delay=timedelta(seconds=60), error="y")),
        ]
    )
    assert [d.refused for d in got] == [True, False, True, False]
    assert [r["status"] for r in rows_of(file)] == ["Leased", "Succeeded", "Leased", "Failed"]
    # and a stale run's renewal is refused too: it learns it lost the lease
    assert await prov.renew([got[0], got[1]]) == [got[0], got[1]]  # (got[1] is settled: no lease)
    await rt.close()


async def test_database_locked_is_translated_as_on_the_sqlalchemy_path(tmp_path):
    """Another process holding SQLite's one write lock past the busy timeout: sqlite3's own
    ``OperationalError: database is locked`` becomes ProviderUnavailable (worth a retry), as
    SQLAlchemy's wrapping of it does on the other path."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=1)])
    async with prov.engine.connect() as conn:  # the provider's one pooled connection: wait 50 ms
        await conn.exec_driver_sql("PRAGMA busy_timeout=50")
    holder = sqlite3.connect(file, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(ProviderUnavailable, match="during a claim: OperationalError: database is locked"):
            await prov.receive(a.subscription("Job"), 10)
        # the SQLAlchemy path raises SQLAlchemy's wrapper (its callers translate it): the same translation
        saved, prov._hot = prov._hot, None
        with (
            pytest.raises(
                ProviderUnavailable, match=r"during a claim: OperationalError: .*database is locked"
            ),
            db_boundary("a claim"),
        ):
            await prov.receive(a.subscription("Job"), 10)
        prov._hot = saved
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    got = await prov.receive(a.subscription("Job"), 10)
    assert [d.envelope.body["n"] for d in got if d.envelope] == [1]
    await rt.close()


async def test_a_call_cancelled_midway_ends_its_transaction_and_leaves_the_pool_usable(tmp_path, monkeypatch):
    """A cancelled caller (a host shutting down) while its batch waits for the write lock: the call in
    aiosqlite's thread still ends its transaction (here it commits once the lock is free: an outcome
    recorded whose caller did not hear back, which at worst repeats, never loses), and the provider's
    one pooled connection serves the next claim."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(3)])
    got = await prov.receive(a.subscription("Job"), 2)
    queued = asyncio.Event()
    original = SqliteDriverPath.round_trip

    async def spy(self, aio, bound):
        queued.set()  # (the call is in aiosqlite's queue before this coroutine first waits)
        return await original(self, aio, bound)

    monkeypatch.setattr(SqliteDriverPath, "round_trip", spy)
    holder = sqlite3.connect(file, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    settling = asyncio.create_task(
        prov.settle([Settlement(got[0], Complete()), Settlement(got[1], Complete(result={"r": 1}))])
    )
    await asyncio.wait_for(queued.wait(), 60)
    settling.cancel()
    # the lock goes before the cancelled task is awaited: its pooled connection's return queues behind
    # the call in aiosqlite's thread, which waits for the lock
    holder.execute("ROLLBACK")
    holder.close()
    with pytest.raises(asyncio.CancelledError):
        await settling
    more = await asyncio.wait_for(prov.receive(a.subscription("Job"), 10), 60)
    assert [d.envelope.body["n"] for d in more if d.envelope] == [2]
    async with prov.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        assert not raw.driver_connection._conn.in_transaction
    assert [r["status"] for r in rows_of(file)] == ["Succeeded", "Succeeded", "Leased"]
    await rt.close()


async def test_sqlite3_errors_are_the_kits(tmp_path, monkeypatch):
    prov, a, rt = await opened(str(tmp_path / "q.db"))

    async def broken(self, aio, bound):
        raise sqlite3.DatabaseError("database disk image is malformed")

    monkeypatch.setattr(SqliteDriverPath, "round_trip", broken)
    with pytest.raises(ProviderError, match="claim failed: DatabaseError"):
        await prov.receive(a.subscription("Job"), 10)
    monkeypatch.undo()
    # (and SQLAlchemy's path maps the same sqlite3 error the same way)
    with pytest.raises(ProviderError, match="failed"), db_boundary("a claim"):
        raise sa.exc.DatabaseError("x", {}, sqlite3.DatabaseError("database disk image is malformed"))
    await rt.close()


async def test_a_lone_statement_commits_whatever_the_connections_last_user_left(tmp_path):
    """SQLAlchemy's return of an autocommit connection gives sqlite3 back its implicit transactions
    (it then opens one before a statement that starts with UPDATE); the hot path's single statement
    must still commit (visible to another connection at once) and leave no transaction open."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=1)])
    got = await prov.receive(a.subscription("Job"), 10)
    async with prov.auto.connect() as conn:  # the autocommit engine, as the provider's reads use it
        await conn.execute(sa.text("SELECT 1"))
    await prov.settle([Settlement(got[0], RetryAfter(delay=timedelta(seconds=60), error="x"))])
    assert [r["status"] for r in rows_of(file)] == ["Failed"]  # committed: another connection sees it
    async with prov.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        assert not raw.driver_connection._conn.in_transaction
    await rt.close()


async def test_the_prepared_statements_switch_leaves_sqlite_on_its_hot_path(tmp_path):
    """``QUEUEING_DATABASE_PREPARED_STATEMENTS=false`` is a PostgreSQL pooler's setting: on SQLite there
    is nothing to prepare, and the hot path runs all the same."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file, prepared_statements=False)
    assert isinstance(prov._driver, SqliteDriverPath)
    assert prov._hot is not None
    await a.enqueue_many([Job(n=1)])
    got = await prov.receive(a.subscription("Job"), 10)
    await prov.settle([Settlement(got[0], Complete())])
    assert [r["status"] for r in rows_of(file)] == ["Succeeded"]
    await rt.close()


async def test_an_engine_of_the_callers_keeps_sqlalchemys_path(tmp_path):
    """An engine passed in (here an in-memory database on SQLAlchemy's static pool, one connection
    shared by every user and rolled back on each return) is not the pool the hot path is built for: a
    hot call's return would roll back another user's transaction whose commit is still to come (a
    review lost acknowledged sends that way). Such a provider keeps SQLAlchemy's path."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine("sqlite+aiosqlite://")
    prov = SqlProvider("sqlite://", engine=engine)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    assert prov._hot is None
    await a.enqueue_many([Job(n=i) for i in range(5)])
    got = await prov.receive(a.subscription("Job"), 10)
    await prov.settle([Settlement(d, Complete()) for d in got])
    async with engine.connect() as conn:
        statuses = (await conn.execute(sa.text("SELECT status FROM queueing_messages"))).scalars().all()
    assert sorted(statuses) == ["Succeeded"] * 5
    await rt.close()
    await engine.dispose()


async def test_a_closed_aiosqlite_connection_is_retryable_and_leaves_the_pool(tmp_path):
    """aiosqlite says "Connection closed" (a ValueError) when its thread is gone: the kit's retryable
    error, and that connection out of the pool, so the next call opens a fresh one and succeeds."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=1)])
    async with prov.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        dead = raw.driver_connection
    await dead.close()  # the pooled connection's aiosqlite thread ends
    with pytest.raises(ProviderUnavailable):
        await prov.receive(a.subscription("Job"), 10)
    got = await prov.receive(a.subscription("Job"), 10)
    assert [d.envelope.body["n"] for d in got if d.envelope] == [1]
    await rt.close()


async def test_a_call_on_the_idle_pooled_connection_is_not_borrowed_from_the_pool(tmp_path, monkeypatch):
    """With the provider's one connection idle in its pool, a claim, a renewal or a settlement is
    queued in aiosqlite's thread straight away (one hop, as before) without borrowing the connection:
    the borrowing (two greenlets and the pool's bookkeeping) cost as much of the event loop as the hop."""
    from queueing_core.providers.sql import sqlite_driver

    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(4)])
    first = await prov.receive(a.subscription("Job"), 2)  # (the first call borrows: nothing known yet)
    borrows: list[object] = []
    original = sqlite_driver.borrowed

    def counted(engine):
        borrows.append(engine)
        return original(engine)

    monkeypatch.setattr(sqlite_driver, "borrowed", counted)
    rest = await prov.receive(a.subscription("Job"), 10)
    assert await prov.renew([*first, *rest]) == []
    await prov.settle([Settlement(d, Complete()) for d in [*first, *rest]])
    assert borrows == []
    assert [r["status"] for r in rows_of(file)] == ["Succeeded"] * 4
    await rt.close()


async def test_a_call_waits_for_another_users_transaction_on_the_pooled_connection(tmp_path):
    """A call while another user of the provider's one connection has a transaction open on it (the
    SQLAlchemy path's, several hops long) borrows the connection, so it runs once that transaction has
    ended: never inside it (its BEGIN would fail there, or its statements would join the other user's
    transaction and go with its rollback)."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(2)])
    [first] = await prov.receive(a.subscription("Job"), 1)  # (the hot path knows the connection)
    async with prov.engine.connect() as conn:
        await conn.begin()  # BEGIN IMMEDIATE on the pooled connection, as the SQLAlchemy path does
        await conn.execute(sa.text("UPDATE queueing_messages SET description = 'held' WHERE id = 2"))
        claiming = asyncio.create_task(prov.receive(a.subscription("Job"), 10))
        for _ in range(20):
            await asyncio.sleep(0)  # (the claim runs up to its wait)
        # a round trip on the open transaction: a claim queued in aiosqlite's thread before it, bypassing
        # the pool, would have run (and ended) by the time this returns
        await conn.execute(sa.text("SELECT 1"))
        assert not claiming.done()
        await conn.rollback()
    got = await asyncio.wait_for(claiming, 60)
    assert [d.envelope.body["n"] for d in got if d.envelope] == [1]
    await prov.settle([Settlement(d, Complete()) for d in [first, *got]])
    rows = rows_of(file)
    assert [r["status"] for r in rows] == ["Succeeded", "Succeeded"]
    assert [r["description"] for r in rows] == [None, None]  # (the other user's update rolled back)
    await rt.close()


async def test_an_unusable_idle_connection_leaves_the_pool(tmp_path, monkeypatch):
    """A call on the idle connection whose transaction could not even be rolled back: that connection's
    state is unknown, so it leaves the pool as a borrowed one would; the next call opens a new one."""
    from queueing_core.providers.sql import sqlite_driver

    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=1)])
    got = await prov.receive(a.subscription("Job"), 10)
    assert isinstance(prov._driver, SqliteDriverPath)
    before = prov._driver.idle(prov.engine)  # (the next call will not borrow it)
    assert before is not None
    original = sqlite_driver._round_trip

    def broken(db, work):
        raise sqlite_driver._Unusable(sqlite3.OperationalError("disk I/O error"))

    monkeypatch.setattr(sqlite_driver, "_round_trip", broken)
    with pytest.raises(ProviderUnavailable, match="disk I/O error"):
        await prov.settle([Settlement(got[0], Complete())])
    monkeypatch.setattr(sqlite_driver, "_round_trip", original)
    assert not before._running  # (closed: out of the pool)
    await prov.settle([Settlement(got[0], Complete())])
    async with prov.engine.connect() as conn:
        assert (await conn.get_raw_connection()).driver_connection is not before
    assert [r["status"] for r in rows_of(file)] == ["Succeeded"]
    await rt.close()


def test_the_aiosqlite_internals_the_hot_path_uses_are_there():
    """The one hop uses aiosqlite's own way to run a function in its thread (``_execute``) and its
    ``sqlite3`` connection (``_conn``): an aiosqlite that renames them must fail here, not in a worker."""
    import aiosqlite

    assert callable(aiosqlite.Connection._execute)
    assert isinstance(aiosqlite.Connection.__dict__.get("_conn"), property)
    # and whether a connection is still running, not closed or closing (``SqliteDriverPath.idle``)
    unopened = aiosqlite.Connection(lambda: sqlite3.connect(":memory:"), 64)
    assert unopened._running is True
    assert unopened._connection is None


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:q?mode=memory&uri=true"])
async def test_an_in_memory_database_is_refused_with_the_setting_named(url):
    """Every connection to an in-memory SQLite database gets a database of its own: a queue there
    would take sends no other connection sees. Opening says so and names the setting, instead of
    failing inside SQLAlchemy on pool arguments."""
    from queueing_core.errors import ConfigurationError

    prov = SqlProvider(url)
    with pytest.raises(ConfigurationError, match="QUEUEING_DATABASE_URL: an in-memory SQLite database"):
        await prov.open()


async def test_settling_with_claims_on_sqlite_is_one_transaction(tmp_path):
    """With ``settle_with_claims`` SQLite settles a batch and claims the next in one call of its hot
    path: a claim that fails (here a trigger refuses a row going to Leased) leaves the settlements
    unapplied and nothing claimed; the same call succeeds once the cause is gone, and settling those
    runs again is refused by their lease fences."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file, settle_with_claims=True)
    assert prov.settles_with_claims()
    sub = a.subscription("Job")
    await a.enqueue_many([Job(n=i) for i in range(4)])
    got = await prov.receive(sub, 2)
    with sqlite3.connect(file) as db:
        db.execute(
            "CREATE TRIGGER refuse BEFORE UPDATE ON queueing_messages WHEN NEW.status = 'Leased' "
            "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
        )
    settlements = [Settlement(d, Complete()) for d in got]
    with pytest.raises(ProviderError, match="refused by a trigger"):
        await prov.settle_and_receive(settlements, sub, 10)
    assert [r["status"] for r in rows_of(file)] == ["Leased", "Leased", "Pending", "Pending"]
    with sqlite3.connect(file) as db:
        db.execute("DROP TRIGGER refuse")
    more = await prov.settle_and_receive(settlements, sub, 10)
    assert [d.envelope.body["n"] for d in more if d.envelope] == [2, 3]
    assert [r["status"] for r in rows_of(file)] == ["Succeeded", "Succeeded", "Leased", "Leased"]
    again = [Settlement(d, Complete()) for d in got]
    await prov.settle(again)
    assert all(s.delivery.refused for s in again)
    await rt.close()


async def test_a_sqlite_worker_settling_with_claims_runs_each_message_once(tmp_path):
    from collections import Counter

    from tests.contract.harness import wait_until

    ran: Counter[int] = Counter()
    a = QueueingApp("lite-combined")

    @a.handler()
    async def handle(msg: Job) -> None:
        ran[msg.n] += 1

    file = str(tmp_path / "q.db")
    prov = SqlProvider(f"sqlite:///{file}", settle_with_claims=True)
    rt = Runtime(a, prov)
    await rt.open()
    carried = 0
    original = SqlProvider.settle_and_receive

    async def counted(self: SqlProvider, settlements: Any, sub: Any, n: int) -> Any:
        nonlocal carried
        got = await original(self, settlements, sub, n)
        carried += len(settlements)
        return got

    n = 500
    await a.enqueue_many([Job(n=i) for i in range(n)])
    from queueing_core.worker import Worker

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SqlProvider, "settle_and_receive", counted)
        async with Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, prefetch=2):
            await wait_until(lambda: sum(ran.values()) >= n, timeout=180, what="every handler to run")
    assert ran == Counter(range(n))
    assert Counter(r["status"] for r in rows_of(file)) == Counter({"Succeeded": n})
    assert carried > 0
    await rt.close()


async def test_two_claims_in_flight_asked_for_beside_settling_with_claims_are_named_in_the_log(
    tmp_path, caplog
):
    """A worker asked for a second claim in flight on a provider that settles with its claims keeps one
    claim at a time: it says so at start, with what to change, and still runs."""
    from queueing_core.worker import Worker

    a = QueueingApp("lite-two")

    @a.handler()
    async def handle(msg: Job) -> None:
        pass

    rt = Runtime(a, SqlProvider(f"sqlite:///{tmp_path / 'q.db'}", settle_with_claims=True))
    await rt.open()
    caplog.set_level(logging.WARNING, logger="queueing.worker")
    async with Worker(rt, poll_min=0.01, poll_max=0.1, receives_in_flight=2):
        pass
    [said] = [r.getMessage() for r in caplog.records if "receives_in_flight" in r.getMessage()]
    assert "QUEUEING_SETTLE_WITH_CLAIMS=false" in said
    caplog.clear()
    apart = Runtime(a, SqlProvider(f"sqlite:///{tmp_path / 'q2.db'}"))
    await apart.open()
    async with Worker(apart, poll_min=0.01, poll_max=0.1, receives_in_flight=2):
        pass
    assert not [r for r in caplog.records if "receives_in_flight" in r.getMessage()]
    await rt.close()
    await apart.close()


async def test_a_closed_aiosqlite_connection_is_not_taken_for_idle(tmp_path):
    """``SqliteDriverPath.idle`` trusts ``_running`` and ``_connection`` to tell a closed connection: an
    aiosqlite whose ``close`` left both as they were would send calls to a closed database."""
    import aiosqlite

    conn = await aiosqlite.connect(tmp_path / "q.db")
    assert conn._running is True
    assert conn._connection is not None
    await conn.close()
    assert not conn._running or conn._connection is None


async def test_sqlite_can_flush_at_every_commit_and_refuses_other_settings(tmp_path):
    """``sqlite_synchronous="full"`` (``QUEUEING_SQLITE_SYNCHRONOUS``): an enqueue that returned survives
    a power cut; the connection says FULL, and the hot path still claims and settles (in aiosqlite's
    thread). Anything but normal or full is a configuration error, not a silent default."""
    from queueing_core.errors import ConfigurationError
    from queueing_core.testing import run_until_idle

    a = QueueingApp("sync-full")
    ran: list[int] = []

    @a.handler()
    async def handle(msg: Job) -> None:
        ran.append(msg.n)

    prov = SqlProvider(f"sqlite:///{tmp_path}/q.db", sqlite_synchronous="full")
    rt = Runtime(a, prov)
    await rt.open()
    try:
        async with prov.engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == 2  # FULL
        await a.enqueue(Job(n=1))
        assert await run_until_idle(rt) == 1
        assert ran == [1]
    finally:
        await rt.close()
    with sqlite3.connect(tmp_path / "q.db") as conn:
        assert conn.execute("SELECT status FROM queueing_messages").fetchall() == [("Succeeded",)]
    wrong = SqlProvider(f"sqlite:///{tmp_path}/q2.db", sqlite_synchronous="off")
    with pytest.raises(ConfigurationError, match="QUEUEING_SQLITE_SYNCHRONOUS"):
        await wrong.ensure_open()
