"""Graceful shutdown of a real worker process on SIGTERM."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

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
    proc = start(handler_seconds=0.8, shutdown_timeout=10)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.split() == ["finished", "drained"]
    assert time.monotonic() - t0 < 5
    assert '"status": "Succeeded"' in err
    assert '"message_id"' in err


def test_deadline_releases_the_message_instead_of_waiting():
    proc = start(handler_seconds=60, shutdown_timeout=0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, err
    assert out.split() == ["released"]  # handed back to the queue, not lost, not finished
    assert elapsed < 5
    assert "still running at the shutdown deadline" in err


def test_second_signal_skips_the_wait():
    proc = start(handler_seconds=60, shutdown_timeout=60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.split() == ["released"]
    assert time.monotonic() - t0 < 10
