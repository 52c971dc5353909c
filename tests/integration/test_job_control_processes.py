"""Job control across processes on PostgreSQL: a worker process runs the handlers; this process
cancels, watches progress and waits for results, as another host would."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus
from queueing_core.errors import JobCancelled
from queueing_core.providers.sql.schema import DONE_PREFIX
from queueing_core.runtime import Runtime

from .jobworker import Chore, build_app

pytestmark = pytest.mark.slow


def spawn(db, log: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.jobworker", db.url, db.schema or "", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        await asyncio.sleep(0.05)


async def test_cancel_progress_and_result_across_processes(pg_db, tmp_path):
    log = tmp_path / "events.log"
    # process B: this test. It opens the same schema first (migrating it) so the worker finds it ready
    app = build_app()
    rt = Runtime(app, pg_db.provider())
    await rt.open()
    worker = spawn(pg_db, log)
    try:
        # a result from another process
        quick = await app.enqueue(Chore(name="quick", steps=2))
        result = await app.result(quick.tracking_id, timeout=30)
        assert result["name"] == "quick"
        assert result["pid"] == worker.pid

        # a running handler: its progress is visible here, and a cancellation from here reaches it
        long = await app.enqueue(Chore(name="long", steps=2000))

        async def reporting() -> bool:
            st = await app.status(long.tracking_id)
            return st.status == MessageStatus.LEASED and st.progress is not None and st.progress["step"] >= 3

        await until(reporting, 30, "progress from the running handler")
        progress = (await app.status(long.tracking_id)).progress
        assert progress is not None
        assert progress["total"] == 2000
        assert progress["text"].startswith("long step")
        asked = time.monotonic()
        receipt = await app.cancel(long.tracking_id)
        assert receipt.status == MessageStatus.LEASED

        async def cancelled() -> bool:
            return (await app.status(long.tracking_id)).status == MessageStatus.CANCELLED

        await until(cancelled, 45, "the running message to be recorded Cancelled")
        # the worker polls the control store once a minute: only NOTIFY brings it this soon (the bound
        # is wide for a loaded machine)
        assert time.monotonic() - asked < 45
        assert "cancelled long" in lines(log)
        assert "finished long" not in lines(log)
        with pytest.raises(JobCancelled):
            await app.result(long.tracking_id, timeout=30)

        # a message not yet running never runs
        later = await app.enqueue(Chore(name="later"), delay=timedelta(seconds=2))
        done = await app.cancel(later.tracking_id)
        assert done.status == MessageStatus.CANCELLED
        await asyncio.sleep(3.5)
        assert (await app.status(later.tracking_id)).status == MessageStatus.CANCELLED
        assert not any(line.endswith(" later") for line in lines(log))
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        await rt.close()
    assert worker.returncode == 0, err


async def test_a_result_waiter_is_woken_by_notify_when_another_process_finishes_the_message(pg_db, tmp_path):
    log = tmp_path / "events.log"
    app = build_app()
    provider = pg_db.provider()
    rt = Runtime(app, provider)
    await rt.open()
    worker = spawn(pg_db, log)
    try:
        gate = tmp_path / "gate"
        held = await app.enqueue(Chore(name="held", gate=str(gate)))

        async def started() -> bool:
            return "started held" in lines(log)

        await until(started, 30, "the handler to start in the other process")
        # the waiter looks at the history every 10 minutes: only a NOTIFY can explain an early return
        waiter = asyncio.ensure_future(app.result(held.tracking_id, timeout=1200, poll=600))

        async def watched() -> bool:
            m = provider.tables.messages
            async with provider.engine.connect() as conn:
                flag = (
                    await conn.execute(sa.select(m.c.awaited).where(m.c.message_id == held.message_id))
                ).scalar()
            return bool(flag) and held.message_id in provider._result_waiters

        await until(watched, 30, "the waiter to flag the message as awaited")
        await asyncio.sleep(0.2)  # the waiter is in its long wait now (a look after the flag found it Leased)
        assert not waiter.done()
        # a host of the version before hears only the queue wake-up channel
        old_host: list[str] = []
        older = provider.listener(provider.channel)
        older.on_notify = old_host.append
        await older.start()
        assert older.connected.is_set()
        gate.touch()
        # far below the 600 s poll, generous for a loaded machine: only the NOTIFY can wake it in time
        result = await asyncio.wait_for(waiter, 60)
        assert result["name"] == "held"
        assert result["pid"] == worker.pid
        assert held.message_id not in provider._result_waiters  # the waiter cleaned up after itself
        # every NOTIFY committed before this marker reaches the old host before it
        async with provider.auto.connect() as conn:
            await conn.execute(sa.select(sa.func.pg_notify(provider.channel, "marker")))

        async def marked() -> bool:
            return "marker" in old_host

        await until(marked, 30, "the marker NOTIFY")
        await older.stop()
        assert not [p for p in old_host if p.startswith(DONE_PREFIX)]  # "done" went to its own channel

        # a NOTIFY that never arrives only delays the waiter: it still looks at the history each poll
        gate2 = tmp_path / "gate2"
        late = await app.enqueue(Chore(name="late", gate=str(gate2)))
        provider._result_waiters = _Deaf(set)
        waiter = asyncio.ensure_future(app.result(late.tracking_id, timeout=120, poll=0.5))
        await asyncio.sleep(0.5)
        gate2.touch()
        assert (await asyncio.wait_for(waiter, 150))["name"] == "late"
    finally:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
        await rt.close()
    assert worker.returncode == 0, err


class _Deaf(defaultdict):
    """Result waiters that a NOTIFY never finds (as if the LISTEN connection had dropped it)."""

    def get(self, key, default=None):
        return default
