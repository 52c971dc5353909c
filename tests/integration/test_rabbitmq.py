"""The RabbitMQ provider on the real broker beyond the contract suite: the dead-letter
queue and its reasons, publisher confirms, attempts a pause does not burn, bad bytes, idle consumers
handing work back, delays through the store, ops over HTTP, and a broker restart mid-run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import pytest

from queueing_core import (
    MessageStatus,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    QueueNaming,
    Retry,
    RetryPolicy,
    queue,
)
from queueing_core.envelope import DESCRIPTION, REASON
from queueing_core.errors import MessageTooLarge, ProviderError, ProviderUnavailable
from queueing_core.producer import build_envelope
from queueing_core.providers.rabbitmq import ATTEMPT, RabbitMQProvider
from queueing_core.providers.sql.history import SideStores, malformed_id
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from queueing_core.tracking import MessageQuery
from tests.contract.harness import all_have, ops_client, running, wait_until
from tests.services import POSTGRES_URL, RABBITMQ_URL, drop_schema, fresh_prefix, require


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


@queue("Billing.Invoice", max_attempts=3, retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0))
class Invoice(QueueMessage):
    n: int
    mode: str = "ok"  # ok | fatal | slow | later (asks for a retry in an hour while downstream says so)


#: the downstream's state: tests "fix" it to show a retried dead letter succeeding
downstream: dict[str, Any] = {"declines": True, "slow": 0.05, "later": True, "free_runs": None, "gate": None}


def make(tmp_path, *, concurrency: int = 4, stores: SideStores | None = None, **provider_kw):
    prefix = fresh_prefix()
    app = QueueingApp("rmq", naming=QueueNaming(prefix=prefix))
    calls: list[tuple[int, int]] = []
    downstream["declines"] = True
    downstream["later"] = True

    @app.handler(max_concurrency=concurrency)
    async def handle(msg: Invoice, ctx) -> None:
        calls.append((msg.n, ctx.attempt))
        run = len(calls)
        if msg.mode == "fatal" and downstream["declines"]:
            raise NonRetryableError(f"invoice {msg.n} declined")
        if msg.mode == "slow":
            await asyncio.sleep(downstream["slow"])
            # a test that needs work left holds the runs after the first ``free_runs`` until it opens
            # the gate
            if downstream["free_runs"] is not None and run > downstream["free_runs"]:
                await downstream["gate"].wait()
        if msg.mode == "later" and downstream["later"]:
            raise Retry(after=timedelta(hours=1))

    opts = {"idle_timeout": 0.5, "reconnect_interval": 0.5, **provider_kw}
    stores = stores or SideStores(f"sqlite:///{tmp_path}/{prefix}side.db")
    provider = RabbitMQProvider(RABBITMQ_URL, stores=stores, **opts)
    rt = Runtime(app, provider, pause_recheck=timedelta(milliseconds=200), control_ttl=0.05)
    return app, rt, calls


def physical(rt: Runtime) -> str:
    return rt.provider.physical("Billing.Invoice")


async def take_all(name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message in a queue, taken off it (a raw AMQP client, not the kit)."""
    out = []
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        q = await channel.declare_queue(name, passive=True)
        while (m := await q.get(no_ack=True, fail=False)) is not None:
            out.append(m)
    return out


async def test_the_dead_letter_exchange_routes_broker_expired_messages_to_the_dead_letter_queue(tmp_path):
    _app, rt, _ = make(tmp_path)
    await rt.open()
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(b"short-lived", expiration=0.001), routing_key=physical(rt)
        )
    await wait_until(lambda: _depth(rt, dead=True, n=1), what="the broker's dead letter")
    [m] = await take_all(f"{physical(rt)}.dead-letter")
    assert m.body == b"short-lived"
    assert m.headers["x-death"][0]["reason"] == "expired"
    await rt.close()


async def _depth(rt: Runtime, *, dead: bool = False, n: int) -> bool:
    return await rt.provider.depth(physical(rt), dead=dead) == n


