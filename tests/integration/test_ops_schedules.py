"""Schedules through the ops API and the CLI, on SQLite: listed with their ticks, paused and resumed
on every host (the pause lives in the database), unknown names refused."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.scheduler import Scheduler

from .test_ops_cli import cli  # noqa: F401 - the fixture

KEY = "test-key-not-a-secret"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = datetime(2026, 5, 4, 3, 0, tzinfo=UTC)


@queue("digests")
class Digest(QueueMessage):
    period: str


app = QueueingApp("scheduled")
app.every(timedelta(minutes=1), Digest(period="minute"), name="minutely")


@app.schedule("30 6 * * 1-5", timezone="America/New_York", name="weekday-digest", catch_up="skip")
def weekday_digest() -> Digest:
    return Digest(period="day")


@pytest.fixture
async def served(tmp_path):
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    await rt.open()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
        base_url="http://test" + PREFIX,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    yield client, rt
    await client.aclose()
    await rt.close()


async def digests(rt: Runtime) -> int:
    return (await rt.tracker.counts()).get(("digests", "Pending"), 0)


async def test_schedules_are_listed_paused_and_resumed_over_http(served):
    client, rt = served
    listed = (await client.get("/schedules")).json()
    assert [s["name"] for s in listed] == ["minutely", "weekday-digest"]
    weekday = listed[1]
    assert weekday["expression"] == "30 6 * * 1-5"
    assert weekday["timezone"] == "America/New_York"
    assert weekday["catch_up"] == "skip"
    assert weekday["paused"] is False
    assert weekday["last_tick"] is None

    scheduler = Scheduler(rt)
    assert await scheduler.run_due(T0) == 1
    minutely = (await client.get("/schedules")).json()[0]
    assert datetime.fromisoformat(minutely["last_tick"]) == T0
    assert await digests(rt) == 1

    r = await client.post("/schedules/minutely/pause")
    assert r.status_code == 200
    assert r.json() == {"kind": "schedule", "name": "minutely", "paused": True}
    assert (await client.get("/schedules")).json()[0]["paused"] is True
    rt.control.invalidate()
    await scheduler.run_due(T0 + timedelta(minutes=1))
    assert await digests(rt) == 1  # the tick passed without a message
    assert (await client.post("/schedules/minutely/resume")).json()["paused"] is False
    rt.control.invalidate()
    await scheduler.run_due(T0 + timedelta(minutes=2))
    assert await digests(rt) == 2  # the next tick, and no replay of the paused one


async def test_unknown_or_malformed_schedule_names_are_refused(served):
    client, _ = served
    missing = await client.post("/schedules/nope/pause")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert (await client.post("/schedules/bad%20name!/pause")).status_code == 422
    bare = await client.get("/schedules", headers={"Authorization": "Bearer wrong"})
    assert bare.status_code == 401


def test_the_cli_lists_and_pauses_schedules(cli):  # noqa: F811 - the imported fixture
    scheduled = ("--app", "tests.integration.test_ops_schedules:app")
    assert cli("pause", "--schedule", "weekday-digest", *scheduled).returncode == 0
    listed = json.loads(cli("schedules", "--json", *scheduled).stdout)
    assert {s["name"]: s["paused"] for s in listed} == {"minutely": False, "weekday-digest": True}
    table = cli("schedules", *scheduled)
    assert "weekday-digest" in table.stdout
    assert "America/New_York" in table.stdout
    unknown = cli("pause", "--schedule", "nope", *scheduled)
    assert unknown.returncode == 1
    assert "no schedule named 'nope'" in unknown.stderr
    both = cli("resume", "emails", "--schedule", "minutely", *scheduled)
    assert both.returncode == 2
