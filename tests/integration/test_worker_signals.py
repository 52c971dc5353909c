"""Graceful shutdown of a real worker process on SIGTERM."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider

SCRIPT = textwrap.dedent(
    """
    import asyncio, logging, sys
    from queueing_core import QueueingApp, QueueMessage
    from queueing_core.logs import configure_logging
    from queueing_core.testing import in_process
    from queueing_core.worker import Worker

    configure_logging("INFO", "json")
    class Slow(QueueMessage):
        seconds: float

    app = QueueingApp()

    @app.handler()
    async def handle(msg: Slow):
        print("started", flush=True)
        await asyncio.sleep(msg.seconds)
        print("finished", flush=True)

    async def main():
        rt = in_process(app)
        worker = Worker(rt, shutdown_timeout=float(sys.argv[2]), poll_min=0.01, poll_max=0.05)
        await rt.open()
        await app.enqueue(Slow(seconds=float(sys.argv[1])))
        await worker.run()
        print("released" if rt.provider.depth("Slow") else "drained", flush=True)

    asyncio.run(main())
    """
)


def start(handler_seconds, shutdown_timeout):
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(handler_seconds), str(shutdown_timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    assert proc.stdout.readline().strip() == "started"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_lets_the_running_handler_finish(sig):
    proc = start(handler_seconds=0.8, shutdown_timeout=120)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.split() == ["finished", "drained"]
    # it stopped once the handler finished, not at the 120 s shutdown deadline (wide for a loaded machine)
    assert time.monotonic() - t0 < 60
    assert '"status": "Succeeded"' in err
    assert '"message_id"' in err


def test_deadline_releases_the_message_instead_of_waiting():
    proc = start(handler_seconds=300, shutdown_timeout=0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, err
    assert out.split() == ["released"]  # handed back to the queue, not lost, not finished
    assert elapsed < 60  # not the 300 s handler (the bound is wide for a loaded machine)
    assert "still running at the shutdown deadline" in err


def test_second_signal_skips_the_wait():
    proc = start(handler_seconds=300, shutdown_timeout=300)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split() == ["released"]
    assert time.monotonic() - t0 < 60  # neither the 300 s handler nor the 300 s shutdown deadline


PREFETCHING = textwrap.dedent(
    """
    import asyncio, sys, time
    from datetime import timedelta
    from queueing_core import QueueingApp, QueueMessage, queue
    from queueing_core.logs import configure_logging
    from queueing_core.providers.sql import SqlProvider
    from queueing_core.runtime import Runtime
    from queueing_core.worker import Worker

    configure_logging("WARNING")

    @queue("prefetched", max_concurrency=2, lease_duration=timedelta(seconds=30))
    class Prefetched(QueueMessage):
        n: int

    app = QueueingApp()

    @app.handler()
    async def handle(msg: Prefetched):
        print("started", msg.n, flush=True)
        await asyncio.sleep(1.5)

    async def main():
        rt = Runtime(app, SqlProvider(sys.argv[1]))
        await rt.open()
        await app.enqueue_many([Prefetched(n=i) for i in range(8)])
        # 2 at a time, 4 claimed per slot: 8 claimed at once, 6 of them waiting for a slot
        worker = Worker(rt, prefetch=4, shutdown_timeout=30, poll_min=0.01, poll_max=0.05)
        await worker.run()
        print("stopped", flush=True)

    asyncio.run(main())
    """
)


@queue("prefetched")
class Prefetched(QueueMessage):
    n: int


async def test_sigterm_hands_back_claimed_messages_that_have_not_started(tmp_path):
    """With QUEUEING_PREFETCH > 1 a worker holds more claimed messages than it runs. On SIGTERM the
    running handlers finish, none of the waiting ones starts, and those are claimable again at once
    with no attempt counted."""
    url = f"sqlite:///{tmp_path}/prefetch.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", PREFETCHING, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    started = [proc.stdout.readline().split(), proc.stdout.readline().split()]
    assert [w[0] for w in started] == ["started", "started"], started
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, err
    assert out.split() == ["stopped"], out  # no handler started after the signal
    # it did not wait out its 30 s shutdown deadline (the output above shows none of the six waiting
    # handlers ran; this bound is wide for a loaded machine)
    assert elapsed < 25, elapsed

    app = QueueingApp()
    app.handler(Prefetched)(lambda msg: None)
    prov = SqlProvider(url)
    await prov.open(app)
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.status, m.c.attempt))).all()
    assert sorted(rows) == [("Pending", 0)] * 6 + [("Succeeded", 1)] * 2
    again = await prov.receive(app.subscription("Prefetched"), 10)  # claimable now, first attempt
    assert sorted(d.attempt for d in again) == [1] * 6
    await prov.close()
