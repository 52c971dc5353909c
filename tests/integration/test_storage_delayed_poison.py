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

from queueing_core.naming import Transport
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime

from .test_storage_queue import make_app


async def test_a_storage_delayed_row_that_is_not_an_envelope_is_dead_lettered(azurite, tmp_path):
    tag = uuid.uuid4().hex[:8]
    app, _seen = make_app(f"t{tag}-")
    p = StorageQueueProvider(
        StorageConnection(azurite.connection_string),
        control_table=f"ctl{tag}",
        tracker_table=f"hist{tag}",
        delayed_stores=SideStores(f"sqlite:///{tmp_path}/delayed.db"),
        delayed_retries=0,  # give up (dead-letter) at the first failed forward
    )
    rt = Runtime(app, p)
    await rt.open()
    try:
        assert p.delayed is not None
        assert p.dispatcher is not None
        physical = p.physical("Billing.Invoice_Ready")
        now = datetime.now(UTC)
        text = '{"not": "an envelope"}'
        stored_id = uuid.uuid4()
        async with p.delayed.sql.engine.begin() as conn:
            await conn.execute(
                p.delayed._t.insert(),
                [
                    {
                        "id": uuid.uuid4(),
                        "message_id": stored_id,
                        "transport": Transport.STORAGE_QUEUE.value,
                        "destination": physical,
                        "due_at": now,
                        "envelope": text,
                        "failures": 0,
                        "created_at": now,
                    }
                ],
            )
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