async def test_dead_letters_are_published_to_the_dead_letter_queue_with_the_reason(tmp_path):
    app, rt, calls = make(tmp_path)
    r = await app.enqueue(Invoice(n=7, mode="fatal"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dl")
    [m] = await take_all(f"{physical(rt)}.dead-letter")
    assert m.message_id == str(r.message_id)
    assert m.headers[REASON] == "non-retryable"
    assert "invoice 7 declined" in m.headers[DESCRIPTION]
    doc = json.loads(m.body)
    assert doc["message_id"] == str(r.message_id)
    assert doc["attempt"] == 1
    assert doc["headers"][REASON] == "non-retryable"
    assert await rt.provider.depth(physical(rt)) == 0  # the original was acked
    assert calls == [(7, 1)]
    await rt.close()


@pytest.mark.parametrize("side", ["sqlite", "postgres"])
async def test_bytes_that_are_not_an_envelope_go_to_the_dead_letter_queue_as_they_came(tmp_path, side):
    """Published straight to the broker by another system, with U+0000 in it: PostgreSQL keeps no such
    text, and its history store refused the record on every try until the writer dropped it."""
    schema = None
    stores = None
    if side == "postgres":
        require("PostgreSQL", "127.0.0.1", 5432)
        schema = f"qr_{uuid.uuid4().hex[:10]}"
        stores = SideStores(POSTGRES_URL, schema=schema)
    app, rt, calls = make(tmp_path, stores=stores)
    await rt.open()
    raw = b"\x00\xffnot an envelope"
    # a well-formed envelope from the same system, U+0000 in its correlation id and a header
    envelope = json.loads(build_envelope(app, Invoice(n=2), datetime.now(UTC)).encode_text())
    envelope.update(correlation_id="order\u00001", headers={**envelope["headers"], "x-from": "\u0000"})
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        await channel.default_exchange.publish(aio_pika.Message(raw), routing_key=physical(rt))
        foreign = aio_pika.Message(json.dumps(envelope).encode())
        await channel.default_exchange.publish(foreign, routing_key=physical(rt))
    good = await app.enqueue(Invoice(n=1))
    foreign_id = uuid.UUID(envelope["message_id"])
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [good.message_id, foreign_id], MessageStatus.SUCCEEDED), what="both runs"
        )
        await wait_until(lambda: _depth(rt, dead=True, n=1), what="the malformed dead letter")
        await wait_until(
            lambda: rt.tracker.get(malformed_id(raw.decode("utf-8", "replace"))), what="its record"
        )
    kept = await rt.tracker.get(foreign_id)
    assert kept.correlation_id == "order\ufffd1"
    assert kept.headers["x-from"] == "\ufffd"
    [m] = await take_all(f"{physical(rt)}.dead-letter")
    assert m.body == raw  # byte for byte
    assert m.headers[REASON] == "malformed-envelope"
    text = raw.decode("utf-8", errors="replace")
    assert m.message_id == str(malformed_id(text))  # what the history calls it: ops can find it
    rec = await rt.tracker.get(malformed_id(text))
    assert rec is not None
    assert rec.status == MessageStatus.DEAD_LETTERED
    assert "not an envelope" in (rec.raw or "")
    assert sorted(calls) == [(1, 1), (2, 1)]
    await rt.close()
    if schema is not None:
        await drop_schema(schema)


async def test_every_enqueue_returns_only_once_the_broker_confirmed(tmp_path):
    app, rt, _ = make(tmp_path)
    await app.enqueue_and_wait(Invoice(n=1))
    await app.enqueue(Invoice(n=2))
    # confirmed means queued: visible to another channel at once
    assert await rt.provider.depth(physical(rt)) == 2
    await rt.close()

    # a queue that refuses every message: the broker nacks; only the confirmed enqueue can tell
    app2, rt2, _ = make(tmp_path, auto_declare=False)
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        await channel.declare_queue(
            physical(rt2), auto_delete=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
        )
        with pytest.raises(ProviderError, match="refused"):
            await app2.enqueue_and_wait(Invoice(n=2))
        # a plain enqueue too: it used to return without the confirm, and the refused message was
        # lost though its sender was told it was sent
        with pytest.raises(ProviderError, match="refused"):
            await app2.enqueue(Invoice(n=3))
        with pytest.raises(ProviderError, match="refused"):
            await app2.enqueue_many([Invoice(n=4)], wait=True)
    await rt2.close()


