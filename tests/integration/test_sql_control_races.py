"""Two operators pausing the same queue at once both succeed (PostgreSQL): the second pause finds no
row, waits on the first one's insert, and then meets the unique key. It used to fail there (a 500 from
the ops API) though the queue was paused as asked."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from tests.contract.harness import wait_until

from .pg_locks import waiting_for_a_lock


@queue("pause_race")
class Job(QueueMessage):
    n: int


async def test_two_pauses_of_one_queue_at_once_both_succeed(pg_db):
    app = QueueingApp("pause-race")
    app.handler(Job)(lambda msg: None)
    prov = pg_db.provider()
    rt = Runtime(app, prov)
    await rt.open()
    try:
        p = prov.tables.pauses
        async with prov.engine.connect() as first:  # the first operator's pause, not yet committed
            await first.begin()
            await first.execute(p.insert().values(kind="queue", name="pause_race", paused_at=prov.clock()))
            second = asyncio.create_task(rt.control.set_paused("queue", "pause_race", True))
            await wait_until(
                lambda: waiting_for_a_lock(prov, f"{pg_db.schema}.queueing_pauses"), what="the second pause"
            )
            await first.commit()
        await asyncio.wait_for(second, 10)  # raised IntegrityError before
        async with prov.engine.connect() as conn:
            rows = (await conn.execute(sa.select(sa.func.count()).select_from(p))).scalar()
        assert rows == 1
    finally:
        await rt.close()
