"""A handler running into the Functions host's ``functionTimeout`` is cut before it.

The host ends a timed-out invocation by restarting the Python worker process, and with it every
other invocation of the process: each of their messages had a delivery or dequeue counted, some had
sent their copy already (run again), and neighbours caught in repeated restarts were dead-lettered
unrun (found in review). The run is now cut a margin before the timeout, as at a time limit: a failed
attempt, settled within the invocation. Storage Queues over Azurite, called as the host calls it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from azure.storage.queue.aio import QueueClient

import functions
from functions import build_app
from functions.host import FunctionsHost, function_timeout_bound
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.settings import QueueingSettings

from .conftest import functions_of, storage_settings, user
from .test_queue_functions import deliver


@queue("fn-slow", max_attempts=3)
class Slow(QueueMessage):
    pass


async def test_a_run_nearing_the_function_timeout_is_cut_and_retried(azurite, monkeypatch) -> None:
    cfg = storage_settings(azurite, monkeypatch)
    app = QueueingApp("fn-timeout")

    @app.handler()
    async def slow(msg: Slow) -> None:
        await asyncio.sleep(120)

    # a functionTimeout of 8 s: the margin is a quarter of it, so the run is cut after 6 s
    host = FunctionsHost(app, cfg, run_bound=function_timeout_bound(8.0))
    fn = user(functions_of(build_app(cfg, app, host=host))["queue_fn_slow"])
    rt = await host.runtime()
    client = QueueClient.from_connection_string(azurite.connection_string, rt.provider.physical("fn-slow"))
    try:
        receipt = await app.enqueue(Slow())
        started = time.monotonic()
        await asyncio.wait_for(deliver(client, fn), 60)  # without the cut: the handler's two minutes
        assert time.monotonic() - started < 30
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == "Failed"
        assert rec.attempt == 1
        assert "functionTimeout (8 s)" in (rec.last_error or ""), rec.last_error
        assert (await client.get_queue_properties()).approximate_message_count == 1  # its retry copy
    finally:
        await client.close()
        await rt.close()


@pytest.mark.parametrize(
    ("timeout", "bound"),
    [("00:10:00", 540.0), ("00:01:00", 45.0), ("-1", None), (None, 1800.0 - 60)],
)
def test_the_app_bounds_its_runs_by_the_hosts_function_timeout(tmp_path, timeout, bound) -> None:
    """Read where the host reads it (host.json; without it, the plan's default: 30 minutes here)."""
    made: list[Any] = []

    class Recorded(FunctionsHost):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    host_json: dict[str, Any] = {"version": "2.0"}
    if timeout is not None:
        host_json["functionTimeout"] = timeout
    (tmp_path / "host.json").write_text(json.dumps(host_json))
    app = QueueingApp("fn-bound")
    app.message(Slow)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(functions, "FunctionsHost", Recorded)
        build_app(
            QueueingSettings(provider="storage_queue"),
            app,
            env={"AzureWebJobsScriptRoot": str(tmp_path), "QueueingStorage": "UseDevelopmentStorage=true"},
        )
    [host] = made
    got = host.run_bound.limit.total_seconds() if host.run_bound is not None else None
    assert got == bound
