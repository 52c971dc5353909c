"""The timer functions (SQL processor, lease sweeper, retention) on SQLite, and the HTTP ops
function called with func.HttpRequest, with and without keys."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

import azure.functions as func
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from functions import build_app
from functions.host import FunctionsHost
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.settings import QueueingSettings

from .conftest import Context, bindings, functions_of, user


# a lease no stall on a loaded machine outlasts: a lapse would run a message twice (the sweeper's test
# expires its lease by hand)
@queue("timed", lease_duration=timedelta(seconds=30), max_attempts=3)
class Timed(QueueMessage):
    n: int


#: every Functions app these tests build, kept until the session ends: once it has served a request,
#: azure-functions' ``AsgiFunctionApp.__del__`` calls ``asyncio.run`` to tell the ASGI app it shuts
#: down, which fails (an unraisable warning) when the collector happens to run it inside a later
#: test's event loop; the host deletes its app as its process exits, with no loop running
_KEPT: list[Any] = []


def sql_app(tmp_path, **settings):
    app = QueueingApp("fn-sql")
    seen: list[int] = []

    @app.handler()
    async def handle(msg: Timed) -> None:
        seen.append(msg.n)

    cfg = QueueingSettings(
        provider="sql",
        database_url=f"sqlite:///{tmp_path}/fn.db",
        functions_local_sqlite=True,  # one host in this test
        functions_processor_budget=120,  # far more than a drain takes, even on a loaded machine
        **settings,
    )
    host = FunctionsHost(app, cfg)
    _KEPT.append(build_app(cfg, app, host=host, env={}))
    return app, host, functions_of(_KEPT[-1]), seen


async def test_the_sql_processor_timer_drains_the_queue_within_its_budget(tmp_path):
    app, host, fns, seen = sql_app(tmp_path)
    rt = await host.runtime()
    await app.enqueue_many([Timed(n=i) for i in range(50)])
    import time

    t0 = time.monotonic()
    await user(fns["queueing_sql_processor"])(TimerRequest(past_due=False))
    assert sorted(seen) == list(range(50))
    assert time.monotonic() - t0 < 60  # it stopped once idle, well before the budget
    counts = await rt.tracker.counts()
    assert counts == {("timed", "Succeeded"): 50}
    await rt.close()


async def test_the_sweeper_timer_on_a_host_whose_clock_runs_ahead_leaves_a_live_lease_alone(
    tmp_path, monkeypatch
):
    """The sweeper timer compared the leases, written on the database's time, with its host's clock:
    a Functions instance 15 s ahead swept a live run's lease (12 s left) and took its only attempt."""
    import functions.host as fhost
    from queueing_core.clock import utcnow
    from queueing_core.decisions import Complete
    from queueing_core.providers.sql.db_clock import DatabaseClock
    from queueing_core.transport import Settlement

    app, host, fns, _seen = sql_app(tmp_path)
    rt = await host.runtime()
    prov = rt.provider
    sent = await app.enqueue(Timed(n=1))
    [d] = await prov.receive(app.subscription("Timed"), 1)  # a live run on another host
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).values(locked_until=utcnow() + timedelta(seconds=12)))

    def ahead():
        return utcnow() + timedelta(seconds=15)

    monkeypatch.setattr(fhost, "utcnow", ahead)  # this instance's clock, everywhere it is read
    prov.clock, prov.lease_clock = ahead, DatabaseClock(ahead)  # as SqlProvider(clock=DatabaseClock(ahead))
    await user(fns["queueing_lease_sweeper"])(TimerRequest(past_due=False))
    rec = await rt.tracker.get(sent.message_id)
    assert (rec.status, rec.attempt) == ("Leased", 0)
    await prov.settle([Settlement(d, Complete())])
    assert not d.refused
    await rt.close()


async def test_the_sweeper_and_retention_timers(tmp_path):
    from queueing_core.providers.sql import RetentionPolicy

    app, host, fns, _seen = sql_app(tmp_path)
    rt = await host.runtime()
    prov = rt.provider
    prov.retention = RetentionPolicy(archive_after=timedelta(0), delete_archived_after=None)
    r = await app.enqueue(Timed(n=1))
    [_d] = await prov.receive(app.subscription("Timed"), 1)  # a worker took it, then vanished
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(sa.update(m).values(locked_until=prov.clock() - timedelta(seconds=5)))
    await user(fns["queueing_lease_sweeper"])(TimerRequest(past_due=True))
    rec = await rt.tracker.get(r.message_id)
    assert rec.status == "Failed"
    assert rec.attempt == 1
    assert rec.last_error.startswith("lease expired")
    await user(fns["queueing_sql_processor"])(TimerRequest())
    assert (await rt.tracker.get(r.message_id)).status == "Succeeded"
    await user(fns["queueing_retention"])(TimerRequest())
    assert (await rt.tracker.get(r.message_id)).archived is True
    await rt.close()


