"""Schedules across real processes on PostgreSQL: each tick enqueued once, none lost, across a crash."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp
from queueing_core.runtime import Runtime
from queueing_core.schedules import TICK_HEADER

from .test_sql_processes import stop

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def spawn(db, worker_id: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.schedule_host", db.url, db.schema, worker_id, str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


async def sleep_until(when: datetime) -> None:
    await asyncio.sleep(max(0.0, (when - datetime.now(UTC)).total_seconds()))


def ticks_handled(logs: list[Path]) -> Counter:
    """How many times each tick was handled, from the hosts' logs."""
    handled: Counter = Counter()
    for log in logs:
        if log.exists():
            handled.update(line.split()[0] for line in log.read_text().splitlines() if line)
    return handled


async def until_handled(logs: list[Path], start: datetime, end: datetime, timeout: float = 60) -> None:
    """Until every tick of the window was handled somewhere: a loaded machine may lag behind the
    schedule, so this waits for the work, not for a fixed time after the window."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        in_window = [t for t in ticks_handled(logs) if start <= datetime.fromisoformat(t) < end]
        if len(in_window) >= (end - start).seconds:
            return
        await asyncio.sleep(0.2)


async def test_three_hosts_enqueue_each_tick_of_a_one_second_schedule_once_across_a_crash(pg_db, tmp_path):
    logs = [tmp_path / f"h{i}.log" for i in range(4)]
    procs = [spawn(pg_db, f"host-{i}", logs[i]) for i in range(3)]
    try:
        # a 30-second window that starts once every host runs; one host is killed (-9) and restarted
        start = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
        end = start + timedelta(seconds=30)
        await sleep_until(start + timedelta(seconds=10, milliseconds=430))
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=10)
        procs.append(spawn(pg_db, "host-0-again", logs[3]))
        await sleep_until(end)
        await until_handled(logs, start, end)  # the assertions below say what is missing, if anything
    finally:
        stop(procs)

    rt = Runtime(QueueingApp("check"), pg_db.provider())
    await rt.open()
    m = rt.provider.tables.messages
    async with rt.provider.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.message_id, m.c.headers).where(m.c.queue == "beats"))).all()
    enqueued = Counter(datetime.fromisoformat(headers[TICK_HEADER]) for _, headers in rows)
    in_window = [t for t in enqueued if start <= t < end]
    assert len(in_window) == 30, sorted(in_window)  # 30 ticks in 30 seconds: none lost
    assert set(enqueued.values()) == {1}  # none enqueued twice
    # every tick from the first to the last, without a gap
    first, last = min(enqueued), max(enqueued)
    assert len(enqueued) == int((last - first).total_seconds()) + 1

    handled = ticks_handled(logs)
    window_handled = [t for t in handled if start <= datetime.fromisoformat(t) < end]
    assert len(window_handled) == 30
    # a handler may run twice only for a message whose host was killed mid-run (at-least-once)
    assert sum(handled.values()) - len(handled) <= 1
    await rt.close()
