"""The SQLite hot path on the event loop's own thread: a call (a claim, a renewal, a settlement batch)
runs there only while nothing else can use the provider's connection and SQLite's write lock is free
at once; otherwise it goes to aiosqlite's thread, which waits. The event loop never waits for another
connection's lock nor for a checkpoint's flushes, and the connection's settings are as its other users
left them after every call. Real SQLite files, a real second connection holding the write lock."""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.sql import SqlProvider, sqlite_driver
from queueing_core.providers.sql.engine import BUSY_TIMEOUT_MS
from queueing_core.providers.sql.sqlite_thread import calls_of
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("lite-inline")
class Job(QueueMessage):
    n: int


async def opened(path: str) -> tuple[SqlProvider, QueueingApp, Runtime]:
    a = QueueingApp("lite-inline")

    @a.handler()
    async def handle(msg: Job) -> None:
        return None

    prov = SqlProvider(f"sqlite:///{path}")
    rt = Runtime(a, prov)
    await rt.open()
    return prov, a, rt


def statuses(path: str) -> list[str]:
    with sqlite3.connect(path) as db:
        return [r[0] for r in db.execute("SELECT status FROM queueing_messages ORDER BY id")]


class Seen:
    """Where each hot-path transaction ran (the thread's name), and the hops to aiosqlite's thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import aiosqlite

        self.threads: list[str] = []
        self.hops: list[str] = []
        #: shared with a test that records its own events in the same list, in the order they happen
        self.order: list[str] = []
        round_trip, hop = sqlite_driver._round_trip, aiosqlite.Connection._execute

        @functools.wraps(round_trip)
        def spy(db: Any, work: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            self.order.append("a hot-path transaction")
            return round_trip(db, work)

        async def counted(conn: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.hops.append(getattr(fn, "__name__", repr(fn)))
            return await hop(conn, fn, *args, **kwargs)

        monkeypatch.setattr(sqlite_driver, "_round_trip", spy)
        monkeypatch.setattr(aiosqlite.Connection, "_execute", counted)

    def clear(self) -> None:
        self.threads.clear()
        self.hops.clear()


async def settings(prov: SqlProvider) -> tuple[int, int]:
    """The pooled connection's busy timeout and automatic checkpoint, as its other users find them."""
    async with prov.engine.connect() as conn:
        busy = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar()
        pages = (await conn.exec_driver_sql("PRAGMA wal_autocheckpoint")).scalar()
    return busy, pages


async def pooled(prov: SqlProvider) -> Any:
    """The provider's one pooled aiosqlite connection (given back to the pool on return)."""
    async with prov.engine.connect() as conn:
        return (await conn.get_raw_connection()).driver_connection


async def test_a_free_connection_runs_each_call_on_the_event_loops_thread(tmp_path, monkeypatch):
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(4)])
    seen = Seen(monkeypatch)
    got = await prov.receive(a.subscription("Job"), 10)
    assert await prov.renew(got) == []
    await prov.settle([Settlement(got[0], Complete()), Settlement(got[1], Complete(result={"r": 1}))])
    await prov.settle([Settlement(d, RetryAfter(timedelta(seconds=60), "again")) for d in got[2:]])
    # (the first claim borrows the connection from the pool: every call, borrowed or not, goes inline)
    assert seen.threads == [threading.current_thread().name] * 4
    assert seen.hops == []
    assert statuses(file) == ["Succeeded", "Succeeded", "Failed", "Failed"]
    assert await settings(prov) == (BUSY_TIMEOUT_MS, 1000)
    await rt.close()