async def test_a_correlation_id_too_long_for_amqp_goes_in_the_envelope_and_the_batch_is_sent_whole(tmp_path):
    """AMQP's correlation-id property holds 255 bytes; an envelope's correlation id may be 256
    characters (up to 1,024 bytes). Before, aio-pika refused such a message with a raw TypeError after
    the batch's earlier messages had gone, so every retry of the batch duplicated them and the batch
    never went. The property is left out when it does not fit; the envelope carries the id whole."""
    app, rt, _ = make(tmp_path)
    long_id = "é" * 200  # 200 characters, 400 bytes
    receipts = await app.enqueue_many([Invoice(n=1), Invoice(n=2, correlation_id=long_id)])
    fits = await app.enqueue(Invoice(n=3, correlation_id="c" * 255))
    got = {json.loads(m.body)["message_id"]: m for m in await take_all(physical(rt))}
    assert set(got) == {str(r.message_id) for r in [*receipts, fits]}
    long_one = got[str(receipts[1].message_id)]
    assert long_one.correlation_id is None
    assert json.loads(long_one.body)["correlation_id"] == long_id
    assert got[str(fits.message_id)].correlation_id == "c" * 255
    await rt.close()


async def test_a_pause_sends_the_message_back_without_using_an_attempt(tmp_path):
    app, rt, calls = make(tmp_path)
    sub = app.subscription("Invoice")
    r = await app.enqueue(Invoice(n=5))
    await rt.control.set_paused("type", "Invoice", True)
    # a message already received when the pause is seen (the worker's own check came first)
    deliveries = []
    while not deliveries:
        await rt.provider.wait_for_work(sub, 1.0)
        deliveries = await rt.provider.receive(sub, 1)
    settlement = await rt.process_and_settle(deliveries[0])
    assert settlement.decision.status == MessageStatus.PAUSED
    [copy] = await rt.provider.delayed.fetch_due(settlement.decision.until, limit=5)
    assert json.loads(copy.envelope)["attempt"] == 0  # the copy carries no used attempt
    await rt.provider.delayed.release(copy.id, settlement.decision.until)
    assert (await rt.tracker.get(r.message_id)).attempt == 0
    await rt.control.set_paused("type", "Invoice", False)
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="after resume")
    assert calls == [(5, 1)]
    assert (await rt.tracker.get(r.message_id)).attempt == 1
    await rt.close()


async def test_an_idle_consumer_hands_its_buffered_messages_back(tmp_path):
    app, rt_a, _ = make(tmp_path)
    receipts = await app.enqueue_many([Invoice(n=i) for i in range(3)], wait=True)
    sub = app.subscription("Invoice")
    await rt_a.provider.receive(sub, 0)  # a consumer starts; the broker pushes into its buffer
    await wait_until(lambda: len(rt_a.provider._consumers[physical(rt_a)].buffer) == 3, what="prefetch")
    # another host takes the work once the first stops asking for it (idle_timeout: 0.5 s)
    app_b, rt_b, calls_b = make(tmp_path, stores=SideStores(rt_a.provider.stores.sql.url))
    app_b.naming = app.naming
    async with running(rt_b):
        await wait_until(
            lambda: all_have(rt_a, [r.message_id for r in receipts], MessageStatus.SUCCEEDED),
            what="handed back",
        )
    assert sorted(calls_b) == [(0, 1), (1, 1), (2, 1)]  # no attempt used by the detour
    assert not rt_a.provider._consumers[physical(rt_a)].buffer
    await rt_b.close()
    await rt_a.close()


