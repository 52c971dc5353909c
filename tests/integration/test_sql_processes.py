"""Competing consumers, crashes and a database restart with real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp
from queueing_core.runtime import Runtime

from .procworker import Tick

pytestmark = pytest.mark.slow


def spawn(
    db,
    worker_id: str,
    log: Path,
    seconds: float = 0.0,
    lease: float = 2.0,
    gate: tuple[Path, int] | None = None,
) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "tests.integration.procworker",
        db.url,
        db.schema or "",
        worker_id,
        str(log),
    ]
    proc = subprocess.Popen(
        [*args, str(seconds), *([str(gate[0]), str(gate[1])] if gate else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "PROC_LEASE_SECONDS": str(lease)},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


async def enqueue(db, count: int) -> list:
    app = QueueingApp("procs")
    app.message(Tick)
    rt = Runtime(app, db.provider())
    ids = []
    for start in range(0, count, 1000):
        receipts = await app.enqueue_many([Tick(n=i) for i in range(start, min(count, start + 1000))])
        ids += [r.message_id for r in receipts]
    return ids, rt


async def count_status(rt, status: str) -> int:
    m = rt.provider.tables.messages
    async with rt.provider.engine.connect() as conn:
        return (await conn.execute(sa.select(sa.func.count()).where(m.c.status == status))).scalar_one()


async def wait_all(rt, total: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (done := await count_status(rt, "Succeeded")) < total:
        assert time.monotonic() < deadline, f"only {done}/{total} succeeded after {timeout}s"
        await asyncio.sleep(0.2)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        _, err = p.communicate(timeout=30)
        assert p.returncode in (0, -signal.SIGKILL), err


def handled(logs) -> Counter:
    c: Counter = Counter()
    for log in logs:
        if log.exists():
            c.update(line for line in log.read_text().splitlines() if line)
    return c


async def test_four_processes_handle_ten_thousand_messages_each_exactly_once(sql_db, tmp_path):
    logs = [tmp_path / f"w{i}.log" for i in range(4)]
    # a lease of the default size: the 2 s lease of the crash test below would lapse under SQLite's
    # single-writer contention between four processes and re-issue messages (at-least-once, but this
    # test is about "exactly once when nothing goes wrong")
    procs = [spawn(sql_db, f"w{i}", logs[i], lease=30) for i in range(4)]  # all polling before work arrives
    ids, rt = await enqueue(sql_db, 10_000)
    try:
        await wait_all(rt, 10_000, timeout=180)
    finally:
        stop(procs)
    seen = handled(logs)
    assert set(seen) == {str(i) for i in ids}
    assert max(seen.values()) == 1, "a message was handled twice with nothing crashing"
    per_process = [len(handled([log])) for log in logs]
    assert all(n > 0 for n in per_process), per_process  # they really competed
    await rt.close()


async def test_killing_a_worker_mid_run_loses_nothing_and_duplicates_only_what_it_held(pg_db, tmp_path):
    logs = [tmp_path / f"w{i}.log" for i in range(3)]
    # a 10 s lease: the victim's messages come back soon after the kill, while the survivors' leases,
    # renewed every 3.3 s, do not lapse under contention on a loaded machine (a lapse there would be a
    # duplicate the kill did not cause). All three are started before the work arrives: each start
    # waits for the process to be ready, and on a loaded machine the first one started ran through
    # most of the work while the others were still starting. The messages from 1000 on wait for a gate
    # the test opens after the kill: however fast the machine or late the test's look, the run cannot
    # end before it, and the victim holds gated rows until it is killed
    gate = tmp_path / "gate"
    procs = [spawn(pg_db, f"w{i}", logs[i], seconds=0.01, lease=10, gate=(gate, 1000)) for i in range(3)]
    victim = procs[0]

    async def victim_holds() -> set[str]:
        m = rt.provider.tables.messages
        async with rt.provider.engine.connect() as conn:
            rows = await conn.execute(
                sa.select(m.c.message_id).where(m.c.locked_by == "w0", m.c.status == "Leased")
            )
            return {str(i) for i in rows.scalars()}

    try:
        ids, rt = await enqueue(pg_db, 3000)
        # killed mid-run, once a thousand are done and the victim is seen holding rows
        deadline = time.monotonic() + 120
        while await count_status(rt, "Succeeded") < 1000 or not await victim_holds():
            assert time.monotonic() < deadline, "the victim never held a row mid-run"
            await asyncio.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        held = await victim_holds()
        gate.touch()
        await wait_all(rt, 3000, timeout=120)
    finally:
        gate.touch()
        stop(procs)
    assert held, "the kill happened while the victim held nothing; the test proved nothing"
    seen = handled(logs)
    assert set(seen) == {str(i) for i in ids}  # every message was handled
    duplicates = {mid for mid, n in seen.items() if n > 1}
    assert duplicates <= held, duplicates - held
    m = rt.provider.tables.messages
    async with rt.provider.engine.connect() as conn:
        statuses = dict(
            (await conn.execute(sa.select(m.c.status, sa.func.count()).group_by(m.c.status))).all()
        )
    assert statuses == {"Succeeded": 3000}
    await rt.close()


def _pg_ctl(action: str) -> None:
    version = sorted(os.listdir("/etc/postgresql"))[0]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.disruptive
@pytest.mark.skipif(
    not os.path.isdir("/etc/postgresql") or os.geteuid() != 0,
    reason="needs a local PostgreSQL cluster this user may restart",
)
async def test_a_worker_survives_a_postgres_restart_and_loses_nothing(pg_db, tmp_path):
    ids, rt = await enqueue(pg_db, 100)
    log = tmp_path / "w.log"
    proc = spawn(pg_db, "w0", log)
    try:
        await wait_all(rt, 100, timeout=60)
        _pg_ctl("restart")  # the worker's pooled and LISTEN connections all die here
        more: list = []
        deadline = time.monotonic() + 60
        while len(more) < 100:  # the producer retries while the database comes back
            try:
                receipts = await rt.producer.enqueue_many([Tick(n=i) for i in range(10)])
                more += [r.message_id for r in receipts]
            except Exception:
                assert time.monotonic() < deadline, "the database did not come back"
                await asyncio.sleep(0.5)
        await wait_all(rt, 200, timeout=90)
        assert proc.poll() is None, "the worker process died with the database"
    finally:
        stop([proc])
    seen = handled([log])
    assert set(seen) == {str(i) for i in ids + more}
    await rt.close()
