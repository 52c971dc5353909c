"""The messages table as message history: the SQL provider's durable tracker."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa

from ...clock import as_utc, opt_utc
from ...messages import MessageStatus
from ...tracking.base import Activity, MessageQuery, MessageRecord, Page, invalid_cursor
from .schema import claimable

if TYPE_CHECKING:
    from .provider import SqlProvider


def _loads(text: str | None) -> tuple[Any, str | None]:
    """Parsed JSON, or (None, text) when the stored text is not JSON (kept for the operator)."""
    if text is None:
        return None, None
    try:
        return json.loads(text), None
    except ValueError:
        return None, text


def encode_cursor(created_at: datetime, row_id: int) -> str:
    return base64.urlsafe_b64encode(f"{as_utc(created_at).isoformat()}|{row_id}".encode()).decode()


#: what :func:`encode_cursor` writes: an ISO 8601 time with its offset, a bar, a row id
_CURSOR = re.compile(r"(?P<at>[0-9][0-9T:.+-]{9,39})\|(?P<id>[0-9]{1,19})")
#: row ids are BIGINT (INTEGER on SQLite): a larger number must never reach the database
MAX_ROW_ID = 2**63 - 1


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    """The position a cursor from :func:`encode_cursor` names. A cursor comes from a URL, so every part
    is checked here before it meets the database; anything else is :class:`InvalidArgument`."""
    try:
        m = _CURSOR.fullmatch(base64.urlsafe_b64decode(cursor.encode("ascii")).decode("ascii"))
        if m is None:
            raise ValueError("not <time>|<id>")
        at, row_id = datetime.fromisoformat(m["at"]), int(m["id"])
        if at.tzinfo is None or not 0 < row_id <= MAX_ROW_ID:
            raise ValueError("out of range")
        return as_utc(at), row_id
    except (ValueError, binascii.Error, OverflowError):  # UnicodeError is a ValueError
        raise invalid_cursor() from None


class SqlTracker:
    def __init__(self, provider: SqlProvider) -> None:
        self.provider = provider

    @property
    def _m(self) -> sa.Table:
        return self.provider.tables.messages

    def columns(self) -> list[Any]:
        m, text = self._m, sa.Text()
        skip = {"body", "headers", "result", "progress"}
        return [c for c in m.c if c.name not in skip] + [
            sa.cast(m.c.body, text).label("body_text"),
            sa.cast(m.c.headers, text).label("headers_text"),
            sa.cast(m.c.result, text).label("result_text"),
            sa.cast(m.c.progress, text).label("progress_text"),
        ]

    @staticmethod
    def record(row: Any) -> MessageRecord:
        body, bad_body = _loads(row.body_text)
        headers, _ = _loads(row.headers_text)
        result, _ = _loads(row.result_text)
        progress, _ = _loads(row.progress_text)
        return MessageRecord(
            message_id=row.message_id,
            tracking_id=row.tracking_id,
            type=row.type,
            queue=row.queue,
            status=row.status,
            attempt=row.attempt,
            correlation_id=row.correlation_id,
            created_at=as_utc(row.created_at),
            updated_at=as_utc(row.updated_at),
            not_before=opt_utc(row.not_before),
            expires_at=opt_utc(row.expires_at),
            locked_by=row.locked_by,
            locked_until=opt_utc(row.locked_until),
            last_error=row.last_error,
            reason=row.reason,
            description=row.description,
            archived=row.archived,
            archived_at=opt_utc(row.archived_at),
            headers=headers if isinstance(headers, dict) else {},
            body=body if isinstance(body, dict) else None,
            raw=row.raw or bad_body,
            result=result,
            progress=progress if isinstance(progress, dict) else None,
            duplicates=getattr(row, "duplicates", None),  # a history column only
        )

    def where(self, q: MessageQuery) -> list[sa.ColumnElement[bool]]:
        m = self._m
        cond: list[sa.ColumnElement[bool]] = []
        if q.queue is not None:
            cond.append(m.c.queue == q.queue)
        if q.type is not None:
            cond.append(m.c.type == q.type)
        if q.status:
            plain = [s for s in q.status if s != MessageStatus.ARCHIVED.value]
            parts: list[sa.ColumnElement[bool]] = [m.c.status.in_(plain)] if plain else []
            if len(plain) != len(q.status):
                parts.append(m.c.archived)
            cond.append(sa.or_(*parts))
        if q.created_from is not None:
            cond.append(m.c.created_at >= q.created_from)
        if q.created_to is not None:
            cond.append(m.c.created_at < q.created_to)
        if q.archived is not None:
            cond.append(m.c.archived == q.archived)
        if q.correlation_id is not None:
            cond.append(m.c.correlation_id == q.correlation_id)
        if q.tracking_id is not None:
            cond.append(m.c.tracking_id == q.tracking_id)
        return cond

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        """Nothing to do: the provider's own statements write each row's history as they settle it."""

    async def reopen(self, record: MessageRecord) -> None:
        """Nothing to do: the provider's retry statement reopens the row itself."""

    async def get(self, message_id: UUID) -> MessageRecord | None:
        await self.provider.ensure_open()
        async with self.provider.engine.connect() as conn:
            row = (
                await conn.execute(sa.select(*self.columns()).where(self._m.c.message_id == message_id))
            ).first()
        return None if row is None else self.record(row)

    async def query(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> Page[MessageRecord]:
        m = self._m
        cond = self.where(query)
        if cursor:
            at, row_id = decode_cursor(cursor)
            # keyset paging, newest first: stable under inserts, no OFFSET scans
            cond.append(sa.or_(m.c.created_at < at, sa.and_(m.c.created_at == at, m.c.id < row_id)))
        stmt = (
            sa.select(*self.columns())
            .where(*cond)
            .order_by(m.c.created_at.desc(), m.c.id.desc())
            .limit(limit + 1)
        )
        await self.provider.ensure_open()
        async with self.provider.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        more = len(rows) > limit
        rows = rows[:limit]
        nxt = encode_cursor(rows[-1].created_at, rows[-1].id) if more and rows else None
        return Page[MessageRecord](items=[self.record(r) for r in rows], next_cursor=nxt)

    async def counts(self) -> dict[tuple[str, str], int]:
        """Unarchived messages per (queue, status): from the trigger-kept counters on PostgreSQL (no
        scan of the messages table), by GROUP BY on SQLite."""
        m = self._m
        stmt: sa.Select[Any]
        if self.provider.backend == "postgresql":
            c = self.provider.tables.counts
            total = sa.func.sum(c.c.n)
            stmt = (
                sa.select(c.c.queue, c.c.status, total)
                .where(~c.c.archived)
                .group_by(c.c.queue, c.c.status)
                .having(total != 0)
            )
        else:
            stmt = (
                sa.select(m.c.queue, m.c.status, sa.func.count())
                .where(~m.c.archived)
                .group_by(m.c.queue, m.c.status)
            )
        await self.provider.ensure_open()
        async with self.provider.engine.connect() as conn:
            rows = (await conn.execute(stmt)).all()
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}

    async def delete(self, query: MessageQuery) -> int:
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            res = await conn.execute(sa.delete(self._m).where(*self.where(query)))
        return res.rowcount or 0

    async def activity(
        self, queues: Sequence[str], since: datetime, slot_seconds: int, slots: int, now: datetime
    ) -> Activity:
        """Settled messages per queue and slot from ``since`` until (before) ``now``, through the
        partial index on ``settled_at`` (only the window's rows are read); the oldest due message per
        queue through the claim index."""
        m = self._m
        width = timedelta(seconds=slot_seconds)
        # the slot number as a sum of comparisons with bound times: the same SQL on every dialect
        slot = sum(
            (sa.case((m.c.settled_at >= since + width * i, 1), else_=0) for i in range(1, slots)),
            start=sa.literal(0),
        ).label("slot")
        ok = sa.case((m.c.status == MessageStatus.SUCCEEDED.value, 1), else_=0).label("ok")
        if self.provider.backend == "postgresql":
            seconds: Any = sa.func.extract("epoch", m.c.settled_at - m.c.created_at)
        else:
            seconds = (sa.func.julianday(m.c.settled_at) - sa.func.julianday(m.c.created_at)) * 86400
        settled = (
            sa.select(m.c.queue, slot, ok, sa.func.count(), sa.func.sum(seconds))
            # the partial index's predicate, word for word, so the planner can use it
            .where(
                sa.text("settled_at IS NOT NULL AND NOT archived"),
                m.c.settled_at >= since,
                m.c.settled_at < now,
            )
            .group_by(m.c.queue, sa.literal_column("slot"), sa.literal_column("ok"))
        )
        await self.provider.ensure_open()
        async with self.provider.engine.connect() as conn:
            rows = (await conn.execute(settled)).all()
            oldest = []
            for queue in queues:  # one claim-index lookup per queue, not a scan of every waiting row
                due = sa.select(sa.func.min(m.c.available_at)).where(
                    m.c.queue == queue, claimable(), m.c.available_at <= now
                )
                oldest.append((queue, (await conn.execute(due)).scalar()))
        out = Activity(since=since, slot_seconds=slot_seconds)
        spent: dict[str, list[float]] = {}
        counted: dict[str, list[int]] = {}
        for queue, index, succeeded, n, total in rows:
            index = min(max(int(index), 0), slots - 1)
            series = out.succeeded if succeeded else out.failed
            series.setdefault(queue, [0] * slots)[index] += int(n)
            spent.setdefault(queue, [0.0] * slots)[index] += float(total or 0)
            counted.setdefault(queue, [0] * slots)[index] += int(n)
        for queue, counts in counted.items():
            out.latency[queue] = [spent[queue][i] / c if c else None for i, c in enumerate(counts)]
        out.oldest_due = {str(q): as_utc(at) for q, at in oldest if at is not None}
        return out
