"""RabbitMQ: a delayed-store row whose text is not an envelope (damaged, or written by another kit
version) goes straight to the dead-letter queue as it was stored, with the reason
``malformed-envelope``, under the row's own message id, and its history says so under that id, as on
SQS and Storage Queues (test_storage_delayed_poison.py). Its forward published the raw text to the
live queue, where the worker dead-lettered it under an id taken from the text: the row's message stayed
Sleeping for good, and a text naming another message's id overwrote that message's history. And its
dead letter after failed forwards decoded the text first, so it failed on every try."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus
from queueing_core.envelope import DESCRIPTION, REASON
from queueing_core.errors import ProviderError
from queueing_core.runtime import Runtime
from tests.services import require

from .test_rabbitmq import Invoice, make, physical, take_all


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


async def _damage(rt: Runtime, message_id: uuid.UUID, text: str) -> None:
    """The stored row of ``message_id`` now holds ``text``, and is due."""
    store = rt.provider.delayed
    async with store.sql.engine.begin() as conn:
        await conn.execute(
            sa.update(store._t)
            .where(store._t.c.message_id == message_id)
            .values(envelope=text, due_at=datetime.now(UTC))
        )


async def _rows(rt: Runtime) -> list[uuid.UUID]:
    store = rt.provider.delayed
    async with store.sql.engine.connect() as conn:
        return list((await conn.execute(sa.select(store._t.c.message_id))).scalars().all())


async def test_a_damaged_delayed_row_is_dead_lettered_under_its_own_id(tmp_path):
    app, rt, _calls = make(tmp_path)
    await rt.open()
    try:
        damaged = await app.enqueue(Invoice(n=1), delay=timedelta(hours=1))
        other = await app.enqueue(Invoice(n=2), delay=timedelta(hours=1))
        # the damaged text names the other message: it must not mislead the letter or the history
        text = json.dumps({"v": 1, "message_id": str(other.message_id), "type": "Invoice"})
        await _damage(rt, damaged.message_id, text)
        await rt.provider.dispatcher.dispatch_once()  # (no worker runs: only this dispatch moves it)
        assert await _rows(rt) == [other.message_id]
        assert await take_all(physical(rt)) == [], "the damaged text went to the live queue"
        [letter] = await take_all(f"{physical(rt)}.dead-letter")
        assert letter.body == text.encode()  # as it was stored
        assert letter.message_id == str(damaged.message_id)  # what ops find it by: the history's id
        assert letter.headers[REASON] == "malformed-envelope"
        assert "not an envelope" in letter.headers[DESCRIPTION]
        record = await rt.tracker.get(damaged.message_id)
        assert record is not None
        assert (record.status, record.reason, record.raw) == ("DeadLettered", "malformed-envelope", text)
        assert record.queue == "Billing.Invoice"
        untouched = await rt.tracker.get(other.message_id)
        assert untouched is not None
        assert untouched.status == MessageStatus.SLEEPING
    finally:
        await rt.close()


async def test_the_dead_letter_after_failed_forwards_takes_a_damaged_row(tmp_path):
    app, rt, _calls = make(tmp_path)
    await rt.open()
    try:
        receipt = await app.enqueue(Invoice(n=1), delay=timedelta(hours=1))
        await _damage(rt, receipt.message_id, "not json at all")
        [item] = await rt.provider.delayed.fetch_due(datetime.now(UTC), limit=5)
        await rt.provider.dead_letter_delayed(item, "forwards kept failing")
        [letter] = await take_all(f"{physical(rt)}.dead-letter")
        assert letter.body == b"not json at all"
        assert letter.message_id == str(receipt.message_id)
        assert (letter.headers[REASON], letter.headers[DESCRIPTION]) == (
            "malformed-envelope",
            "forwards kept failing",
        )
        record = await rt.tracker.get(receipt.message_id)
        assert record is not None
        assert (record.status, record.raw) == ("DeadLettered", "not json at all")
    finally:
        await rt.close()


async def test_a_refused_dead_letter_keeps_the_damaged_row(tmp_path, monkeypatch):
    app, rt, _calls = make(tmp_path)
    await rt.open()
    try:
        receipt = await app.enqueue(Invoice(n=1), delay=timedelta(hours=1))
        await _damage(rt, receipt.message_id, "not json at all")
        publish = rt.provider._publish

        async def refuse_letters(target, message, *, dead=False):
            if dead:
                raise ProviderError("the broker refused the letter")
            await publish(target, message, dead=dead)

        monkeypatch.setattr(rt.provider, "_publish", refuse_letters)
        await rt.provider.dispatcher.dispatch_once()
        # never a loss: the row stays (due again) until its letter is confirmed
        assert await _rows(rt) == [receipt.message_id]
        assert await take_all(physical(rt)) == []
        assert await take_all(f"{physical(rt)}.dead-letter") == []
        record = await rt.tracker.get(receipt.message_id)
        assert record is not None
        assert record.status == MessageStatus.SLEEPING
    finally:
        await rt.close()
