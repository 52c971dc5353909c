"""The messages table as message history: the SQL provider's durable tracker."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa

from ...clock import as_utc
from ...messages import MessageStatus
from ...tracking.base import Activity, MessageQuery, MessageRecord, Only, Page, as_listed, invalid_cursor
from .errors import db_boundary
from .records import read_record, stored_in_order
from .rows import stored_text
from .schema import IN_LIST_BATCH, LEASED_SQL, UNLEASED_SQL, archived, claimable, tracked_by

if TYPE_CHECKING:
    from .provider import SqlProvider


def _walks_by_time(status: Sequence[str] | None) -> bool:
    """Whether a listing with this status filter reads the listing index by time on PostgreSQL, and so
    (that index leaving out the rows running now) must add those from the lease sweeper's index: no
    filter, archived rows (most of a long history), or Leased beside Succeeded (which no index by
    status holds). Any other filter reads each status's rows on an index by status, Leased on the
    sweeper's."""
    names = set(status or ())
    return (
        not names
        or MessageStatus.ARCHIVED.value in names
        or {MessageStatus.LEASED.value, MessageStatus.SUCCEEDED.value} <= names
    )


def encode_cursor(created_at: datetime | None, row_id: int) -> str:
    """The position after the row ``row_id`` created at ``created_at``; a row whose time does not read
    (damaged) is named by its id alone (``@|<id>``), and the next page compares with its stored time."""
    at = "@" if created_at is None else as_utc(created_at).isoformat()
    return base64.urlsafe_b64encode(f"{at}|{row_id}".encode()).decode()


#: what :func:`encode_cursor` writes: an ISO 8601 time with its offset (or ``@``), a bar, a row id
_CURSOR = re.compile(r"(?P<at>[0-9][0-9T:.+-]{9,39}|@)\|(?P<id>[0-9]{1,19})")
#: row ids are BIGINT (INTEGER on SQLite): a larger number must never reach the database
MAX_ROW_ID = 2**63 - 1


def decode_cursor(cursor: str) -> tuple[datetime | None, int]:
    """The position a cursor from :func:`encode_cursor` names. A cursor comes from a URL, so every part
    is checked here before it meets the database; anything else is :class:`InvalidArgument`."""
    try:
        m = _CURSOR.fullmatch(base64.urlsafe_b64decode(cursor.encode("ascii")).decode("ascii"))
        if m is None:
            raise ValueError("not <time>|<id>")
        at, row_id = None if m["at"] == "@" else datetime.fromisoformat(m["at"]), int(m["id"])
        if (at is not None and at.tzinfo is None) or not 0 < row_id <= MAX_ROW_ID:
            raise ValueError("out of range")
        return None if at is None else as_utc(at), row_id
    except (ValueError, binascii.Error, OverflowError):  # UnicodeError is a ValueError
        raise invalid_cursor() from None


