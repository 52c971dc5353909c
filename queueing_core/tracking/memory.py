"""A bounded in-memory tracker (least recently updated evicted first; 10,000 by default)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from .base import (
    OUTCOMES,
    MessageQuery,
    MessageRecord,
    Only,
    Page,
    as_listed,
    invalid_cursor,
    is_enqueue_record,
    still_as_listed,
    supersedes,
)


class MemoryTracker:
    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items: OrderedDict[UUID, MessageRecord] = OrderedDict()

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        self._write(records, keep_outcomes=True)

    def _write(self, records: Sequence[MessageRecord], *, keep_outcomes: bool) -> None:
        for rec in records:
            old = self._items.get(rec.message_id)
            if keep_outcomes and old is not None and old.status in OUTCOMES and is_enqueue_record(rec):
                continue  # the producer's record came after a fast worker's outcome
            self._items.pop(rec.message_id, None)
            if old is not None:
                # later events may not carry the body again; keep what we knew
                if rec.body is None:
                    rec.body = old.body
                if rec.raw is None:
                    rec.raw = old.raw
                if rec.progress is None:
                    rec.progress = old.progress
                # the duplicate marks are written only when set: a later record keeps them
                if rec.copied_from is None:
                    rec.copied_from = old.copied_from
                if rec.duplicates is None:
                    rec.duplicates = old.duplicates
            self._items[rec.message_id] = rec
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        """Write each record unless the stored one was updated later (the history backlog's writes)."""
        for rec in records:
            old = self._items.get(rec.message_id)
            if old is None or supersedes(rec, old):
                self._write([rec], keep_outcomes=True)
            elif rec.copied_from is not None:  # (as the Tables store: a newer record keeps the mark)
                await self.note_copied(rec.message_id, rec.copied_from)

    async def note_duplicate(self, message_id: UUID) -> None:
        """Count one delivery of ``message_id`` dropped as a known duplicate."""
        rec = self._items.get(message_id)
        if rec is not None:
            rec.duplicates = (rec.duplicates or 0) + 1

    async def note_copied(self, message_id: UUID, left_behind: str) -> None:
        """Mark the original ``left_behind`` as one whose outcome went on in a copy."""
        rec = self._items.get(message_id)
        if rec is not None:
            rec.copied_from = left_behind

    async def change_if_unchanged(self, seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        old = self._items.get(seen.message_id)
        if old is None or (old.status, old.updated_at) != (seen.status, seen.updated_at):
            return False
        self._write([old.model_copy(update=dict(changes))], keep_outcomes=False)
        return True

    async def reopen(self, record: MessageRecord) -> None:
        self._write([record], keep_outcomes=False)

    async def get(self, message_id: UUID) -> MessageRecord | None:
        return self._items.get(message_id)

    async def query(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> Page[MessageRecord]:
        # newest first; the cursor is the offset into the filtered list (memory is small and local)
        if cursor and not (cursor.isascii() and cursor.isdigit() and len(cursor) <= 9):
            raise invalid_cursor()
        start = int(cursor) if cursor else 0
        hits = [r for r in reversed(self._items.values()) if query.matches(r)]
        hits.sort(key=lambda r: r.created_at, reverse=True)
        page = hits[start : start + limit]
        nxt = str(start + limit) if start + limit < len(hits) else None
        return Page[MessageRecord](items=page, next_cursor=nxt)

    async def counts(self) -> dict[tuple[str, str], int]:
        return dict(Counter((r.queue, r.status) for r in self._items.values()))

    async def delete(self, query: MessageQuery, only: Only | None = None) -> int:
        keys = None if only is None else as_listed(only)
        doomed = [
            k
            for k, r in self._items.items()
            if query.matches(r)
            and (keys is None or (k in keys and still_as_listed(keys[k], r.status, r.updated_at)))
        ]
        for k in doomed:
            del self._items[k]
        return len(doomed)

    def __len__(self) -> int:
        return len(self._items)