def request(
    method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> func.HttpRequest:
    return func.HttpRequest(
        method, f"http://localhost{path}", headers=headers or {}, params={}, route_params={}, body=body
    )


async def test_the_http_function_serves_the_ops_api_behind_the_key(tmp_path):
    _app, host, fns, _seen = sql_app(tmp_path, api_key="fn-key")
    http = user(fns["http_app_func"])
    base = "/api/_system/queueing"
    ctx = Context()
    for path in (f"{base}/stats", f"{base}/subscriptions", f"{base}/messages", f"{base}/health"):
        unauthorized = await http(request("GET", path), ctx)
        assert unauthorized.status_code == 401, path
        assert unauthorized.headers["content-type"] == "application/problem+json"
        wrong = await http(request("GET", path, {"X-API-Key": "nope"}), ctx)
        assert wrong.status_code == 401
        ok = await http(request("GET", path, {"X-API-Key": "fn-key"}), ctx)
        assert ok.status_code == 200, (path, ok.get_body())
    created = await http(
        request(
            "POST",
            f"{base}/queues/timed/messages",
            {"Authorization": "Bearer fn-key", "Content-Type": "application/json"},
            json.dumps({"n": 7}).encode(),
        ),
        ctx,
    )
    assert created.status_code == 201
    [enqueued] = json.loads(created.get_body())["enqueued"]
    detail = await http(
        request("GET", f"{base}/messages/{enqueued['message_id']}", {"X-API-Key": "fn-key"}), ctx
    )
    assert json.loads(detail.get_body())["status"] == "Pending"
    missing = await http(request("GET", f"{base}/nothing-here", {"X-API-Key": "fn-key"}), ctx)
    assert missing.status_code == 404
    await (await host.runtime()).close()


async def test_without_a_configured_key_the_http_function_refuses_everything(tmp_path):
    _app, _host, fns, _seen = sql_app(tmp_path)  # no QUEUEING_API_KEY: no anonymous access in Functions
    http = user(fns["http_app_func"])
    r = await http(request("GET", "/api/_system/queueing/stats", {"X-API-Key": "anything"}), Context())
    assert r.status_code == 401
    assert "QUEUEING_API_KEY" in json.loads(r.get_body())["detail"]


async def test_an_unresolved_key_vault_reference_is_no_key(tmp_path, caplog):
    """When the platform cannot read the secret it passes the reference text as the setting's value:
    that text must not open the ops API."""
    reference = "@Microsoft.KeyVault(SecretUri=https://kv-queueing.vault.azure.net/secrets/queueing-api-key)"
    _app, host, fns, _seen = sql_app(tmp_path, api_key=reference)
    http = user(fns["http_app_func"])
    with caplog.at_level(logging.ERROR, logger="queueing.functions"):
        r = await http(request("GET", "/api/_system/queueing/stats", {"X-API-Key": reference}), Context())
    assert r.status_code == 401
    assert any("Key Vault Secrets User" in rec.getMessage() for rec in caplog.records)
    await host.close()


async def test_the_schedules_timer_fires_due_ticks_once_and_only_apps_with_schedules_get_it(tmp_path):
    _app, _host, fns, _seen = sql_app(tmp_path)
    assert "queueing_schedules" not in fns
    scheduled = QueueingApp("fn-scheduled")
    scheduled.every(timedelta(seconds=1), Timed(n=7), name="every-second")
    cfg = QueueingSettings(
        provider="sql", database_url=f"sqlite:///{tmp_path}/sched.db", functions_local_sqlite=True
    )
    host = FunctionsHost(scheduled, cfg)
    fns = functions_of(build_app(cfg, scheduled, host=host, env={}))
    timer = next(b for b in bindings(fns["queueing_schedules"]) if b["type"] == "timerTrigger")
    assert timer["schedule"] == cfg.functions_schedules_schedule
    await user(fns["queueing_schedules"])(TimerRequest(past_due=False))
    rt = await host.runtime()
    assert await rt.tracker.counts() == {("timed", "Pending"): 1}
    await user(fns["queueing_schedules"])(TimerRequest(past_due=False))  # same second, or the next
    assert sum((await rt.tracker.counts()).values()) <= 2
    # the retention timer forgets ticks older than a week, keeping each schedule's newest
    store = rt.provider.schedule_store()
    newest = (await store.last_ticks(["every-second"]))["every-second"]
    old = newest - timedelta(days=8)
    assert await store.fire("every-second", old, [], None, old)
    await user(fns["queueing_retention"])(TimerRequest())
    t = rt.provider.tables.ticks
    async with rt.provider.engine.connect() as conn:
        left = (await conn.execute(sa.select(t.c.tick_at))).scalars().all()
    assert old.replace(tzinfo=None) not in [x.replace(tzinfo=None) for x in left]
    assert (await store.last_ticks(["every-second"]))["every-second"] == newest
    await rt.close()


def test_a_trigger_hands_the_invocations_trace_context_to_tracing():
    import contextvars
    from types import SimpleNamespace

    from functions import _continuing
    from queueing_core.context import host_trace

    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = SimpleNamespace(trace_context=SimpleNamespace(trace_parent=parent, trace_state="k=v"))

    def invoke(ctx):
        _continuing(ctx)
        return host_trace.get()

    assert contextvars.copy_context().run(invoke, context) == (parent, "k=v")
    assert contextvars.copy_context().run(invoke, None) is None  # called without a context (tests)
    assert host_trace.get() is None  # nothing leaks out of an invocation
