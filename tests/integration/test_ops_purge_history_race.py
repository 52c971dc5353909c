"""A purge on a transport whose history is separate (RabbitMQ, SQS, Storage Queues, Service Bus)
lists the history's matches, removes them from the transport, then deletes their history: by their
ids, never by the filter alone. A message dead-lettered after the listing was read is still in the
dead-letter queue (nothing removed it) and keeps its history, so a listing shows it and a retry
reaches it (before, it was deleted with the others: retry answered 404, and a dead letter moves only
by a retry). Found in review; failed on the old code on both databases.

The transport here is the in-process provider (its dead letters stand in for a broker's dead-letter
queue); the history is the SQL one, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import MessageNotFound
from queueing_core.ops import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.providers.sql.history import SqlHistoryTracker
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until


@queue("hist_purge", max_attempts=1)
class Letter(QueueMessage):
    n: int


async def test_a_dead_letter_that_arrives_during_a_purge_keeps_its_history(sql_db):
    gate = asyncio.Event()
    app = QueueingApp("histpurge")

    @app.handler(Letter)
    async def handle(msg: Letter) -> None:
        if msg.n == 2:
            await gate.wait()  # B fails only once the purge is under way
        raise RuntimeError(f"letter {msg.n} fails")

    sql = sql_db.provider(listen=False)
    history = SqlHistoryTracker(sql)
    transport = InProcessProvider()
    rt = Runtime(app, transport, tracker=history)
    ops = OpsService(rt)

    async def status(mid):
        r = await history.get(mid)
        return None if r is None else r.status

    a, b = await app.enqueue_many([Letter(n=1), Letter(n=2)])
    async with running(rt):
        await wait_until(lambda: _is(status, a.message_id, "DeadLettered"), what="A dead-lettered")
        original = transport.ops_remove

        async def remove_while_b_dies(query, records):
            assert [r.message_id for r in records] == [a.message_id]  # the listing: A only
            gate.set()
            await wait_until(lambda: _is(status, b.message_id, "DeadLettered"), what="B dead-lettered")
            return await original(query, records)

        transport.ops_remove = remove_while_b_dies
        result = await ops.purge(MessageQuery(queue="hist_purge", status=("DeadLettered",)))
    held = [s.delivery.envelope.message_id for s in transport.dead_letters.get("hist_purge", [])]
    assert result.deleted == 1
    assert held == [b.message_id], "B is still in the dead-letter queue"
    try:
        await ops.retry(b.message_id)
    except MessageNotFound as exc:
        pytest.fail(f"B sits in the dead-letter queue but its history was purged: {exc}")
    await sql.close()


async def _is(status, mid, want) -> bool:
    return await status(mid) == want


async def test_a_purge_deletes_the_history_of_many_messages_by_id_in_batches(sql_db):
    """Thousands of ids: deleted a batch of bound values at a time (SQLite takes 32,766 at most)."""
    from datetime import UTC, datetime
    from uuid import uuid4

    from queueing_core.tracking import MessageRecord

    history = SqlHistoryTracker(sql_db.provider(listen=False))
    now = datetime.now(UTC)
    records = [
        MessageRecord(
            message_id=uuid4(),
            tracking_id=uuid4(),
            type="Letter",
            queue="hist_purge",
            status="DeadLettered",
            created_at=now,
            updated_at=now,
        )
        for _ in range(1_200)
    ]
    await history.upsert(records)
    gone = [r.message_id for r in records[:1_100]]
    query = MessageQuery(queue="hist_purge", status=("DeadLettered",))
    assert await history.delete(query, only=gone) == 1_100
    left = await history.query(query, limit=500)
    assert sorted(r.message_id for r in left.items) == sorted(r.message_id for r in records[1_100:])
    assert await history.delete(query, only=[]) == 0
    await history.provider.close()
