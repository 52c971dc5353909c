"""Times a handler or a producer hands the kit that crashed a Functions host's settlement, on each
trigger (Service Bus on the in-memory broker, Storage Queues on Azurite, SQL's processor timer on
SQLite), found in review:

- a handler that returns a naive "run again at" (naive is UTC everywhere in the kit): the settlement
  compared it with an aware time and raised after the handler had succeeded, so the handler ran again
  on every delivery until the message was dead-lettered for attempts it never failed;
- an envelope whose ``created_at`` is so late that adding its queue's expiration passes the year 9999
  (the producer refuses it; another producer may send it): the pipeline raised OverflowError on every
  delivery, unrecorded; a worker handed it back for ever. It is dead-lettered as malformed, with its
  reason, and never run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import azure.functions.queue as azq
import pytest
from azure.functions.timer import TimerRequest
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue
from azure.storage.queue.aio import QueueClient

from functions import build_app
from functions.host import FunctionsHost
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.envelope import Envelope
from queueing_core.providers.storage_queue import decode_body
from queueing_core.settings import QueueingSettings

from .conftest import functions_of, user
from .test_host_settlement_edges import LiveActions, invoke, served

FAR = "9999-12-31T23:00:00Z"  # valid, but + the default expiration (4 h) is past the year 9999
_KEPT: list[Any] = []  # see test_timers_and_http


@queue("pt-naive", max_attempts=3)
class Recurring(QueueMessage):
    n: int = 0


@queue("pt-far", max_attempts=3)
class Far(QueueMessage):
    n: int = 0


def far_text(queue_name: str, type_name: str) -> tuple[uuid.UUID, str]:
    mid = uuid.uuid4()
    doc = {
        "type": type_name,
        "queue": queue_name,
        "message_id": str(mid),
        "tracking_id": str(mid),
        "created_at": FAR,
        "body": {"n": 1},
    }
    return mid, json.dumps(doc)


def the_app(runs: list[int]) -> QueueingApp:
    app = QueueingApp("pt")

    @app.handler()
    async def recurring(msg: Recurring, ctx: Any) -> datetime:
        runs.append(ctx.attempt)
        return datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=1)  # naive, as UTC

    @app.handler()
    async def far(msg: Far, ctx: Any) -> None:
        runs.append(ctx.attempt)

    return app


# -- Service Bus --------------------------------------------------------------------------------------
async def test_servicebus_a_naive_run_again_time_is_settled_after_one_run() -> None:
    runs: list[int] = []
    app = the_app(runs)
    async with served(app) as host:
        sent = await app.enqueue(Recurring())
        async with host.rt.provider.client.get_queue_receiver("pt-naive") as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver)
            error = await invoke(user(host.fns["servicebus_pt_naive"]), actions)
        rec = await host.rt.tracker.get(sent.message_id)
        assert error is None, error
        assert actions.done == ["renew_message_lock", "complete"]  # a copy for an hour later, then done
        assert rec is not None
        assert rec.status == "Sleeping"
        assert runs == [1]
        props = await host.rt.provider.admin.get_queue_runtime_properties("pt-naive")
        assert (props.active_message_count, props.scheduled_message_count) == (0, 1)


async def test_servicebus_a_far_future_created_at_is_dead_lettered_unrun() -> None:
    runs: list[int] = []
    app = the_app(runs)
    async with served(app) as host:
        mid, text = far_text("pt-far", "Far")
        async with host.rt.provider.client.get_queue_sender("pt-far") as sender:
            await sender.send_messages(ServiceBusMessage(text))
        async with host.rt.provider.client.get_queue_receiver("pt-far") as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver)
            error = await invoke(user(host.fns["servicebus_pt_far"]), actions)
        assert error is None, error
        assert actions.done == ["deadletter"]
        async with host.rt.provider.client.get_queue_receiver(
            "pt-far", sub_queue=ServiceBusSubQueue.DEAD_LETTER
        ) as dlq:
            [letter] = await dlq.receive_messages(max_message_count=5, max_wait_time=1)
        assert letter.dead_letter_reason == "MalformedEnvelope"
        assert "too late to add the queue's expiration" in (letter.dead_letter_error_description or "")
        rec = await host.rt.tracker.get(mid)
        assert rec is not None
        assert (rec.status, rec.reason) == ("DeadLettered", "malformed-envelope")
        assert runs == []


# -- Storage Queues -----------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def storage(azurite: Any, monkeypatch: pytest.MonkeyPatch, runs: list[int]) -> AsyncIterator[Any]:
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("QueueingStorage", azurite.connection_string)
    cfg = QueueingSettings(
        provider="storage_queue", queue_prefix=f"p{tag}-", control_table=f"c{tag}", tracker_table=f"h{tag}"
    )
    app = the_app(runs)
    host = FunctionsHost(app, cfg)
    fns = functions_of(build_app(cfg, app, host=host))
    rt = await host.runtime()
    try:
        yield app, rt, fns
    finally:
        await rt.close()


async def deliver_one(azurite: Any, name: str, fn: Any) -> None:
    """The host's part: receive, call the function with the text as it is (messageEncoding "none"),
    delete after a normal return (an exception would fail the test)."""
    async with QueueClient.from_connection_string(azurite.connection_string, name) as client:
        [m] = [m async for m in client.receive_messages(max_messages=1, visibility_timeout=30)]
        msg = azq.QueueMessage(
            id=m.id, body=m.content.encode(), dequeue_count=m.dequeue_count, pop_receipt=m.pop_receipt
        )
        await fn(msg)
        await client.delete_message(m.id, m.pop_receipt)


async def test_storage_a_naive_run_again_time_is_settled_after_one_run(
    azurite: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []
    async with storage(azurite, monkeypatch, runs) as (app, rt, fns):
        sent = await app.enqueue(Recurring())
        name = rt.provider.physical("pt-naive")
        await deliver_one(azurite, name, user(fns["queue_pt_naive"]))
        rec = await rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == "Sleeping"
        assert runs == [1]
        async with QueueClient.from_connection_string(azurite.connection_string, name) as client:
            props = await client.get_queue_properties()
            assert props.approximate_message_count == 1  # the copy, hidden for an hour
            assert [m async for m in client.receive_messages(max_messages=1)] == []


async def test_storage_a_far_future_created_at_is_dead_lettered_unrun(
    azurite: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []
    async with storage(azurite, monkeypatch, runs) as (_app, rt, fns):
        name = rt.provider.physical("pt-far")
        mid, text = far_text("pt-far", "Far")
        async with QueueClient.from_connection_string(azurite.connection_string, name) as client:
            await client.send_message(base64.b64encode(text.encode()).decode())
        await deliver_one(azurite, name, user(fns["queue_pt_far"]))
        async with QueueClient.from_connection_string(azurite.connection_string, f"{name}-poison") as poison:
            [letter] = [
                json.loads(decode_body(p.content)) async for p in poison.receive_messages(max_messages=5)
            ]
        assert letter["message_id"] == str(mid)
        assert letter["headers"]["x-queueing-dead-letter-reason"] == "malformed-envelope"
        rec = await rt.tracker.get(mid)
        assert rec is not None
        assert (rec.status, rec.reason) == ("DeadLettered", "malformed-envelope")
        assert runs == []


# -- SQL, the processor timer (a worker's drain) --------------------------------------------------------
async def test_sql_processor_a_far_future_created_at_is_dead_lettered_not_handed_back(tmp_path: Any) -> None:
    """In a worker the pipeline's OverflowError became a Release: handed back, no attempt counted, and
    claimed again on every run, for ever."""
    runs: list[int] = []
    app = the_app(runs)
    cfg = QueueingSettings(
        provider="sql",
        database_url=f"sqlite:///{tmp_path}/fn.db",
        functions_local_sqlite=True,
        functions_processor_budget=20,
    )
    host = FunctionsHost(app, cfg)
    _KEPT.append(build_app(cfg, app, host=host, env={}))
    fns = functions_of(_KEPT[-1])
    rt = await host.runtime()
    try:
        mid, text = far_text("pt-far", "Far")
        await rt.provider.send([Envelope.decode(text)])  # (the producer refuses it: another's)
        await user(fns["queueing_sql_processor"])(TimerRequest(past_due=False))
        rec = await rt.tracker.get(mid)
        assert rec is not None
        assert (rec.status, rec.reason) == ("DeadLettered", "malformed-envelope"), (
            rec.status,
            rec.last_error,
        )
        assert runs == []
    finally:
        await rt.close()
