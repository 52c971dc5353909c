"""A history store that fails on demand, for the history writer's tests (its backlog and journal)."""

from __future__ import annotations

from collections.abc import Sequence

from queueing_core.tracking import MemoryTracker, MessageRecord


class FlakyTracker(MemoryTracker):
    """A memory tracker whose writes fail while ``down`` (reads still answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        if self.down:
            raise ConnectionError("history store unreachable")
        await super().upsert(records)

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        if self.down:
            raise ConnectionError("history store unreachable")
        await super().upsert_newer(records)