async def test_a_delay_waits_in_the_delayed_store_then_arrives(tmp_path):
    app, rt, calls = make(tmp_path)
    # open first: a lazy open inside enqueue (broker connection, store migration) can outlast the
    # delay on a loaded machine, and the message would then be due before it was ever stored
    await rt.open()
    sent_at = rt.provider.clock()
    r = await app.enqueue(Invoice(n=9), delay=timedelta(milliseconds=600))
    assert r.not_before - sent_at >= timedelta(milliseconds=600)
    assert await rt.provider.delayed.counts() == {physical(rt): 1}
    assert await rt.provider.depth(physical(rt)) == 0  # RabbitMQ holds no delays: not in the queue yet
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="delayed one")
    rec = await rt.tracker.get(r.message_id)
    assert rec.updated_at - r.not_before >= timedelta(0)
    assert await rt.provider.delayed.counts() == {}
    assert calls == [(9, 1)]
    await rt.close()


async def test_a_message_that_lives_longer_than_the_brokers_longest_ttl_is_sent_and_runs(tmp_path):
    """An expiry further off than the broker's longest per-message TTL (ten years, RabbitMQ 3.10):
    the broker refused the publish (PRECONDITION_FAILED, closing the channel every publish shares),
    so the enqueue failed, and a delayed one was dead-lettered unrun after its forwards were refused
    (found in review). Capped at that TTL, both are sent; the kit's own expiry still applies."""
    app, rt, calls = make(tmp_path)
    await rt.open()
    far = timedelta(days=3651)
    now_one = await app.enqueue(Invoice(n=1), ttl=far)
    later_one = await app.enqueue(Invoice(n=2), ttl=far, delay=timedelta(milliseconds=300))
    async with running(rt):
        done = [now_one.message_id, later_one.message_id]
        await wait_until(lambda: all_have(rt, done, MessageStatus.SUCCEEDED), what="both ran")
    assert sorted(calls) == [(1, 1), (2, 1)]
    await rt.close()


async def test_a_message_over_rabbitmq_4s_default_size_is_refused_before_it_is_sent(tmp_path):
    """RabbitMQ 4 refuses a message over 16 MiB by default (3.x: 128 MiB, the kit's limit before):
    refused at enqueue, with room left for what a dead letter adds, nothing sent; a provider told
    of a broker configured for more sends it."""
    app, rt, _ = make(tmp_path)
    await rt.open()
    try:
        big = Invoice(n=1, mode="x" * (16 * 1024 * 1024 - 32 * 1024))  # under 16 MiB, over the room
        with pytest.raises(MessageTooLarge):
            await app.enqueue(big)
        assert await rt.provider.depth(physical(rt)) == 0
    finally:
        await rt.close()
    app, rt, _ = make(tmp_path, max_message_bytes=32 * 1024 * 1024)  # (this broker's is 128 MiB)
    await rt.open()
    try:
        await app.enqueue(big)
        assert await rt.provider.depth(physical(rt)) == 1
    finally:
        await rt.close()  # (the session's clean-up deletes its queues)


