"""The overview's hour of charts: finished slots read once and kept, the current slot read each time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from queueing_core.ops.ui.activity import ActivityWindow
from queueing_core.tracking import Activity


class Recorder:
    """An activity source that answers one succeeded message per queue per slot, and records reads."""

    def __init__(self) -> None:
        self.reads: list[tuple[datetime, int, datetime]] = []

    async def activity(self, queues, since, slot_seconds, slots, now) -> Activity:
        self.reads.append((since, slots, now))
        return Activity(
            since=since,
            slot_seconds=slot_seconds,
            succeeded={"q": [1] * slots},
            failed={"q": [0] * slots},
            latency={"q": [2.0] * slots},
            oldest_due={"q": now},
        )


async def test_finished_slots_are_read_once_and_the_current_one_every_time():
    source, window = Recorder(), ActivityWindow(slots=12, slot_seconds=300)
    now = datetime(2026, 1, 1, 12, 7, 30, tzinfo=UTC)
    first = await window.read(source, ["q"], now)
    slot_start = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    assert source.reads == [(slot_start - timedelta(minutes=55), 11, slot_start), (slot_start, 1, now)]
    assert first.since == slot_start - timedelta(minutes=55)
    assert first.succeeded["q"] == [1] * 12
    assert first.latency["q"] == [2.0] * 12
    assert first.oldest_due == {"q": now}

    source.reads.clear()
    await window.read(source, ["q"], now + timedelta(seconds=90))  # the same slot: only it is read
    assert source.reads == [(slot_start, 1, now + timedelta(seconds=90))]

    source.reads.clear()
    later = now + timedelta(minutes=5)  # one more slot finished: read once, the oldest dropped
    moved = await window.read(source, ["q"], later)
    assert source.reads == [
        (slot_start, 1, slot_start + timedelta(minutes=5)),
        (slot_start + timedelta(minutes=5), 1, later),
    ]
    assert moved.since == first.since + timedelta(minutes=5)
    assert len(window.kept) == 11
    assert moved.succeeded["q"] == [1] * 12


async def test_two_polls_either_side_of_a_slot_boundary_both_answer():
    """Two tabs share the window: the poll just after a boundary drops the oldest kept slot while the
    poll just before it waits on its current slot's read. The earlier poll then looked that slot up in
    the shared window, and the overview answered 500."""
    import asyncio

    class Slow(Recorder):
        async def activity(self, queues, since, slot_seconds, slots, now) -> Activity:
            out = await super().activity(queues, since, slot_seconds, slots, now)
            if slots == 1 and now.minute == 4:  # the earlier poll's current slot: a slow read
                await asyncio.sleep(0.2)
            return out

    source, window = Slow(), ActivityWindow(slots=12, slot_seconds=300)
    await window.read(source, ["q"], datetime(2030, 1, 1, 12, 4, 58, tzinfo=UTC))
    before = asyncio.create_task(window.read(source, ["q"], datetime(2030, 1, 1, 12, 4, 59, tzinfo=UTC)))
    await asyncio.sleep(0.05)
    after = await window.read(source, ["q"], datetime(2030, 1, 1, 12, 5, 1, tzinfo=UTC))
    early = await before
    assert early.succeeded["q"] == [1] * 12
    assert after.succeeded["q"] == [1] * 12
    assert early.since == datetime(2030, 1, 1, 11, 5, tzinfo=UTC)
    assert after.since == datetime(2030, 1, 1, 11, 10, tzinfo=UTC)
    assert sorted(window.kept)[0] == int(after.since.timestamp())  # the newest hour kept, no older slot