class SqlRecords:
    """The records' reads and writes over a table of the messages' columns: the queue's own
    (``SqlTracker``) and the side database's history (``SqlHistoryTracker``)."""

    def __init__(self, provider: SqlProvider) -> None:
        self.provider = provider

    @property
    def _m(self) -> sa.Table:
        return self.provider.tables.messages

    def columns(self) -> list[Any]:
        """What the listings select. JSON columns come as text (on SQLite their stored bytes: see
        ``rows.stored_text``); so do, on SQLite, the ids and times (a damaged one would fail the whole
        fetch in the driver); on PostgreSQL, whose columns refuse a non-UUID or non-time, a time the
        driver cannot hold (``infinity``, a year past 9999 or before 1) comes as NULL with its text
        beside it. :func:`read_record` reads each of them."""
        m, text = self._m, sa.Text()
        skip = {"body", "headers", "result", "progress"}
        postgres = self.provider.backend == "postgresql"
        out: list[Any] = []
        for c in m.c:
            if c.name in skip:
                continue
            if isinstance(c.type, sa.DateTime) and postgres:
                utc = sa.func.timezone("UTC", c)
                readable = sa.and_(sa.func.isfinite(c), sa.extract("year", utc).between(1, 9999))
                out.append(sa.case((readable, c), else_=None).label(c.name))
                stored = sa.case((sa.or_(c.is_(None), readable), None), else_=sa.cast(c, text))
                out.append(stored.label(f"{c.name}_stored"))
            elif isinstance(c.type, (sa.DateTime, sa.Uuid)) and not postgres:
                out.append(sa.cast(c, text).label(c.name))
            else:
                out.append(c)
        backend = self.provider.backend
        return [
            *out,
            stored_text(m.c.body, backend, "body_text"),
            stored_text(m.c.headers, backend, "headers_text"),
            stored_text(m.c.result, backend, "result_text"),
            stored_text(m.c.progress, backend, "progress_text"),
        ]

    @staticmethod
    def record(row: Any) -> MessageRecord:
        return read_record(row)

    def where(self, q: MessageQuery) -> list[sa.ColumnElement[bool]]:
        m = self._m
        cond: list[sa.ColumnElement[bool]] = []
        if q.queue is not None:
            cond.append(m.c.queue == q.queue)
        if q.type is not None:
            cond.append(m.c.type == q.type)
        if q.status:
            plain = [s for s in q.status if s != MessageStatus.ARCHIVED.value]
            # one equality a status, not ``IN``: PostgreSQL reads each status's rows on the index that
            # holds them (Leased rows are in the lease sweeper's index only, the others in the listing
            # indexes) and ORs the two; an ``IN`` list naming Leased and another status matches neither
            # index's predicate, and walked the whole history newest first instead. (A filter no
            # index by status serves is split in two by ``query``, see ``_walks_by_time``.)
            parts: list[sa.ColumnElement[bool]] = [m.c.status == s for s in plain]
            if len(plain) != len(q.status):
                parts.append(archived(m))
            cond.append(sa.or_(*parts))
        if q.created_from is not None:
            cond.append(m.c.created_at >= q.created_from)
        if q.created_to is not None:
            cond.append(m.c.created_at < q.created_to)
        if q.archived is not None:
            cond.append(archived(m, q.archived))
        if q.correlation_id is not None:
            cond.append(m.c.correlation_id == q.correlation_id)
        if q.tracking_id is not None:
            cond.append(tracked_by(m, q.tracking_id))
        return cond

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        """Nothing to do: the provider's own statements write each row's history as they settle it."""

    async def reopen(self, record: MessageRecord) -> None:
        """Nothing to do: the provider's retry statement reopens the row itself."""

    async def get(self, message_id: UUID) -> MessageRecord | None:
        with db_boundary("reading a message"):
            await self.provider.ensure_open()
            async with self.provider.engine.connect() as conn:
                row = (
                    await conn.execute(sa.select(*self.columns()).where(self._m.c.message_id == message_id))
                ).first()
        return None if row is None else self.record(row)

    def _page(
        self, query: MessageQuery, after: sa.ColumnElement[bool] | None, limit: int, *extra: Any
    ) -> sa.Select[Any]:
        """The first ``limit`` rows ``query`` matches after the keyset position ``after``, newest first
        (with the ``extra`` columns)."""
        m = self._m
        cond = self.where(query)
        if after is not None:
            cond.append(after)
        return (
            sa.select(*self.columns(), *extra)
            .where(*cond)
            .order_by(m.c.created_at.desc(), m.c.id.desc())
            .limit(limit)
        )

    async def query(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> Page[MessageRecord]:
        m = self._m
        after: sa.ColumnElement[bool] | None = None
        if cursor:
            at, row_id = decode_cursor(cursor)
            # keyset paging, newest first: stable under inserts, no OFFSET scans. After a damaged row
            # its stored time is compared in the database, as the ordering did (if that row is gone by
            # then, the listing ends there)
            then: Any = (
                at if at is not None else sa.select(m.c.created_at).where(m.c.id == row_id).scalar_subquery()
            )
            after = sa.or_(m.c.created_at < then, sa.and_(m.c.created_at == then, m.c.id < row_id))
        stmt: sa.Select[Any]
        if self.provider.backend == "postgresql" and _walks_by_time(query.status):
            # the listing index by time leaves out the rows running now (schema v16): the listing's
            # other rows come through it and its running ones through the lease sweeper's index, each
            # part newest first, and the two merged (each part is the listing's own filter and one of
            # the two indexes' predicates, said as the index says it, so the two are the listing)
            page = self._page(query, after, limit + 1, m.c.created_at.label("stored_order"))
            parts = sa.union_all(
                page.where(sa.text(UNLEASED_SQL)), page.where(sa.text(LEASED_SQL))
            ).subquery()
            # ordered by the stored time, as each part is; not fetched (a time the driver cannot hold
            # is listed as NULL beside its text, see ``columns``)
            stmt = (
                sa.select(*[c for c in parts.c if c.name != "stored_order"])
                .order_by(parts.c.stored_order.desc(), parts.c.id.desc())
                .limit(limit + 1)
            )
        else:
            stmt = self._page(query, after, limit + 1)
        with db_boundary("listing messages"):
            await self.provider.ensure_open()
            async with self.provider.engine.connect() as conn:
                rows = (await conn.execute(stmt)).all()
        more = len(rows) > limit
        rows = rows[:limit]
        items = [self.record(r) for r in rows]
        last = items[-1] if items else None
        nxt = None
        if more and last is not None:
            # the time only where the database orders the row by it (see stored_in_order)
            in_order = last.readable("created_at") and stored_in_order(rows[-1].created_at)
            nxt = encode_cursor(last.created_at if in_order else None, rows[-1].id)
        return Page[MessageRecord](items=items, next_cursor=nxt)

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
                .where(archived(m, False))
                .group_by(m.c.queue, m.c.status)
            )
        with db_boundary("counting messages"):
            await self.provider.ensure_open()
            async with self.provider.engine.connect() as conn:
                rows = (await conn.execute(stmt)).all()
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}

    async def delete(self, query: MessageQuery, only: Only | None = None) -> int:
        m, where = self._m, self.where(query)
        if only is None:
            batches: list[list[sa.ColumnElement[bool]]] = [where]
        else:
            batches = []
            given = list(as_listed(only).items())
            for start in range(0, len(given), IN_LIST_BATCH):  # bound values per statement: bounded
                part = given[start : start + IN_LIST_BATCH]
                ids = [i for i, seen in part if isinstance(i, UUID) and seen is None]
                # (one row value each: an OR of a clause per record passed SQLite's expression depth)
                as_seen = [(i, s[0], as_utc(s[1])) for i, s in part if isinstance(i, UUID) and s is not None]
                # a damaged row's id, by its stored text (only SQLite can store an id that is not one)
                texts = [i for i, _ in part if isinstance(i, str)]
                by_id = sa.or_(
                    m.c.message_id.in_(ids),
                    sa.tuple_(m.c.message_id, m.c.status, m.c.updated_at).in_(as_seen),
                    sa.cast(m.c.message_id, sa.Text()).in_(texts),
                )
                batches.append([*where, by_id])
        deleted = 0
        with db_boundary("deleting messages"):
            await self.provider.ensure_open()
            for conditions in batches:
                async with self.provider.engine.begin() as conn:
                    deleted += (await conn.execute(sa.delete(m).where(*conditions))).rowcount or 0
        return deleted


class SqlTracker(SqlRecords):
    """The SQL provider's tracker: its records are the queue's own rows, which also know when each was
    settled and when each waiting one is due, so it says what happened lately (the dashboard's charts).
    The side database's history has no such columns; its tracker shows counts only."""

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
        with db_boundary("reading the activity"):
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