async def test_ops_retry_from_the_dead_letter_queue_and_purge_over_http(tmp_path):
    app, rt, _calls = make(tmp_path)
    await rt.open()
    async with ops_client(rt) as client:
        bad = await app.enqueue(Invoice(n=1, mode="fatal"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad.message_id], MessageStatus.DEAD_LETTERED), what="dl")
        [q] = (await client.get("/stats")).json()["queues"]
        assert q["transport_counts"] == {"ready": 0, "dead_lettered": 1, "delayed": 0}
        assert q["counts"] == {"DeadLettered": 1}

        downstream["declines"] = False
        assert (await client.post(f"/messages/{bad.message_id}/retry")).status_code == 200
        assert await rt.provider.depth(physical(rt), dead=True) == 0  # taken out of the DLQ
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad.message_id], MessageStatus.SUCCEEDED), what="retried")
        assert (await rt.tracker.get(bad.message_id)).attempt == 1  # fresh attempts

        downstream["declines"] = True
        bad2 = await app.enqueue(Invoice(n=2, mode="fatal"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad2.message_id], MessageStatus.DEAD_LETTERED), what="dl2")
        assert (await client.post(f"/messages/{bad2.message_id}/lease/release")).status_code == 409
        purged = (await client.request("DELETE", "/messages", params={"status": "DeadLettered"})).json()
        assert purged["deleted"] == 1
        assert await rt.provider.depth(physical(rt), dead=True) == 0
        assert (await client.get(f"/messages/{bad2.message_id}")).status_code == 404
        assert (await client.get(f"/messages/{bad.message_id}")).status_code == 200  # not a dead letter

        # a whole queue: the queue itself is emptied, and what waits in the delayed store
        await app.enqueue_many([Invoice(n=i) for i in range(3)], wait=True)
        await app.enqueue(Invoice(n=99), delay=timedelta(hours=1))
        # (the stopped worker's consumer may hold them a moment before it hands them back)
        await wait_until(lambda: _depth(rt, n=3), what="three ready messages")
        purged = (
            await client.request("DELETE", "/messages", params={"queue": "Billing.Invoice", "all": "true"})
        ).json()
        assert purged["deleted"] == 5  # three queued, one delayed, the succeeded one
        assert await rt.provider.depth(physical(rt)) == 0
        assert await rt.provider.delayed.counts() == {}
        assert (await rt.tracker.query(MessageQuery(queue="Billing.Invoice"))).items == []
    await rt.close()


async def test_ops_retry_runs_a_message_waiting_in_the_delayed_store_now(tmp_path):
    app, rt, calls = make(tmp_path)
    await rt.open()
    async with ops_client(rt) as client:
        first, second = await app.enqueue_many([Invoice(n=7, mode="later"), Invoice(n=8, mode="later")])
        ids = [first.message_id, second.message_id]
        async with running(rt):
            await wait_until(lambda: all_have(rt, ids, MessageStatus.FAILED), what="backoff")
        assert await rt.provider.delayed.counts() == {physical(rt): 2}  # an hour away, in the store

        downstream["later"] = False
        assert (await client.post(f"/messages/{first.message_id}/retry")).status_code == 200
        assert await rt.provider.delayed.counts() == {physical(rt): 1}  # taken from the store, published
        async with running(rt):
            await wait_until(lambda: all_have(rt, ids[:1], MessageStatus.SUCCEEDED), what="run now")
        assert sorted(calls) == [(7, 1), (7, 1), (8, 1)]  # an operator's retry starts attempts afresh

        # the dispatcher has just taken the other one (it runs shortly): nothing left to bring forward
        assert await rt.provider.delayed.take_message(second.message_id)
        resp = await client.post(f"/messages/{second.message_id}/retry")
        assert resp.status_code == 409
        assert "cannot be brought forward" in resp.json()["detail"]
    await rt.close()


async def test_a_broker_that_is_down_at_start_is_retried_with_one_line_per_try(tmp_path, caplog):
    stores = SideStores(f"sqlite:///{tmp_path}/down.db")
    provider = RabbitMQProvider("amqp://guest:guest@127.0.0.1:1/", stores=stores, connect_retries=2)
    with caplog.at_level(logging.WARNING, logger="queueing.rabbitmq"), pytest.raises(ProviderUnavailable):
        await provider.open(QueueingApp("down"))
    lines = [r.getMessage() for r in caplog.records if r.name == "queueing.rabbitmq"]
    assert len(lines) == 2
    assert "unreachable" in lines[0]
    assert "retry 1/2" in lines[0]
    assert "guest:guest" not in " ".join(lines)  # the password is not logged
    assert all(r.exc_info is None for r in caplog.records)
    await provider.close()


