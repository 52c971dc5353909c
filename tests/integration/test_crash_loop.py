"""A message that kills every worker that runs it (a native crash, the OOM killer): no failure ever
reaches the pipeline, yet each run that ends this way counts an attempt (a lapsed lease or visibility
timeout), and once they are used up the message is dead-lettered with a reason instead of killing the
next worker. Real worker processes that SIGKILL themselves in the handler, on SQLite (the sweeper
counts the lapsed lease) and on Storage Queues over Azurite (the dequeue count; the pipeline
dead-letters the delivery past its last attempt without running it)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from queueing_core import DeadLetterReason, MessageStatus
from queueing_core.bootstrap import bootstrap
from queueing_core.settings import load_settings

from .crashworker import ATTEMPTS, Fatal, app_of

pytestmark = pytest.mark.slow


def _env(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    if kind == "sqlite":
        return {
            "QUEUEING_PROVIDER": "sql",
            "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/crash.db",
            "QUEUEING_MAINTENANCE_INTERVAL": "0.3",
        }
    if kind == "rabbitmq":
        from tests.services import RABBITMQ_URL, fresh_prefix, require

        require("RabbitMQ", "127.0.0.1", 5672)
        return {
            "QUEUEING_PROVIDER": "rabbitmq",
            "QUEUEING_RABBITMQ_URL": RABBITMQ_URL,
            "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/side.db",
            "QUEUEING_QUEUE_PREFIX": fresh_prefix(),
        }
    azurite = request.getfixturevalue("azurite")
    tag = uuid.uuid4().hex[:8]
    return {
        "QUEUEING_PROVIDER": "storage_queue",
        "QueueingStorage": azurite.connection_string,
        "QUEUEING_QUEUE_PREFIX": f"c{tag}-",
        "QUEUEING_CONTROL_TABLE": f"ctl{tag}",
        "QUEUEING_TRACKER_TABLE": f"hist{tag}",
    }


def _spawn(env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.crashworker", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, **env},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.mark.parametrize("kind", ["sqlite", "storage_queue", "rabbitmq"])
async def test_a_message_that_kills_every_worker_is_dead_lettered_after_its_attempts(
    kind, tmp_path, request, monkeypatch
):
    env = _env(kind, tmp_path, request)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    app = app_of()
    app.message(Fatal)
    rt = bootstrap(app, load_settings())
    await rt.open()
    log = tmp_path / "runs.log"
    sent = await app.enqueue(Fatal(n=7))
    kills = 0
    proc: subprocess.Popen | None = None
    try:
        # one worker at a time, started again whenever the message killed it, as a supervisor would
        # restart it; bounded: a crash loop would use every start
        for _ in range(ATTEMPTS + 3):
            proc = _spawn(env, log)
            deadline = time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                rec = await rt.tracker.get(sent.message_id)
                if rec is not None and rec.status == MessageStatus.DEAD_LETTERED:
                    break
                await asyncio.sleep(0.2)
            if proc.poll() is None:
                break  # alive: the message no longer kills it
            assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
            kills += 1
        rec = await rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED, f"still {rec.status} after {kills} kills"
        assert rec.reason == DeadLetterReason.MAX_ATTEMPTS.value
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
        await rt.close()
    assert log.read_text().split() == ["7"] * ATTEMPTS, "it ran more (or fewer) times than its attempts"
    assert kills == ATTEMPTS
