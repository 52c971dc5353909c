"""The `queueing` operator commands against a real SQLite file: what they refuse, what they ask, what
they print (the same ops service as the HTTP API)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_QUEUES = {"order-placed", "generate-invoice", "capture-payment"}


@pytest.fixture
def cli(tmp_path):
    env = {
        **os.environ,
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
        "QUEUEING_APP": "queueing_core.examples.orders:app",
        "PYTHONPATH": ROOT,
    }

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "queueing_core.cli", *args],
            cwd=tmp_path,
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return run


def count(cli) -> int:
    return sum(sum(c.values()) for c in json.loads(cli("stats", "--json").stdout).values())


def test_purge_refuses_a_status_nothing_can_have_with_one_line(cli):
    assert cli("enqueue", "OrderPlaced", "--example", "--count", "2").returncode == 0
    r = cli("purge", "--status", "Bogus", "--yes")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "'Bogus'" in lines[0]
    assert "Pending" in lines[0]  # the statuses it could have meant
    assert count(cli) == 2


def test_the_purge_prompt_shows_the_filter_in_words(cli):
    assert cli("enqueue", "OrderPlaced", "--example").returncode == 0
    r = cli("purge", "--queue", "order-placed", "--status", "Pending", "--status", "Failed", stdin="n\n")
    assert r.returncode == 1
    assert "delete the messages with queue order-placed, status Pending or Failed" in r.stdout, r.stdout
    assert "{" not in r.stdout
    assert "'queue'" not in r.stdout
    assert count(cli) == 1
    every = cli("purge", "--all", stdin="n\n")
    assert "delete every message" in every.stdout
    assert cli("purge", "--queue", "order-placed", stdin="y\n").returncode == 0
    assert count(cli) == 0


async def test_stats_json_lists_every_queue_like_the_http_stats(cli, tmp_path):
    assert cli("enqueue", "OrderPlaced", "--example").returncode == 0
    r = cli("stats", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == EXAMPLE_QUEUES
    assert doc["order-placed"] == {"Pending": 1}
    assert doc["generate-invoice"] == {}
    from queueing_core.examples.orders import app

    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    async with rt:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key="k")),
            base_url="http://t" + PREFIX,
            headers={"X-API-Key": "k"},
        )
        async with client:
            http = (await client.get("/stats")).json()
    assert {q["queue"]: q["counts"] for q in http["queues"]} == doc
    table = cli("stats")
    for name in EXAMPLE_QUEUES:
        assert name in table.stdout


def test_enqueue_with_a_delay_past_the_expiry_exits_2_naming_both(cli):
    assert cli("migrate").returncode == 0  # so that start-up logs nothing
    r = cli("enqueue", "OrderPlaced", "--example", "--delay", str(5 * 3600))  # expires after 4 hours
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "not_before" in lines[0]
    assert "expires_at" in lines[0]
    assert count(cli) == 0


def test_purge_refuses_a_queue_the_app_does_not_have_with_one_line(cli):
    assert cli("enqueue", "OrderPlaced", "--example").returncode == 0
    r = cli("purge", "--queue", "order-placed-typo", "--yes")
    assert r.returncode != 0, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "'order-placed-typo'" in lines[0]
    assert count(cli) == 1
