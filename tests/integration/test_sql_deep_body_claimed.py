"""A stored body nested deeper than Python's recursion limit (another program wrote the row), on SQLite
and PostgreSQL: claimed in a batch with healthy messages, it is dead-lettered alone as malformed, the
others run, and the views read it marked. Its RecursionError escaped the batch after the claim had
committed: every row of the batch stayed leased until the sweep, which counted an attempt on each, and
the healthy messages of the batch were dead-lettered without running; reading it failed the views."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

from ..clocks import ManualClock

DEEP = '{"ref": "deep", "x": ' + "[" * 5000 + "]" * 5000 + "}"


@queue("deep-body", max_attempts=2, lease_duration=timedelta(seconds=30))
class Job(QueueMessage):
    ref: str


async def test_a_body_nested_too_deep_is_dead_lettered_alone_and_its_batch_runs(sql_db):
    clock = ManualClock(datetime(2026, 3, 2, 12, 0, tzinfo=UTC))
    app = QueueingApp("deep-body")
    runs: list[str] = []

    @app.handler()
    async def job(msg: Job) -> None:
        runs.append(msg.ref)

    provider = sql_db.provider(clock=clock, listen=False)
    rt = Runtime(app, provider, clock=clock)
    await rt.open()
    try:
        deep = await app.enqueue(Job(ref="deep", created_at=clock()))
        good = [await app.enqueue(Job(ref=f"good-{i}", created_at=clock())) for i in range(3)]
        m = provider.tables.messages
        async with provider.engine.begin() as conn:  # another program writes the row
            await conn.execute(
                sa.update(m)
                .where(m.c.message_id == deep.message_id)
                .values(body=sa.literal_column(f"'{DEEP}'"))
            )
        for _ in range(3):  # (as a worker goes on: the sweep after each lease, and claims again)
            await run_until_idle(rt, raise_errors=False)
            clock.now += timedelta(minutes=1)
            await provider.maintain(app)

        assert sorted(runs) == ["good-0", "good-1", "good-2"]
        for receipt in good:
            assert (await rt.tracker.get(receipt.message_id)).status == MessageStatus.SUCCEEDED
        record = await rt.tracker.get(deep.message_id)
        assert record is not None
        assert record.status == MessageStatus.DEAD_LETTERED
        assert record.reason == "malformed-envelope"
        assert record.malformed == "body is nested too deep to read"
        assert record.body is None
        assert record.raw is not None
        assert record.raw.count("[") == 5000  # its stored text (PostgreSQL's jsonb orders the keys)
        page = await rt.tracker.query(MessageQuery(queue="deep-body"))
        assert len(page.items) == 4
    finally:
        await rt.close()
