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
        round_trip, hop = sqlite_driver._round_trip, aiosqlite.Connection._execute

        @functools.wraps(round_trip)
        def spy(db: Any, work: Any) -> Any:
            self.threads.append(threading.current_thread().name)
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
    order: list[str] = []

    def busy() -> None:  # (in aiosqlite's thread: its queue has something running)
        release.wait(30)
        order.append("the call before")

    before = asyncio.ensure_future(aio._execute(busy))
    calls = calls_of(aio)
    assert calls is not None
    await asyncio.sleep(0.05)
    assert not calls.idle
    seen = Seen(monkeypatch)
    settling = asyncio.create_task(prov.settle([Settlement(d, Complete()) for d in got]))
    await asyncio.sleep(0.05)
    assert not settling.done()
    release.set()
    await asyncio.wait_for(asyncio.gather(before, settling), 60)
    order.append("the settlement")
    assert order == ["the call before", "the settlement"]
    assert seen.hops == ["_round_trip"]
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
    settings_of = sqlite_driver._settings

    def never(db: sqlite3.Connection) -> Any:  # (no checkpoint ever due)
        state = settings_of(db)
        state.checkpoint_every = 10**9
        return state

    monkeypatch.setattr(sqlite_driver, "_settings", never)
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
