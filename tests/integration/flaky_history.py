"""History stores that fail on demand, and the records the history writer's tests write (its backlog
and journal)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from queueing_core.tracking import MemoryTracker, MessageRecord

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def record(mid: uuid.UUID, status: str = "Succeeded", seconds: float = 0.0, **fields: Any) -> MessageRecord:
    """A record of message ``mid``, updated ``seconds`` after :data:`T0`."""
    return MessageRecord(
        message_id=mid,
        tracking_id=mid,
        type="Work",
        queue="hist/work",
        status=status,
        created_at=T0,
        updated_at=T0 + timedelta(seconds=seconds),
        **fields,
    )


class FlakyTracker(MemoryTracker):
    """A memory tracker whose writes fail while ``down`` (reads still answer); ``gate`` decides."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def gate(self, records: Sequence[MessageRecord]) -> None:
        if self.down:
            raise ConnectionError("history store unreachable")

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        self.gate(records)
        await super().upsert(records)

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        self.gate(records)
        await super().upsert_newer(records)


class RefusesSome(FlakyTracker):
    """Refuses any write holding a record of one of ``poison``, as a store refuses a record it cannot
    keep (text it cannot store, a body over its property limit), while it takes the others."""

    def __init__(self, poison: Iterable[uuid.UUID]) -> None:
        super().__init__()
        self.poison = set(poison)

    def gate(self, records: Sequence[MessageRecord]) -> None:
        super().gate(records)
        if any(r.message_id in self.poison for r in records):
            raise ValueError("the store cannot keep this record")