async def test_from_settings(tmp_path):
    settings = QueueingSettings(
        provider="rabbitmq",
        rabbitmq_url=RABBITMQ_URL,
        database_url=f"sqlite:///{tmp_path}/settings.db",
        delayed_store_retries=5,
        prefetch=2,
        rabbitmq_max_message_bytes=64 * 1024 * 1024,
    )
    provider = RabbitMQProvider.from_settings(settings)
    assert provider.dispatcher.retries == 5
    assert provider.prefetch == 2
    assert provider.capabilities.max_message_bytes == 64 * 1024 * 1024
    app, _rt, _ = make(tmp_path)
    rt = Runtime(app, provider)
    r = await app.enqueue_and_wait(Invoice(n=1))
    assert await provider.depth(physical(rt)) == 1
    assert (await rt.tracker.get(r.message_id)).status == MessageStatus.PENDING
    await rt.close()


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.mark.slow
@pytest.mark.disruptive
async def test_a_broker_restart_mid_run_loses_nothing(tmp_path, caplog):
    if shutil.which("rabbitmqctl") is None or os.geteuid() != 0:
        pytest.skip("needs rabbitmqctl as root to stop and start the broker")
    app, rt, calls = make(tmp_path, concurrency=2)
    downstream["slow"] = 0.1
    # at most 10 of the 40 finish before the gate opens: the stop lands mid-run however slowly
    # rabbitmqctl stops the broker on a loaded machine
    gate = asyncio.Event()
    downstream["free_runs"], downstream["gate"] = 10, gate
    receipts = await app.enqueue_many([Invoice(n=i, mode="slow") for i in range(40)], wait=True)
    ids = [r.message_id for r in receipts]

    async def done() -> int:
        page = await rt.tracker.query(MessageQuery(status=(MessageStatus.SUCCEEDED.value,)), limit=100)
        return len(page.items)

    try:
        with caplog.at_level(logging.WARNING, logger="queueing.rabbitmq"):
            async with running(rt):
                await wait_until(lambda: _at_least(done, 4), what="some work done")
                await asyncio.to_thread(_rabbitmqctl, "stop_app")
                assert await done() < len(ids)  # stopped mid-run
                gate.set()  # the held runs finish while the broker is down (their acks go nowhere)
                await asyncio.sleep(1.0)
                await asyncio.to_thread(_rabbitmqctl, "start_app")
                await wait_until(lambda: all_have(rt, ids, MessageStatus.SUCCEEDED), timeout=60, what="all")
    finally:
        await asyncio.to_thread(_rabbitmqctl, "start_app")  # idempotent: never leave the broker down
        gate.set()
        downstream["slow"], downstream["free_runs"], downstream["gate"] = 0.05, None, None
    assert {n for n, _ in calls} == set(range(40))
    messages = [r.getMessage() for r in caplog.records if r.name == "queueing.rabbitmq"]
    assert sum("lost the connection to RabbitMQ" in m for m in messages) == 1
    assert any("reconnect attempt 1 failed" in m for m in messages)  # one line per failed attempt
    assert any("reconnected to RabbitMQ" in m for m in messages)
    # aio-pika's and aiormq's own lines (several per attempt, with tracebacks) are demoted
    assert not [r for r in caplog.records if r.name.startswith(("aiormq", "aio_pika")) and r.levelno >= 30]
    assert await rt.provider.depth(physical(rt)) == 0
    await rt.close()


async def _at_least(count, n: int) -> bool:
    return await count() >= n


def test_copies_carry_the_attempt_header():
    """The envelope's attempts travel in ``x-attempt`` too, for other consumers of the queue."""
    from queueing_core.clock import utcnow
    from queueing_core.envelope import Envelope

    provider = RabbitMQProvider(RABBITMQ_URL, stores=SideStores("sqlite:///:memory:"))
    env = Envelope(
        type="Invoice",
        queue="Billing.Invoice",
        message_id=uuid.uuid4(),
        tracking_id=uuid.uuid4(),
        attempt=2,
        created_at=utcnow(),
        expires_at=utcnow() + timedelta(minutes=5),
        body={"n": 1},
    )
    m = provider._message(env, utcnow())
    assert m.headers[ATTEMPT] == 2
    assert m.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    # no AMQP expiration: the kit records expiry itself (a broker time to live moved a paused type's
    # message unread, without the kit's reason: see test_rabbitmq_consumer_limits)
    assert m.properties.expiration is None
