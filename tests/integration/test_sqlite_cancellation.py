"""A caller cancelled on the SQLAlchemy path to SQLite (enqueue, control-store writes, ops queries: a
host shutting down, a request that timed out) must not strand the provider's one pooled connection,
nor leave an open ``sqlite3`` connection behind: the kit's SQLite engine has a single connection and
every later statement would wait for a write lock nobody releases (the busy timeout, then "database is
locked"). Real SQLite files; cancellations at many points in each call."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
from typing import Any

import aiosqlite

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import wait_until


@queue("lite-cancel")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("lite-cancel")

    @a.handler()
    async def handle(msg: Job) -> None:
        return None

    return a


#: sqlite3's own connect, for the test's probe (the test records the provider's connections)
CONNECT = sqlite3.connect


def still_open(conns: list[sqlite3.Connection]) -> list[sqlite3.Connection]:
    """Those not closed (kept referenced here, one a terminated aiosqlite connection forgot stays
    open: the garbage collector cannot finalize it behind the test's back)."""
    found = []
    for conn in conns:
        try:
            conn.in_transaction  # noqa: B018 (raises on a closed connection, from any thread)
        except sqlite3.ProgrammingError:
            continue
        found.append(conn)
    return found


def write_lock_is_free(path: str) -> bool:
    probe = CONNECT(path, timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


async def test_cancelled_callers_leave_no_connection_behind(tmp_path, monkeypatch):
    file = str(tmp_path / "q.db")
    made: list[sqlite3.Connection] = []

    def recorded(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = CONNECT(database, *args, **kwargs)
        if str(database) == file:
            made.append(conn)
        return conn

    # (aiosqlite opens each connection with ``sqlite3.connect``, in its thread)
    monkeypatch.setattr(sqlite3, "connect", recorded)
    prov = SqlProvider(f"sqlite:///{file}")
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    control, tracker = prov.control_store(), prov.tracker()

    async def op(i: int) -> Any:
        match i % 4:
            case 0:
                return await a.enqueue(Job(n=i))
            case 1:
                return await control.set_paused("queue", "lite-cancel", i % 8 == 1)
            case 2:
                return await tracker.counts()
            case _:
                return await control.state()

    rng = random.Random(7)
    for i in range(800):
        task = asyncio.create_task(op(i))
        # cancel at a different point of the call each time: after some turns of the loop (inside
        # the greenlet bridge, the pool's checkout) or some time (a hop to aiosqlite's thread)
        if rng.random() < 0.5:
            for _ in range(rng.randint(0, 30)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(rng.random() * 0.004)
        task.cancel()
        # (an op that finished before the cancel returns normally)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 120)
        assert prov.engine.pool.checkedout() == 0, f"call {i}: the pooled connection was not returned"
        # at most one open (the pool's): a terminated connection's close runs in its thread once the
        # statement there ends
        await wait_until(
            lambda: len(still_open(made)) <= 1,
            timeout=60,
            what=f"the sqlite3 connections of cancelled call {i} to close",
        )
        # (a rollback a cancelled caller queued in the thread may still be on its way)
        await wait_until(
            lambda: write_lock_is_free(file), timeout=60, what=f"the write lock of call {i} to be freed"
        )
    assert len(made) > 1, "no cancelled call ever cost the pool its connection"
    # the provider works on: a write and a read, each on the one pooled connection
    await asyncio.wait_for(a.enqueue(Job(n=-1)), 60)
    assert (await asyncio.wait_for(control.state(), 60)).paused_queues in (frozenset(), {"lite-cancel"})
    assert prov.engine.pool.checkedout() == 0
    await rt.close()


def test_the_aiosqlite_internals_the_engines_terminate_uses_are_there():
    """The engine closes a terminated connection's ``sqlite3`` connection in its thread by queueing the
    close there (``_tx``, while ``_running``): an aiosqlite that renames them must fail here."""
    conn = aiosqlite.Connection(lambda: sqlite3.connect(":memory:"), iter_chunk_size=64)
    assert callable(conn._tx.put_nowait)
    assert conn._running is True  # (until it is stopped)
    assert conn._connection is None