async def test_the_event_loop_never_waits_for_another_connections_write_lock(tmp_path, monkeypatch):
    """Another process holds SQLite's write lock: the settlement fails at once on the event loop's
    thread (busy timeout 0 there), goes to aiosqlite's thread and waits there, while the event loop
    goes on; once the lock is free it commits, and the connection's busy timeout is its own again."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(2)])
    got = await prov.receive(a.subscription("Job"), 10)
    seen = Seen(monkeypatch)
    holder = sqlite3.connect(file, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        settling = asyncio.create_task(prov.settle([Settlement(d, Complete()) for d in got]))
        await asyncio.sleep(0)  # (the settlement runs up to its wait)
        # waiting on the event loop's thread it would have held it for the whole busy timeout (30 s)
        assert time.monotonic() - started < 5
        for _ in range(5):
            await asyncio.sleep(0.01)  # the event loop keeps running timers meanwhile
        assert not settling.done()
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    await asyncio.wait_for(settling, 60)
    loop_thread = threading.current_thread().name
    assert seen.threads[0] == loop_thread  # tried there first, refused at once by the lock
    assert len(seen.threads) == 2
    assert seen.threads[1] != loop_thread  # then in aiosqlite's thread
    assert seen.hops == ["_round_trip"]
    assert statuses(file) == ["Succeeded", "Succeeded"]
    assert await settings(prov) == (BUSY_TIMEOUT_MS, 1000)
    await rt.close()


async def test_a_call_behind_another_in_aiosqlites_thread_goes_there_and_runs_after_it(tmp_path, monkeypatch):
    """A call queued or running in aiosqlite's thread may still use the connection: a hot-path call then
    never runs beside it on the event loop's thread, but queues behind it."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(2)])
    got = await prov.receive(a.subscription("Job"), 10)
    aio = await pooled(prov)
    release = threading.Event()
    seen = Seen(monkeypatch)

    def busy() -> None:  # (in aiosqlite's thread: its queue has something running)
        release.wait(30)
        seen.order.append("the call before ends")

    before = asyncio.ensure_future(aio._execute(busy))
    calls = calls_of(aio)
    assert calls is not None
    await asyncio.sleep(0.05)
    assert not calls.idle
    settling = asyncio.create_task(prov.settle([Settlement(d, Complete()) for d in got]))
    await asyncio.sleep(0.05)
    assert not settling.done()
    assert seen.order == []  # (not run beside it on the event loop's thread)
    release.set()
    await asyncio.wait_for(asyncio.gather(before, settling), 60)
    assert seen.order == ["the call before ends", "a hot-path transaction"]
    assert seen.hops == ["busy", "_round_trip"]
    assert seen.threads
    assert seen.threads[0] != threading.current_thread().name
    assert calls.idle
    assert statuses(file) == ["Succeeded", "Succeeded"]
    await rt.close()


async def test_checkpoints_run_in_aiosqlites_thread_and_keep_the_wal_bounded(tmp_path, monkeypatch):
    """No commit on the event loop's thread checkpoints (a checkpoint waits for the disk's flushes);
    the hot path queues a passive checkpoint in aiosqlite's thread after about as many transactions as
    make SQLite's own threshold of WAL pages, and the WAL stays near that size. Without those
    checkpoints (the control run) the WAL grows with every transaction."""

    async def run(path: str, messages: int) -> tuple[list[str], int]:
        prov, a, rt = await opened(path)
        await a.enqueue_many([Job(n=i) for i in range(messages)])
        sub = a.subscription("Job")
        while got := await prov.receive(sub, 1):  # (a transaction for each claim and settlement)
            await prov.settle([Settlement(d, Complete()) for d in got])
        await asyncio.sleep(0.2)  # (a checkpoint queued last runs to its end)
        size = os.path.getsize(path + "-wal")
        await rt.close()
        return list(checkpoints), size

    checkpoints: list[str] = []
    original = sqlite_driver._checkpoint

    def spy(db: sqlite3.Connection, state: Any, transactions: int) -> None:
        checkpoints.append(threading.current_thread().name)
        original(db, state, transactions)

    monkeypatch.setattr(sqlite_driver, "_checkpoint", spy)
    ran, size = await run(str(tmp_path / "q.db"), 1500)
    assert ran
    assert threading.current_thread().name not in ran
    # SQLite's threshold: 1000 pages of 4 KiB; what a checkpoint could not copy yet, at most twice that
    assert size < 8 * 2**20, size
    checkpoints.clear()
    never = functools.partial(sqlite_driver.Inline, checkpoint_every=10**9)  # (no checkpoint ever due)
    monkeypatch.setattr(sqlite_driver, "Inline", never)
    ran, unchecked = await run(str(tmp_path / "control.db"), 1500)
    assert ran == []
    # (so no commit on the event loop's thread checkpointed: SQLite's own automatic checkpoint, had it
    # been left on there, would have kept this WAL near 4 MiB as well)
    assert unchecked > 8 * 2**20, unchecked


