"""Storage Queues: a delayed-store row whose text is not an envelope (damaged, or written by another
kit version) ends in the poison queue with its reason and its history, not due for ever. Its forward
and its dead letter both decoded the text first, so both failed, and the dispatcher counted a failure
and made the row due again at every round (SQS's side: test_sqs_retention_fence_poison.py)."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime

import sqlalchemy as sa

from .test_storage_delayed_poison_ops import _setup, _store_row


async def test_a_storage_delayed_row_that_is_not_an_envelope_is_dead_lettered(azurite, tmp_path):
    _app, p, rt = await _setup(azurite, tmp_path)  # dead-lettered at the first failed forward
    try:
        assert p.delayed is not None
        assert p.dispatcher is not None
        physical = p.physical("Billing.Invoice_Ready")
        text = '{"not": "an envelope"}'
        stored_id = uuid.uuid4()
        await _store_row(p, text, stored_id)
        for _ in range(3):  # three dispatcher rounds (the row is made due again each time)
            async with p.delayed.sql.engine.begin() as conn:
                await conn.execute(sa.update(p.delayed._t).values(due_at=datetime.now(UTC)))
            await p.dispatcher.dispatch_once()
        async with p.delayed.sql.engine.connect() as conn:
            left = (await conn.execute(sa.select(p.delayed._t.c.failures, p.delayed._t.c.last_error))).all()
        poison = await p._ensure(f"{physical}-poison")
        letters = [m async for m in poison.receive_messages(messages_per_page=32, visibility_timeout=1)]
        bodies = []
        for m in letters:
            try:
                bodies.append(json.loads(base64.b64decode(m.content)))
            except Exception:
                bodies.append(m.content)
        assert left == [], f"the row is still in the delayed store (failures, last error): {left}"
        assert len(letters) == 1, f"poison queue holds {bodies}"
        [letter] = bodies
        assert letter["raw"] == text
        assert letter["message_id"] == str(stored_id)  # the dead-letter locator's id: the history's
        assert letter["dead_letter"]["reason"] == "malformed-envelope"
        assert "not an envelope" in letter["dead_letter"]["description"]
        record = await rt.tracker.get(stored_id)
        assert record is not None
        assert (record.status, record.reason, record.raw) == ("DeadLettered", "malformed-envelope", text)
        assert record.queue == "Billing.Invoice_Ready"
    finally:
        await rt.close()
