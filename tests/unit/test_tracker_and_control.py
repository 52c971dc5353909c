"""The in-memory tracker's bound and the control store's state."""

from datetime import UTC, datetime, timedelta
from uuid import uuid4

from queueing_core.control import CachedControlStore, MemoryControlStore
from queueing_core.tracking import MemoryTracker, MessageQuery, MessageRecord

T = datetime(2026, 1, 1, tzinfo=UTC)


def rec(i, status="Pending", queue="q"):
    return MessageRecord(
        message_id=uuid4(),
        tracking_id=uuid4(),
        type="T",
        queue=queue,
        status=status,
        created_at=T + timedelta(seconds=i),
        updated_at=T,
    )


async def test_tracker_is_bounded_and_evicts_least_recently_updated():
    tr = MemoryTracker()
    assert tr.capacity == 10_000
    small = MemoryTracker(capacity=3)
    a, b, c, d = (rec(i) for i in range(4))
    await small.upsert([a, b, c])
    await small.upsert([a.model_copy(update={"status": "Succeeded"})])  # a is now the freshest
    await small.upsert([d])
    assert await small.get(b.message_id) is None
    assert (await small.get(a.message_id)).status == "Succeeded"
    assert len(small) == 3


async def test_tracker_filters_pages_counts_and_deletes():
    tr = MemoryTracker()
    await tr.upsert(
        [rec(i, "DeadLettered" if i % 3 == 0 else "Succeeded", "a" if i < 6 else "b") for i in range(9)]
    )
    page = await tr.query(MessageQuery(status=("DeadLettered",)), limit=2)
    assert len(page.items) == 2
    assert page.next_cursor == "2"
    assert page.items[0].created_at > page.items[1].created_at  # newest first
    rest = await tr.query(MessageQuery(status=("DeadLettered",)), limit=2, cursor=page.next_cursor)
    assert len(rest.items) == 1
    assert rest.next_cursor is None
    assert (await tr.counts())[("a", "DeadLettered")] == 2
    assert await tr.delete(MessageQuery(queue="b")) == 3
    assert len(tr) == 6


async def test_cached_control_reads_once_per_ttl_and_writes_invalidate():
    inner = MemoryControlStore()
    reads = 0
    original = inner.state

    async def counting():
        nonlocal reads
        reads += 1
        return await original()

    inner.state = counting
    cached = CachedControlStore(inner, ttl=60)
    for _ in range(5):
        await cached.state()
    assert reads == 1
    await cached.set_paused("queue", "q", True)
    assert (await cached.state()).is_paused("q", "T")
    assert reads == 2
