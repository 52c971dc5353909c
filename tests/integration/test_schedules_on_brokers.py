"""A schedule on RabbitMQ: the tick is claimed in the side database, sent to the broker, then marked
sent; a second host finds it taken. (The claim and lapse rules are in test_schedule_stores.)"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from queueing_core.providers.sql.schedules import SENT, SqlTickStore
from queueing_core.scheduler import Scheduler, tick_store_for
from queueing_core.schedules import TICK_HEADER, tick_message_id

from .test_rabbitmq import Invoice, make, physical, take_all


async def test_a_tick_on_rabbitmq_is_sent_once_and_recorded_as_sent(tmp_path):
    app, rt, _calls = make(tmp_path)
    app.every(timedelta(seconds=1), Invoice(n=42), name="invoices")
    await rt.open()
    try:
        store = tick_store_for(rt)
        assert isinstance(store, SqlTickStore)
        assert not store.writes_messages  # claim, send, confirm
        now = datetime.now(UTC).replace(microsecond=0)
        assert await Scheduler(rt).run_due(now) == 1
        assert await Scheduler(rt).run_due(now) == 0  # another host: the tick is taken
        [message] = await take_all(physical(rt))
        envelope = json.loads(message.body)
        assert envelope["message_id"] == str(tick_message_id("invoices", now, 0))
        assert envelope["headers"][TICK_HEADER] == now.isoformat()
        t = rt.provider.stores.sql.tables.ticks
        async with rt.provider.stores.sql.engine.connect() as conn:
            rows = (await conn.execute(sa.select(t.c.tick_at, t.c.state))).all()
        assert [state for _, state in rows] == [SENT]
    finally:
        await rt.close()
