"""The last hour for the overview's charts, in five-minute slots aligned to the clock.

A finished slot never changes (a message's settlement time is written once), so each is read from the
store once and kept; every refresh reads only the slot in progress. Polling every few seconds then
costs a few minutes of rows, not an hour of them, however busy the queues are.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from ...tracking import Activity, ActivitySource

#: one finished slot: per queue, (succeeded, ended otherwise, mean seconds from enqueue to settlement)
Slot = dict[str, tuple[int, int, float | None]]


def _at(epoch: int) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _slot(activity: Activity, index: int) -> Slot:
    queues = set(activity.succeeded) | set(activity.failed)
    return {
        q: (
            activity.succeeded.get(q, [0] * (index + 1))[index],
            activity.failed.get(q, [0] * (index + 1))[index],
            activity.latency.get(q, [None] * (index + 1))[index],
        )
        for q in queues
    }


class ActivityWindow:
    def __init__(self, slots: int = 12, slot_seconds: int = 300) -> None:
        self.slots = slots
        self.width = slot_seconds
        self.kept: dict[int, Slot] = {}  # slot start (seconds since 1970) -> what settled in it

    async def read(self, source: ActivitySource, queues: Sequence[str], now: datetime) -> Activity:
        current = int(now.timestamp()) // self.width * self.width
        starts = [current - self.width * i for i in range(self.slots - 1, -1, -1)]  # oldest first
        # a copy of what is kept: polls from several tabs share the window, and one just past a slot
        # boundary drops the oldest slot while one just before it is still reading
        kept = {s: v for s, v in self.kept.items() if s >= starts[0]}
        missing = [s for s in starts[:-1] if s not in kept]
        if missing:  # one read from the first slot not kept to the start of the current one
            first = missing[0]
            count = (current - first) // self.width
            done = await source.activity(queues, _at(first), self.width, count, _at(current))
            for i in range(count):
                kept[first + i * self.width] = _slot(done, i)
        live = await source.activity(queues, _at(current), self.width, 1, now)
        slots = [kept[s] for s in starts[:-1]] + [_slot(live, 0)]
        merged = {**self.kept, **kept}  # what another poll kept meanwhile stays; the newest hour only
        oldest = max(merged, default=starts[0]) - self.width * (self.slots - 2)
        self.kept = {s: v for s, v in merged.items() if s >= oldest}
        out = Activity(since=_at(starts[0]), slot_seconds=self.width, oldest_due=live.oldest_due)
        for q in {q for slot in slots for q in slot}:
            values = [slot.get(q, (0, 0, None)) for slot in slots]
            out.succeeded[q] = [v[0] for v in values]
            out.failed[q] = [v[1] for v in values]
            out.latency[q] = [v[2] for v in values]
        return out