async def test_a_database_not_in_wal_mode_keeps_every_call_in_aiosqlites_thread(tmp_path, monkeypatch):
    """Outside WAL mode (a file system without the shared memory WAL needs) every commit waits for the
    disk: such a database never has a call on the event loop's thread."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    async with prov.auto.connect() as conn:  # (out of any transaction)
        assert (await conn.exec_driver_sql("PRAGMA journal_mode=DELETE")).scalar() == "delete"
    await a.enqueue_many([Job(n=i) for i in range(2)])
    seen = Seen(monkeypatch)
    got = await prov.receive(a.subscription("Job"), 10)
    await prov.settle([Settlement(d, Complete()) for d in got])
    assert seen.hops == ["_round_trip", "_round_trip"]
    assert threading.current_thread().name not in seen.threads
    assert statuses(file) == ["Succeeded", "Succeeded"]
    await rt.close()


async def test_the_first_write_after_a_checkpoint_that_copied_the_whole_wal_goes_to_aiosqlites_thread(
    tmp_path, monkeypatch
):
    """That write starts the WAL over and flushes the WAL's new header to disk (``synchronous=NORMAL``):
    it runs in aiosqlite's thread, and the writes after it on the event loop's thread again."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    monkeypatch.setattr(sqlite_driver, "Inline", functools.partial(sqlite_driver.Inline, checkpoint_every=3))
    await a.enqueue_many([Job(n=i) for i in range(4)])
    sub = a.subscription("Job")
    got = await prov.receive(sub, 1)
    await prov.settle([Settlement(d, Complete()) for d in got])
    got = await prov.receive(sub, 1)  # (the third write: a checkpoint is queued behind it)
    calls = calls_of(await pooled(prov))
    assert calls is not None
    assert calls.inline is not None
    for _ in range(3000):  # (the checkpoint runs in aiosqlite's thread: up to 30 s on a loaded machine)
        if calls.idle:
            break
        await asyncio.sleep(0.01)
    assert calls.idle
    assert calls.inline.restart  # (nothing else wrote meanwhile: the checkpoint copied the whole WAL)
    seen = Seen(monkeypatch)
    await prov.settle([Settlement(d, Complete()) for d in got])
    got = await prov.receive(sub, 1)
    loop_thread = threading.current_thread().name
    assert seen.threads[0] != loop_thread  # the WAL's restart, in aiosqlite's thread
    assert seen.threads[1:] == [loop_thread]  # and back on the event loop's thread
    assert not calls.inline.restart
    await prov.settle([Settlement(d, Complete()) for d in got])
    assert statuses(file) == ["Succeeded", "Succeeded", "Succeeded", "Pending"]
    await rt.close()


