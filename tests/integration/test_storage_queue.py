"""The Storage Queues provider on Azurite beyond the contract suite:
wire compatibility, bad input, ops through the Tables tracker, shared state, outages."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from azure.storage.queue import TextBase64DecodePolicy, TextBase64EncodePolicy
from azure.storage.queue.aio import QueueClient

from queueing_core import Event, MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import DESCRIPTION, REASON
from queueing_core.errors import ConfigurationError, ProviderUnavailable
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.storage_queue import (
    StorageConnection,
    StorageQueueProvider,
    decode_body,
)
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, ops_client, running, wait_until


@queue("Billing.Invoice_Ready", max_attempts=2)
class InvoiceReady(QueueMessage):
    invoice: str
    fail: bool = False


def make_app(prefix: str) -> tuple[QueueingApp, list[str]]:
    from queueing_core import QueueNaming

    app = QueueingApp("sq", naming=QueueNaming(prefix=prefix))
    seen: list[str] = []

    @app.handler()
    async def handle(msg: InvoiceReady) -> None:
        if msg.fail:
            raise NonRetryableError(f"invoice {msg.invoice} is void")
        seen.append(msg.invoice)

    return app, seen


@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:8]
    return {"prefix": f"t{tag}-", "control_table": f"ctl{tag}", "tracker_table": f"hist{tag}"}


def provider(azurite, names, delayed_db: Path | None = None) -> StorageQueueProvider:
    """The provider on Azurite; with ``delayed_db``, a SQLite delayed store in that file."""
    return StorageQueueProvider(
        StorageConnection(azurite.connection_string),
        control_table=names["control_table"],
        tracker_table=names["tracker_table"],
        delayed_stores=None if delayed_db is None else SideStores(f"sqlite:///{delayed_db}"),
    )


async def test_queue_names_are_sanitized_and_the_trigger_format_is_base64_json(azurite, names):
    app, _ = make_app(names["prefix"])
    rt = Runtime(app, provider(azurite, names))
    await rt.open()
    r = await app.enqueue(InvoiceReady(invoice="INV-1"))
    physical = rt.provider.physical("Billing.Invoice_Ready")
    assert physical == f"{names['prefix']}billing-invoice-ready"
    # what the Functions queue trigger receives: base64 text whose decoding is the envelope JSON
    sdk = QueueClient.from_connection_string(
        azurite.connection_string, physical, message_decode_policy=TextBase64DecodePolicy()
    )
    async with sdk:
        [msg] = await sdk.peek_messages(max_messages=5)
    doc = json.loads(msg.content)
    assert doc["message_id"] == str(r.message_id)
    assert doc["body"] == {"invoice": "INV-1", "fail": False}
    await rt.close()


async def test_a_plain_sdk_producer_with_base64_policy_is_read(azurite, names):
    app, seen = make_app(names["prefix"])
    rt = Runtime(app, provider(azurite, names))
    await rt.open()
    envelope = rt.producer.envelope_for(InvoiceReady(invoice="from-sdk"))
    sdk = QueueClient.from_connection_string(
        azurite.connection_string,
        rt.provider.physical(envelope.queue),
        message_encode_policy=TextBase64EncodePolicy(),
    )
    async with sdk:
        await sdk.send_message(envelope.encode_text())
    async with running(rt):
        await wait_until(lambda: seen == ["from-sdk"], what="the SDK producer's message")
    await rt.close()


async def test_bad_bodies_go_to_poison_with_reason_and_raw_text(azurite, names):
    app, seen = make_app(names["prefix"])
    rt = Runtime(app, provider(azurite, names))
    await rt.open()
    physical = rt.provider.physical("Billing.Invoice_Ready")
    raw_client = QueueClient.from_connection_string(azurite.connection_string, physical)
    async with raw_client:
        await raw_client.send_message("%%% not base64, not json %%%")
        await raw_client.send_message(base64.b64encode(b'{"hello": "not an envelope"}').decode())
    r = await app.enqueue(InvoiceReady(invoice="void", fail=True))
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dead letter"
        )
        await wait_until(lambda: _depth(rt, poison=True, at_least=3), what="three poison messages")
    poison = QueueClient.from_connection_string(azurite.connection_string, f"{physical}-poison")
    async with poison:
        texts = [decode_body(m.content) for m in await poison.peek_messages(max_messages=32)]
    docs = [json.loads(t) for t in texts]
    wrapped = [d for d in docs if "dead_letter" in d]
    assert {d["raw"] for d in wrapped} == {"%%% not base64, not json %%%", '{"hello": "not an envelope"}'}
    assert {d["dead_letter"]["reason"] for d in wrapped} == {"malformed-envelope"}
    [envelope] = [d for d in docs if "dead_letter" not in d]
    assert envelope["headers"][REASON] == "non-retryable"
    assert "is void" in envelope["headers"][DESCRIPTION]
    # history keeps the reason and the raw text too
    dead = (
        await rt.tracker.query(
            __import__("queueing_core.tracking", fromlist=["MessageQuery"]).MessageQuery(
                status=("DeadLettered",)
            )
        )
    ).items
    assert sum(1 for d in dead if d.raw and "not base64" in d.raw) == 1
    assert seen == []
    await rt.close()


async def _depth(rt, *, poison: bool, at_least: int) -> bool:
    return await rt.provider.depth("Billing.Invoice_Ready", poison=poison) >= at_least


async def test_an_early_delivery_is_rehidden_without_using_an_attempt(azurite, names):
    """A message that shows up before its time (e.g. a delay beyond the 7-day visibility limit, hidden
    for 7 days at a time) is deferred with a fresh copy: dequeue counts never reach the handler."""
    app, seen = make_app(names["prefix"])
    began: list[datetime] = []

    @app.hooks.on(Event.BEGAN)
    def stamp(obs) -> None:
        began.append(utcnow())

    rt = Runtime(app, provider(azurite, names), pause_recheck=timedelta(milliseconds=200))
    await rt.open()
    envelope = rt.producer.envelope_for(InvoiceReady(invoice="early"), delay=timedelta(seconds=3))
    c = await rt.provider._ensure(rt.provider.physical(envelope.queue))
    from queueing_core.providers.storage_queue import encode_body

    await c.send_message(encode_body(envelope.encode_text()))  # visible now, due in 3 s
    async with running(rt):
        await wait_until(lambda: seen == ["early"], timeout=30, what="handling when due")
    # delivered at once, it ran only once due: checked against its due time, not after a fixed sleep
    # that a slow start-up on a loaded machine could outlast
    assert envelope.not_before is not None
    assert began
    assert min(began) >= envelope.not_before, (began, envelope.not_before)
    rec = await rt.tracker.get(envelope.message_id)
    assert rec.status == "Succeeded"
    assert rec.attempt == 1
    await rt.close()


async def test_with_a_delayed_store_long_delays_wait_in_sql_and_the_worker_dispatches_them(
    azurite, names, tmp_path
):
    from queueing_core.clock import utcnow

    app, seen = make_app(names["prefix"])
    p = provider(azurite, names, tmp_path / "delayed.db")
    assert provider(azurite, names).background_tasks() == []  # no store, no dispatcher
    rt = Runtime(app, p)
    await rt.open()
    physical = p.physical("Billing.Invoice_Ready")
    assert p.delayed is not None
    # beyond the 7-day limit: a row in the store, nothing in the queue (the default 4-hour expiry would
    # refuse a message due after it)
    month = timedelta(days=30)
    far = await app.enqueue(InvoiceReady(invoice="far"), delay=timedelta(days=8), ttl=month)
    assert await p.delayed.counts() == {physical: 1}
    assert await p.depth("Billing.Invoice_Ready") == 0
    # within it: the queue's own visibility timeout
    await app.enqueue(InvoiceReady(invoice="near"), delay=timedelta(days=6), ttl=month)
    assert await p.depth("Billing.Invoice_Ready") == 1
    assert await p.delayed.counts() == {physical: 1}
    # a row already due is forwarded by the worker's dispatcher and handled
    due = rt.producer.envelope_for(InvoiceReady(invoice="due"))
    await p.delayed.store(due, physical, utcnow())
    async with running(rt):
        await wait_until(lambda: seen == ["due"], timeout=30, what="the dispatcher forwarding")
    assert await p.delayed.counts() == {physical: 1}  # "far" still waits
    assert (await rt.tracker.get(due.message_id)).status == "Succeeded"
    assert (await rt.tracker.get(far.message_id)).status != "Succeeded"
    await rt.close()


async def test_a_whole_queue_purge_empties_the_delayed_store_too(azurite, names, tmp_path):
    """A message delayed beyond the 7-day limit waits in the delayed store; a purge of its whole queue
    reported it deleted and let its history go, but left its row, so it ran when due, in no listing
    (a review found it; the other transports' purge already emptied their delayed store first)."""
    app, _ = make_app(names["prefix"])
    p = provider(azurite, names, tmp_path / "delayed.db")
    rt = Runtime(app, p)
    await rt.open()
    try:
        assert p.delayed is not None
        far = await app.enqueue(InvoiceReady(invoice="far"), delay=timedelta(days=8), ttl=timedelta(days=30))
        near = await app.enqueue(
            InvoiceReady(invoice="near"), delay=timedelta(days=1), ttl=timedelta(days=30)
        )
        assert await p.delayed.counts() == {p.physical("Billing.Invoice_Ready"): 1}
        async with ops_client(rt) as client:
            r = await client.request(
                "DELETE", "/messages", params={"queue": "Billing.Invoice_Ready", "all": "true"}
            )
        assert r.status_code == 200, r.text
        assert r.json()["deleted"] == 2
        assert await p.delayed.counts() == {}, "the purged message still waits in the delayed store"
        assert await p.depth("Billing.Invoice_Ready") == 0
        assert await rt.tracker.get(far.message_id) is None
        assert await rt.tracker.get(near.message_id) is None
    finally:
        await rt.close()


async def test_a_delayed_message_given_up_sends_one_dead_letter_while_its_history_write_fails(
    azurite, names, tmp_path
):
    """The dispatcher gives up on a delayed-store row: its dead letter goes to the poison queue, then
    its history to Tables. While Tables failed, every later try of the dispatcher sent another letter
    (a review found it: one an hour-ish per row for the outage). A try after a failed history write
    writes the history only."""
    from queueing_core.clock import utcnow
    from queueing_core.errors import ProviderUnavailable

    app, _ = make_app(names["prefix"])
    p = provider(azurite, names, tmp_path / "delayed.db")
    rt = Runtime(app, p)
    await rt.open()
    try:
        assert p.delayed is not None
        env = rt.producer.envelope_for(InvoiceReady(invoice="undeliverable"))
        await p.delayed.store(env, p.physical("Billing.Invoice_Ready"), utcnow())
        [item] = await p.delayed.fetch_due()
        tracker = p.tracker()
        real_upsert = tracker.upsert
        failures = [ProviderUnavailable("Tables: 503"), ProviderUnavailable("Tables: 503")]

        async def tables_down_twice(records):
            if failures:
                raise failures.pop(0)
            await real_upsert(records)

        tracker.upsert = tables_down_twice
        for _ in range(2):  # the dispatcher's tries while Tables is down
            with pytest.raises(ProviderUnavailable):
                await p.dead_letter_delayed(item, "3 forward(s) failed")
        await p.dead_letter_delayed(item, "3 forward(s) failed")  # Tables back
        assert await p.depth("Billing.Invoice_Ready", poison=True) == 1
        rec = await rt.tracker.get(env.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
    finally:
        await rt.close()


async def test_a_whole_queue_purge_says_it_removed_the_messages_workers_held(azurite, names):
    """Clearing a Storage queue removes the messages workers hold (hidden) too. The purge reported them
    left alone and kept their history, while they were gone and their holders' settlements refused (a
    review found it): they are counted deleted, and their history goes with the rest."""
    from queueing_core.decisions import Complete
    from queueing_core.ops.service import OpsService
    from queueing_core.tracking import MessageQuery
    from queueing_core.transport import Settlement

    app, _ = make_app(names["prefix"])
    p = provider(azurite, names)
    rt = Runtime(app, p)
    await rt.open()
    try:
        held = await app.enqueue(InvoiceReady(invoice="held"))
        [d] = await p.receive(app.subscription(InvoiceReady.type_name()), 1)
        rec = await rt.tracker.get(held.message_id)
        await rt.tracker.upsert([rec.model_copy(update={"status": MessageStatus.LEASED.value})])  # its run
        waiting = await app.enqueue(InvoiceReady(invoice="waiting"))
        done = await OpsService(rt).purge(MessageQuery(queue="Billing.Invoice_Ready"), whole=True)
        assert (done.deleted, done.skipped_leased) == (2, 0)
        assert await rt.tracker.get(held.message_id) is None
        assert await rt.tracker.get(waiting.message_id) is None
        s = Settlement(d, Complete())
        await p.settle([s])
        assert d.refused  # the holder's message is gone
    finally:
        await rt.close()


async def test_the_upkeep_keeps_the_history_of_a_poison_letter_past_the_retention(azurite, names):
    """The poison queue keeps a letter for good; the upkeep pruned its history after the retention
    (14 days), and the letter stayed in no listing (a review found it). A success's history goes."""
    from queueing_core.tracking import MessageRecord

    app, _ = make_app(names["prefix"])
    p = provider(azurite, names)
    rt = Runtime(app, p)
    await rt.open()
    try:
        old = datetime.now(UTC) - timedelta(days=30)
        records = [
            MessageRecord(
                message_id=uuid.uuid4(),
                tracking_id=uuid.uuid4(),
                type="InvoiceReady",
                queue="Billing.Invoice_Ready",
                status=status,
                attempt=1,
                created_at=old,
                updated_at=old,
                headers={},
                body={"invoice": status},
            )
            for status in ("DeadLettered", "Succeeded", "Expired")
        ]
        await rt.tracker.upsert(records)
        assert p.capabilities.dead_letters_kept == ("DeadLettered",)
        assert (await p.maintain(app))["history_pruned"] == 2
        assert await rt.tracker.get(records[0].message_id) is not None
        assert await rt.tracker.get(records[1].message_id) is None
        assert await rt.tracker.get(records[2].message_id) is None  # deleted when it expired, not kept
    finally:
        await rt.close()


async def test_pause_is_shared_by_every_instance_and_ops_work_through_the_tracker(azurite, names):
    app, seen = make_app(names["prefix"])
    rt1 = Runtime(app, provider(azurite, names), control_ttl=0.1)
    rt2 = Runtime(app, provider(azurite, names), control_ttl=0.1)  # another host / Functions instance
    await rt1.open()
    await rt2.open()
    async with ops_client(rt1) as client:
        assert (await client.post("/queues/Billing.Invoice_Ready/pause")).json()["paused"] is True
        good = await app.enqueue(InvoiceReady(invoice="held"))
        bad = await app.enqueue(InvoiceReady(invoice="void", fail=True))
        async with running(rt2):  # the OTHER instance must see the pause
            await asyncio.sleep(1.5)
            assert seen == []
            await client.post("/queues/Billing.Invoice_Ready/resume")
            await wait_until(lambda: all_have(rt1, [good.message_id], MessageStatus.SUCCEEDED), what="resume")
            await wait_until(lambda: all_have(rt1, [bad.message_id], MessageStatus.DEAD_LETTERED), what="dl")
        stats = (await client.get("/stats")).json()
        [q] = stats["queues"]
        assert q["counts"] == {"Succeeded": 1, "DeadLettered": 1}
        assert q["health"] == "Unhealthy"
        page = (await client.get("/messages", params={"status": "DeadLettered"})).json()
        assert [m["message_id"] for m in page["items"]] == [str(bad.message_id)]
        content = (await client.get(f"/messages/{bad.message_id}/content")).json()
        assert content["body"]["invoice"] == "void"
        release = await client.post(f"/messages/{bad.message_id}/lease/release")
        assert release.status_code == 409
        # retry from the poison queue: the copy there is removed, a fresh one goes to the queue
        assert await rt1.provider.depth("Billing.Invoice_Ready", poison=True) == 1
        r = await client.post(f"/messages/{bad.message_id}/retry")
        assert r.status_code == 200
        assert await rt1.provider.depth("Billing.Invoice_Ready", poison=True) == 0
        async with running(rt2):
            await wait_until(
                lambda: all_have(rt1, [bad.message_id], MessageStatus.DEAD_LETTERED), what="again"
            )
        assert (await rt1.tracker.get(bad.message_id)).attempt == 1  # fresh attempts after the retry
        assert (await client.post(f"/messages/{good.message_id}/archive")).status_code == 200
        purged = (await client.request("DELETE", "/messages", params={"status": "DeadLettered"})).json()
        assert purged["deleted"] == 1
        assert await rt1.provider.depth("Billing.Invoice_Ready", poison=True) == 0
        assert (await client.get(f"/messages/{bad.message_id}")).status_code == 404
    await rt1.close()
    await rt2.close()


async def test_history_survives_a_restart(azurite, names):
    app, _ = make_app(names["prefix"])
    rt = Runtime(app, provider(azurite, names))
    r = await app.enqueue(InvoiceReady(invoice="remember-me"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="success")
    await rt.close()
    fresh = Runtime(make_app(names["prefix"])[0], provider(azurite, names))  # a new process, say
    rec = await fresh.tracker.get(r.message_id)
    assert rec.status == "Succeeded"
    assert rec.body == {"invoice": "remember-me", "fail": False}
    await fresh.close()


def test_a_missing_connection_setting_is_one_line_naming_it():
    with pytest.raises(ConfigurationError) as info:
        StorageConnection.from_environment(env={})
    assert str(info.value).startswith("QueueingStorage: not set")
    conn = StorageConnection.from_environment(
        env={
            "QueueingStorage__queueServiceUri": "https://a.queue.core.windows.net",
            "QueueingStorage__tableServiceUri": "https://a.table.core.windows.net",
        }
    )
    assert conn.connection_string is None
    assert conn.queue_service_uri.startswith("https://a.queue")
    local = StorageConnection.from_environment(env={"QueueingStorage": "UseDevelopmentStorage=true"})
    assert "devstoreaccount1" in local.connection_string


async def test_an_unreachable_service_is_retried_with_a_clear_line_not_a_crash(names, caplog):
    dead = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=" + "A" * 88 + ";"
        "QueueEndpoint=http://127.0.0.1:1/devstoreaccount1;TableEndpoint=http://127.0.0.1:1/devstoreaccount1;"
    )
    app, _ = make_app(names["prefix"])
    rt = Runtime(
        app,
        StorageQueueProvider(
            StorageConnection(dead),
            auto_create=False,
            control_table=names["control_table"],
            tracker_table=names["tracker_table"],
        ),
    )
    with caplog.at_level(logging.WARNING, logger="queueing.worker"):
        async with running(rt, poll_min=0.05, poll_max=0.2) as worker:
            await wait_until(
                lambda: sum("retrying in" in r.getMessage() for r in caplog.records) >= 2, what="two retries"
            )
            assert worker.in_flight == 0
    lines = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert "unreachable" in lines[0]
    assert "Traceback" not in lines[0]
    await rt.close()


async def test_a_lease_counts_from_before_the_call_that_took_it(azurite, names, monkeypatch):
    """The visibility timeout starts while the receive (or the update that renews it) is on its way: a
    lease counted from the clock once the answer is here would be that call's time longer than the one
    the service keeps, and a process stalled that long would renew too late."""
    from queueing_core.providers import storage_queue

    now = [utcnow()]
    monkeypatch.setattr(storage_queue, "utcnow", lambda: now[0])
    app, _ = make_app(names["prefix"])
    rt = Runtime(app, provider(azurite, names))
    await rt.open()
    await app.enqueue(InvoiceReady(invoice="INV-9"))
    receive, hide = QueueClient.receive_messages, storage_queue.StorageQueueProvider._hide

    def slow_receive(self, *args, **kwargs):  # (the page arrives 7 s after it was asked for)
        pages = receive(self, *args, **kwargs)

        async def arriving():
            async for msg in pages:
                now[0] += timedelta(seconds=7)
                yield msg

        return arriving()

    async def slow_hide(self, h, delay):
        await hide(self, h, delay)
        now[0] += timedelta(seconds=7)

    monkeypatch.setattr(QueueClient, "receive_messages", slow_receive)
    monkeypatch.setattr(storage_queue.StorageQueueProvider, "_hide", slow_hide)
    sub = app.subscription("InvoiceReady")
    lease = sub.options.lease_duration
    sent = now[0]
    [d] = await rt.provider.receive(sub, 1)
    assert now[0] == sent + timedelta(seconds=7)
    assert d.lease_until == sent + lease
    sent = now[0]
    assert await rt.provider.renew([d]) == []
    assert now[0] == sent + timedelta(seconds=7)
    assert d.lease_until == sent + lease
    await rt.close()


async def test_a_message_sent_past_its_expiry_stays_long_enough_to_be_recorded_expired(azurite, names):
    """A copy sent when its expiry has passed (a forward from the delayed store, a retry) is kept (no
    storage time-to-live): a worker receives it and records it Expired. Kept one second, the service
    dropped it unseen and its history said Pending for ever (found in review)."""
    app, seen = make_app(names["prefix"])
    p = provider(azurite, names)
    rt = Runtime(app, p)
    await rt.open()
    try:
        now = datetime.now(UTC)
        env = app.producer.envelope_for(InvoiceReady(invoice="late"))
        env = env.model_copy(update={"expires_at": now - timedelta(hours=2)})  # long expired
        client = await p._ensure(p.physical("Billing.Invoice_Ready"))
        await p._put_physical(client, env, timedelta(0), now)
        [kept] = await client.peek_messages(max_messages=1)
        assert kept.expires_on is None or kept.expires_on.year == 9999, kept.expires_on
        await asyncio.sleep(1.5)  # what the service kept before
        async with running(rt):
            await wait_until(lambda: _status(rt, env.message_id, "Expired"), what="recorded Expired")
        assert seen == []
    finally:
        for q in (p.physical("Billing.Invoice_Ready"), p.poison_name("Billing.Invoice_Ready")):
            await p.client(q).delete_queue()
        await rt.close()


async def _status(rt: Runtime, message_id, status: str) -> bool:
    record = await rt.tracker.get(message_id)
    return record is not None and record.status == status


async def test_a_receive_whose_later_page_fails_hands_over_what_the_earlier_pages_brought(azurite, names):
    """Storage Queues hands messages over 32 a page, each hidden for the lease and its dequeue counted
    as it comes. When a later page fails (the service unreachable half-way), the messages of the
    earlier pages are returned to run now; raising lost them until their lease ran out, an attempt
    used unrun each (found in review)."""
    from azure.core.exceptions import ServiceRequestError

    app, seen = make_app(names["prefix"])
    p = provider(azurite, names)
    rt = Runtime(app, p)
    await rt.open()
    await app.enqueue_many([InvoiceReady(invoice=f"INV-{i}") for i in range(40)])
    sub = app.subscription("InvoiceReady")
    c = p.client(p.physical("Billing.Invoice_Ready"))
    real = c.receive_messages

    def breaks_after_a_page(**kwargs):
        async def pages():
            n = 0
            async for msg in real(**kwargs):
                if n == 32:
                    raise ServiceRequestError("connection reset on the second page")
                n += 1
                yield msg

        return pages()

    c.receive_messages = breaks_after_a_page  # type: ignore[method-assign]
    got = await p.receive(sub, 40)
    c.receive_messages = real  # type: ignore[method-assign]
    assert len(got) == 32
    assert {d.attempt for d in got} == {1}
    settlements = [await rt.process(d) for d in got]
    await p.settle(settlements)
    assert not any(d.refused for d in got)
    assert len(seen) == 32

    def fails_at_once(**kwargs):
        async def pages():
            raise ServiceRequestError("connection reset on the first page")
            yield  # (an async generator)

        return pages()

    c.receive_messages = fails_at_once  # type: ignore[method-assign]
    with pytest.raises(ProviderUnavailable):  # nothing brought: the failure is the caller's
        await p.receive(sub, 40)
    c.receive_messages = real  # type: ignore[method-assign]
    await rt.close()
