"""Storage Queues: a delayed-store row whose text is not an envelope goes to the poison queue
(test_storage_delayed_poison.py); the ops actions reach that letter by the history's message id
(here the text names another message id of its own, which must not mislead the locator), a retry
is refused cleanly, and a purge removes the letter and its history together. A failing poison send
keeps the row (never a loss)."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from queueing_core.errors import InvalidOperation, ProviderError
from queueing_core.naming import Transport
from queueing_core.ops import OpsService
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery

from .test_storage_queue import make_app


async def _setup(azurite, tmp_path):
    tag = uuid.uuid4().hex[:8]
    app, _seen = make_app(f"t{tag}-")
    p = StorageQueueProvider(
        StorageConnection(azurite.connection_string),
        control_table=f"ctl{tag}",
        tracker_table=f"hist{tag}",
        delayed_stores=SideStores(f"sqlite:///{tmp_path}/delayed.db"),
        delayed_retries=0,
    )
    rt = Runtime(app, p)
    await rt.open()
    return app, p, rt


async def _store_row(p, text: str, stored_id: uuid.UUID) -> None:
    now = datetime.now(UTC)
    async with p.delayed.sql.engine.begin() as conn:
        await conn.execute(
            p.delayed._t.insert(),
            [
                {
                    "id": uuid.uuid4(),
                    "message_id": stored_id,
                    "transport": Transport.STORAGE_QUEUE.value,
                    "destination": p.physical("Billing.Invoice_Ready"),
                    "due_at": now,
                    "envelope": text,
                    "failures": 0,
                    "created_at": now,
                }
            ],
        )


async def _letters(p) -> list[dict]:
    poison = await p._ensure(p.poison_name("Billing.Invoice_Ready"))
    out = []
    for m in [m async for m in poison.receive_messages(messages_per_page=32, visibility_timeout=1)]:
        out.append(json.loads(base64.b64decode(m.content)))
        await poison.update_message(m.id, m.pop_receipt, visibility_timeout=0)
    return out


async def test_the_ops_purge_finds_the_poison_letter_of_a_damaged_delayed_row(azurite, tmp_path):
    _app, p, rt = await _setup(azurite, tmp_path)
    try:
        stored_id, other_id = uuid.uuid4(), uuid.uuid4()
        text = json.dumps({"v": 1, "message_id": str(other_id), "type": "InvoiceReady"})
        await _store_row(p, text, stored_id)
        await p.dispatcher.dispatch_once()
        [letter] = await _letters(p)
        assert letter["message_id"] == str(stored_id)
        record = await rt.tracker.get(stored_id)
        assert record is not None
        assert record.status == "DeadLettered"
        ops = OpsService(rt)
        with pytest.raises(InvalidOperation):
            await ops.retry(stored_id)  # no body to send: refused, nothing moved
        assert len(await _letters(p)) == 1
        done = await ops.purge(MessageQuery(tracking_id=record.tracking_id))
        assert done.deleted == 1
        assert await _letters(p) == [], "the poison letter outlived its history"
        assert await rt.tracker.get(stored_id) is None
    finally:
        await rt.close()


async def test_a_failing_poison_send_keeps_the_damaged_row(azurite, tmp_path, monkeypatch):
    _app, p, rt = await _setup(azurite, tmp_path)
    try:
        stored_id = uuid.uuid4()
        await _store_row(p, "not json at all", stored_id)

        async def refuse(*a, **k):
            raise ProviderError("the poison queue refused the letter")

        real = p._ensure

        async def ensure(physical):
            c = await real(physical)
            if physical.endswith("-poison"):
                monkeypatch.setattr(c, "send_message", refuse)
            return c

        monkeypatch.setattr(p, "_ensure", ensure)
        await p.dispatcher.dispatch_once()
        async with p.delayed.sql.engine.connect() as conn:
            left = (await conn.execute(sa.select(p.delayed._t.c.message_id))).scalars().all()
        assert left == [stored_id], "the row left the store although no poison letter was written"
        assert await rt.tracker.get(stored_id) is None
    finally:
        await rt.close()