async def test_a_call_that_committed_keeps_its_outcome_when_its_connection_cannot_be_put_back(
    tmp_path, monkeypatch
):
    """The settlement committed on the event loop's thread, then the connection's settings could not
    be put back: that connection leaves the pool, and the settlement is not reported failed (a retry
    would be refused by its own fence, and its outcome taken for another run's)."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(2)])
    got = await prov.receive(a.subscription("Job"), 10)
    before = await pooled(prov)
    put_back = sqlite_driver._put_back
    failed: list[str] = []

    def breaks_once(db: sqlite3.Connection, settings: Any) -> None:
        if not failed and not db.in_transaction and statuses(file) == ["Succeeded", "Succeeded"]:
            failed.append("after the commit")
            db.close()
            raise sqlite_driver._Unusable(sqlite3.OperationalError("disk I/O error (injected)"))
        put_back(db, settings)

    monkeypatch.setattr(sqlite_driver, "_put_back", breaks_once)
    settlements = [Settlement(d, Complete()) for d in got]
    await prov.settle(settlements)
    assert failed == ["after the commit"]
    assert not any(s.delivery.refused for s in settlements)
    assert statuses(file) == ["Succeeded", "Succeeded"]
    assert not before._running  # (out of the pool)
    await a.enqueue(Job(n=3))
    more = await prov.receive(a.subscription("Job"), 10)  # (on a new connection)
    assert [d.envelope.body["n"] for d in more if d.envelope] == [3]
    assert await pooled(prov) is not before
    await rt.close()


async def test_a_setting_changed_by_another_user_of_the_connection_is_read_again(tmp_path, monkeypatch):
    """``synchronous=FULL`` (set through the provider's engine) flushes every commit: from the next call
    on, calls go to aiosqlite's thread; set back to NORMAL, they run on the event loop's thread again."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(3)])
    sub = a.subscription("Job")
    await prov.receive(sub, 1)  # (the settings are read: inline)
    seen = Seen(monkeypatch)
    loop_thread = threading.current_thread().name
    async with prov.auto.connect() as conn:
        await conn.exec_driver_sql("PRAGMA synchronous=FULL")
    await prov.receive(sub, 1)
    assert seen.threads == [seen.threads[0]]
    assert seen.threads[0] != loop_thread
    async with prov.auto.connect() as conn:
        await conn.exec_driver_sql("PRAGMA synchronous=NORMAL")
    await prov.receive(sub, 1)
    assert seen.threads[1:] == [loop_thread]
    await rt.close()


async def test_an_error_other_than_a_lock_is_raised_without_a_second_try(tmp_path, monkeypatch):
    """Only "database is locked" sends a call from the event loop's thread to aiosqlite's: any other
    error is the call's, raised as the kit's error after one try (its transaction rolled back)."""
    file = str(tmp_path / "q.db")
    prov, a, rt = await opened(file)
    await a.enqueue_many([Job(n=i) for i in range(2)])
    got = await prov.receive(a.subscription("Job"), 10)
    with sqlite3.connect(file) as db:
        db.create_function("refuse", 0, lambda: None)  # (known to this connection only)
        db.execute("CREATE TRIGGER refuse BEFORE UPDATE ON queueing_messages BEGIN SELECT refuse(); END")
    seen = Seen(monkeypatch)
    with pytest.raises(ProviderUnavailable, match="no such function: refuse"):
        await prov.settle([Settlement(d, Complete()) for d in got])
    assert seen.threads == [threading.current_thread().name]
    assert seen.hops == []
    assert statuses(file) == ["Leased", "Leased"]
    assert await settings(prov) == (BUSY_TIMEOUT_MS, 1000)
    await rt.close()


async def test_the_aiosqlite_internals_the_counted_calls_rely_on(tmp_path):
    """Its thread reads the queue it was made with, and every way aiosqlite queues a call (connect,
    execute, close, stop) goes through ``put_nowait`` of the queue the connection holds now: counted.
    Anything else of the counted queue but its reading side is refused, so a later aiosqlite that queues
    another way fails here and in use, instead of leaving calls uncounted."""
    import aiosqlite

    from queueing_core.providers.sql.sqlite_thread import count_calls

    conn = aiosqlite.connect(tmp_path / "q.db")
    original = conn._tx
    count_calls(conn)
    calls = calls_of(conn)
    assert calls is not None
    assert conn._thread._args == (original,)
    queued = []
    for step in ("connect", "execute", "close"):
        if step == "connect":
            await conn
        elif step == "execute":
            await (await conn.execute("SELECT 1")).fetchall()
        else:
            await conn.close()
        queued.append(calls._queued)
        assert calls.idle
    assert queued[0] >= 1
    assert queued[0] < queued[1] < queued[2]
    with pytest.raises(AttributeError, match="only put_nowait queues"):
        calls.put  # noqa: B018
