"""Message history in SQL for transports that keep none themselves (RabbitMQ, SQS).

:class:`SideStores` opens one :class:`SqlProvider` on ``QUEUEING_DATABASE_URL`` only to host the engine
and the migrations; it hands out the shared pause/circuit store (the SQL provider's own tables) and
:class:`SqlHistoryTracker`, one row per message life in ``queueing_history`` (migration v3).

Merge rules of :meth:`SqlHistoryTracker.upsert` (one atomic statement per record, so hosts writing the
same message concurrently cannot interleave a read and a write):

- a record without ``body``/``raw`` keeps the stored ones (later events do not carry the body again);
- an *enqueue record* (not started: no reason, no error, not terminal) never replaces a terminal one.
  The producer writes its record after the broker accepted the message, and with a push consumer the
  worker can handle the message and record "Succeeded" first; the late "Pending" must not win.
  An operator's retry of a finished message goes through :meth:`SqlHistoryTracker.reopen` first.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa
from pydantic_core import to_json

from ...clock import Clock, as_utc, utcnow
from ...envelope import malformed_id as malformed_id  # re-exported for the transports that use it
from ...messages import MessageStatus
from ...tracking.base import (
    CANCEL_REQUESTED,
    OUTCOMES,
    MessageRecord,
    is_enqueue_record,
    newest_per_message,
)
from .control import SqlControlStore
from .provider import SqlProvider
from .schema import archived, first_rows
from .tracker import SqlRecords

if TYPE_CHECKING:
    from sqlalchemy.engine import URL
    from sqlalchemy.ext.asyncio import AsyncConnection

    from ...naming import Transport
    from ...settings import QueueingSettings
    from ..delayed.store import SqlDelayedStore

log = logging.getLogger("queueing.sql")

TERMINAL = tuple(sorted(s.value for s in MessageStatus.terminal()))
#: the columns holding JSON text
_JSON = frozenset({"headers", "body", "result", "progress"})
#: rows deleted per statement by :meth:`SqlHistoryTracker.prune` (short transactions, no long locks)
PRUNE_CHUNK = 5000


def _json(value: Any) -> str | None:
    return None if value is None else to_json(value).decode()


def _fold(records: Sequence[MessageRecord]) -> list[MessageRecord]:
    """One record per message (a statement may not touch a row twice): the later wins, body/raw kept."""
    folded: dict[UUID, MessageRecord] = {}
    for rec in records:
        old = folded.get(rec.message_id)
        if old is not None and (rec.body is None or rec.raw is None):
            rec = rec.model_copy(
                update={
                    "body": old.body if rec.body is None else rec.body,
                    "raw": old.raw if rec.raw is None else rec.raw,
                }
            )
        folded[rec.message_id] = rec
    # one lock order for every writer: concurrent batches on PostgreSQL cannot deadlock
    return [folded[k] for k in sorted(folded)]


class SqlHistoryTracker(SqlRecords):
    """The Tracker protocol over ``queueing_history``; listing, paging and filters are the SQL
    provider's (same columns, same keyset cursor, newest first)."""

    def __init__(self, provider: SqlProvider, *, retention: timedelta = timedelta(days=14)) -> None:
        super().__init__(provider)
        if retention <= timedelta(0):
            raise ValueError("retention must be positive")
        self.retention = retention

    @property
    def _m(self) -> sa.Table:
        return self.provider.tables.history

    def _row(self, r: MessageRecord) -> dict[str, Any]:
        return {
            "message_id": r.message_id,
            "tracking_id": r.tracking_id,
            "queue": r.queue,
            "type": r.type,
            "status": r.status,
            "attempt": r.attempt,
            "correlation_id": r.correlation_id,
            "created_at": as_utc(r.created_at),
            "updated_at": as_utc(r.updated_at),
            "not_before": r.not_before and as_utc(r.not_before),
            "expires_at": r.expires_at and as_utc(r.expires_at),
            "locked_by": r.locked_by,
            "locked_until": r.locked_until and as_utc(r.locked_until),
            "last_error": r.last_error,
            "reason": r.reason,
            "description": r.description,
            "headers": _json(r.headers) or "{}",
            "body": _json(r.body),
            "raw": r.raw,
            "result": _json(r.result),
            "progress": _json(r.progress),
            "archived": r.archived,
            "archived_at": r.archived_at and as_utc(r.archived_at),
        }

    def _upsert_statement(self, *, keep_outcomes: bool, if_newer: bool = False) -> Any:
        t = self._m
        dialect_insert: Any
        if self.provider.backend == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        stmt = dialect_insert(t)
        ex = stmt.excluded
        changes: dict[str, Any] = {
            # the duplicate count is only ever added to (note_duplicate): a record never resets it
            c.name: ex[c.name]
            for c in t.c
            if c.name not in ("id", "message_id", "body", "raw", "duplicates")
        }
        changes["body"] = sa.func.coalesce(ex["body"], t.c.body)
        changes["raw"] = sa.func.coalesce(ex["raw"], t.c.raw)
        changes["progress"] = sa.func.coalesce(ex["progress"], t.c.progress)  # kept past the outcome
        # the statuses as SQL literals (constants of the kit): an executemany cannot expand a bound list
        # A producer writes its record after the send, so a fast worker may have written first: an
        # enqueue record never replaces an outcome (finished, or failed and waiting for its retry).
        kept: list[sa.ColumnElement[str]] = [sa.literal_column(f"'{s}'") for s in sorted(OUTCOMES)]
        conditions: list[sa.ColumnElement[bool]] = []
        if keep_outcomes:
            conditions.append(t.c.status.not_in(kept))
        if if_newer:
            # a late write (the history backlog, a record another host's may overtake) never replaces a
            # newer record, except that a run's record always replaces a producer's (``supersedes``;
            # "a producer's" as ``is_producers_record`` says it: no result outside OUTCOMES, so none read)
            newer: sa.ColumnElement[bool] = t.c.updated_at <= ex["updated_at"]
            if not keep_outcomes:  # (the records written here are a run's)
                producers = sa.and_(
                    t.c.status.not_in([*kept, sa.literal_column(f"'{MessageStatus.LEASED.value}'")]),
                    t.c.reason.is_(None),
                    t.c.last_error.is_(None),
                    t.c.locked_by.is_(None),
                )
                # and an operator's request to cancel (``is_cancel_request``)
                request = sa.and_(
                    t.c.status == sa.literal_column(f"'{MessageStatus.CANCELLED.value}'"),
                    t.c.description == sa.literal_column(f"'{CANCEL_REQUESTED}'"),
                )
                newer = sa.or_(newer, producers, request)
            conditions.append(newer)
        where = sa.and_(*conditions) if conditions else None
        return stmt.on_conflict_do_update(index_elements=[t.c.message_id], set_=changes, where=where)

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        if not records:
            return
        plain: list[dict[str, Any]] = []
        fresh: list[dict[str, Any]] = []
        for r in _fold(records):
            (fresh if is_enqueue_record(r) else plain).append(self._row(r))
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            if plain:
                await conn.execute(self._upsert_statement(keep_outcomes=False), plain)
            if fresh:
                await conn.execute(self._upsert_statement(keep_outcomes=True), fresh)

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        """Write each record unless the stored one was updated later (the history backlog's writes)."""
        latest = newest_per_message(records)
        if not latest:
            return
        plain: list[dict[str, Any]] = []
        fresh: list[dict[str, Any]] = []
        for k in sorted(latest):
            # a producer's record never replaces an outcome here either (its clock may read later)
            (fresh if is_enqueue_record(latest[k]) else plain).append(self._row(latest[k]))
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            if plain:
                await conn.execute(self._upsert_statement(keep_outcomes=False, if_newer=True), plain)
            if fresh:
                await conn.execute(self._upsert_statement(keep_outcomes=True, if_newer=True), fresh)

    async def change(self, message_id: UUID, changes: Mapping[str, Any]) -> None:
        """Set these fields of ``message_id``'s row and leave the rest as stored: an action on a row
        damaged outside the kit (an upsert would write the record's stand-ins over its stored text)."""
        t = self._m
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            await conn.execute(sa.update(t).where(t.c.message_id == message_id).values(**self._set(changes)))

    async def change_if_unchanged(self, seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            return await self.change_if_unchanged_on(conn, seen, changes)

    async def change_if_unchanged_on(
        self, conn: AsyncConnection, seen: MessageRecord, changes: Mapping[str, Any]
    ) -> bool:
        """:meth:`change_if_unchanged` inside the caller's transaction on this database (the delayed
        store's: an operator's copy of a waiting message is made only while its history is as read)."""
        t = self._m
        guard = (
            t.c.message_id == seen.message_id,
            t.c.status == seen.status,
            t.c.updated_at == as_utc(seen.updated_at),
        )
        done = await conn.execute(sa.update(t).where(*guard).values(**self._set(changes)))
        return bool(done.rowcount == 1)

    def _set(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        t = self._m
        values = {
            name: _json(v) if name in _JSON else as_utc(v) if isinstance(v, datetime) else v
            for name, v in changes.items()
        }
        if not set(values) <= {c.name for c in t.c} - {"id", "message_id"}:
            raise ValueError(f"not a column a change may set: {sorted(values)}")
        return values

    async def note_duplicate(self, message_id: UUID) -> None:
        """Count one delivery of ``message_id`` completed as a known duplicate."""
        t = self._m
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            await conn.execute(
                sa.update(t)
                .where(t.c.message_id == message_id)
                .values(duplicates=sa.func.coalesce(t.c.duplicates, 0) + 1)
            )

    @property
    def store_id(self) -> str:
        """Which database and schema this tracker writes to (names the local journal of records not
        yet written); the password is left out."""
        url = self.provider.url.render_as_string(hide_password=True)
        return f"sql:{url}|{self.provider.tables.history.schema or ''}"

    async def reopen(self, record: MessageRecord) -> None:
        """Write ``record`` whatever the stored status (an operator's retry of a finished message)."""
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            await conn.execute(self._upsert_statement(keep_outcomes=False), [self._row(record)])

    async def counts(self) -> dict[tuple[str, str], int]:
        """Unarchived records per (queue, status), from the partial counting index."""
        m = self._m
        stmt = sa.select(m.c.queue, m.c.status, sa.func.count()).where(archived(m, False))
        await self.provider.ensure_open()
        async with self.provider.engine.connect() as conn:
            rows = (await conn.execute(stmt.group_by(m.c.queue, m.c.status))).all()
        return {(str(r[0]), str(r[1])): int(r[2]) for r in rows}

    async def prune(self, now: datetime, keep: Collection[str] = ()) -> int:
        """Delete finished records last updated before ``now - retention``, but none in ``keep`` (the
        transport's ``dead_letters_kept``); returns how many."""
        m = self._m
        cutoff = as_utc(now) - self.retention
        finished = [m.c.status.in_([s for s in TERMINAL if s not in keep]), m.c.updated_at < cutoff]
        doomed = sa.delete(m).where(*first_rows(m, finished, PRUNE_CHUNK, self.provider.backend))
        total = 0
        await self.provider.ensure_open()
        while True:
            async with self.provider.engine.begin() as conn:
                res = await conn.execute(doomed)
            n = res.rowcount or 0
            total += n
            if n < PRUNE_CHUNK:
                return total


class SideStores:
    """The SQL database a RabbitMQ or SQS deployment shares across hosts: pause/circuit state, message
    history and the delayed-message store, on one engine (migrated to the latest schema on open)."""

    def __init__(
        self,
        url: str | URL,
        *,
        schema: str | None = None,
        retention: timedelta = timedelta(days=14),
        auto_migrate: bool = True,
        connect_retries: int = 8,
        clock: Clock = utcnow,
        **sign_in: Any,
    ) -> None:
        # LISTEN is off: the SQL provider's queue wake-ups mean nothing here (the delayed store
        # listens on its own channel). ``sign_in``: database_auth, client_id, credential, prepared_statements.
        self.sql = SqlProvider(
            url,
            schema=schema,
            listen=False,
            auto_migrate=auto_migrate,
            connect_retries=connect_retries,
            clock=clock,
            **sign_in,
        )
        self.clock = clock
        self.control: SqlControlStore = self.sql.control_store()
        self.history = SqlHistoryTracker(self.sql, retention=retention)
        self._delayed: dict[str, SqlDelayedStore] = {}

    @classmethod
    def from_settings(cls, settings: QueueingSettings) -> SideStores:
        return cls(
            settings.database_url,
            schema=settings.database_schema,
            retention=timedelta(days=settings.tracker_retention_days),
            auto_migrate=settings.auto_migrate,
            connect_retries=settings.connect_retries,
            database_auth=settings.database_auth,
            client_id=settings.database_client_id,
            prepared_statements=settings.database_prepared_statements,
        )

    def delayed_store(self, transport: Transport) -> SqlDelayedStore:
        from ..delayed.store import SqlDelayedStore

        store = self._delayed.get(transport.value)
        if store is None:
            store = self._delayed[transport.value] = SqlDelayedStore(self.sql, transport, clock=self.clock)
        return store

    async def open(self) -> None:
        await self.sql.ensure_open()

    async def close(self) -> None:
        for store in self._delayed.values():
            await store.close()
        await self.sql.close()
