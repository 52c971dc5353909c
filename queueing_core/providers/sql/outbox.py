"""Enqueue inside the caller's own database transaction (the transactional outbox).

The message row is written on the caller's connection or session, so it exists exactly when the
caller's business write commits; on PostgreSQL the worker wake-up (``pg_notify``) is sent at that
same commit. Works with SQLAlchemy ``Connection``/``Session`` and ``AsyncConnection``/``AsyncSession``.

    outbox = SqlOutbox(app)
    with Session(engine) as session, session.begin():
        session.add(order)
        outbox.enqueue(session, OrderPlaced(order_id=order.id, ...))
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from typing_extensions import Unpack

from ...app import QueueingApp
from ...clock import Clock, utcnow
from ...envelope import Envelope
from ...messages import QueueMessage
from ...middleware import compose_enqueue
from ...producer import EnqueueOptions, EnqueueReceipt, build_envelope, check_sendable
from .provider import channel_for, initial_status, insert_statement, notify_statement
from .rows import row_for
from .schema import Tables

DEFAULT_MAX_BYTES = 1024 * 1024


class SqlOutbox:
    def __init__(
        self,
        app: QueueingApp,
        *,
        schema: str | None = None,
        clock: Clock = utcnow,
        max_message_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.app = app
        self.tables = Tables.build(schema)
        self.channel = channel_for(schema)
        self.clock = clock
        self.max_message_bytes = max_message_bytes

    def _build(
        self, messages: QueueMessage | Iterable[QueueMessage], options: EnqueueOptions
    ) -> list[Envelope]:
        items = [messages] if isinstance(messages, QueueMessage) else list(messages)
        now = self.clock()
        return [build_envelope(self.app, m, now, **options) for m in items]

    async def _through_middleware(self, envs: list[Envelope]) -> list[Envelope]:
        chain = compose_enqueue(self.app.enqueue_middleware)
        out = [await chain(e) for e in envs]
        check_sendable(out, self.max_message_bytes, "sql")
        return out

    def _statements(
        self, backend: str, envs: list[Envelope]
    ) -> tuple[sa.Insert, list[dict[str, Any]], list[sa.Select[Any]]]:
        now = self.clock()
        rows = [row_for(e, initial_status(self.app, e), now) for e in envs]
        notes = (
            [notify_statement(self.channel, q) for q in sorted({e.queue for e in envs})]
            if backend == "postgresql"
            else []
        )
        return insert_statement(self.tables, backend), rows, notes

    @staticmethod
    def _receipts(envs: list[Envelope], app: QueueingApp) -> list[EnqueueReceipt]:
        return [
            EnqueueReceipt(
                e.message_id,
                e.tracking_id,
                e.type,
                e.queue,
                initial_status(app, e),
                e.not_before,
                e.expires_at,
            )
            for e in envs
        ]

    def enqueue(
        self, conn: Any, messages: QueueMessage | Iterable[QueueMessage], **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """On a sync ``Connection`` or ``Session``, inside its current transaction (not committed here)."""
        envs = self._build(messages, options)
        if self.app.enqueue_middleware:
            # enqueue middleware is async: run it on a private loop (not possible on a loop's thread)
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                envs = asyncio.run(self._through_middleware(envs))
            else:
                raise RuntimeError(
                    "this app has enqueue middleware (async): use `await outbox.enqueue_async(...)`"
                )
        else:
            check_sendable(envs, self.max_message_bytes, "sql")
        stmt, rows, notes = self._statements(_dialect(conn), envs)
        conn.execute(stmt, rows)
        for note in notes:
            conn.execute(note)
        return self._receipts(envs, self.app)

    async def enqueue_async(
        self, conn: Any, messages: QueueMessage | Iterable[QueueMessage], **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """On an ``AsyncConnection`` or ``AsyncSession``, inside its current transaction."""
        envs = await self._through_middleware(self._build(messages, options))
        stmt, rows, notes = self._statements(_dialect(conn), envs)
        await conn.execute(stmt, rows)
        for note in notes:
            await conn.execute(note)
        return self._receipts(envs, self.app)


def _dialect(conn: Any) -> str:
    bind = conn.get_bind() if hasattr(conn, "get_bind") else conn
    return str(bind.dialect.name)
