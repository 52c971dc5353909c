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
from collections.abc import Generator, Iterable, Sequence
from typing import Any

from typing_extensions import Unpack

from ...app import QueueingApp
from ...clock import Clock, utcnow
from ...envelope import Envelope
from ...messages import QueueMessage
from ...middleware import compose_enqueue
from ...producer import (
    DUPLICATE,
    EnqueueOptions,
    EnqueueReceipt,
    IdempotentOutcome,
    build_envelope,
    check_sendable,
    identities_of,
    through_middleware,
)
from . import idempotent as sql_idempotent
from .provider import added, channel_for, initial_status, insert_statement, notify_statement
from .rows import row_for
from .schema import Tables

_Plan = Generator[sql_idempotent.Step, Any, list[EnqueueReceipt]]

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

    def _items(self, messages: QueueMessage | Iterable[QueueMessage]) -> list[QueueMessage]:
        return [messages] if isinstance(messages, QueueMessage) else list(messages)

    def _build(self, items: list[QueueMessage], options: EnqueueOptions) -> list[Envelope]:
        now = self.clock()
        return [build_envelope(self.app, m, now, **options) for m in items]

    def _identities(self, items: list[QueueMessage]) -> list[str | None]:
        """Each message's identity when its type is idempotent (None otherwise), as the producer keys
        it: the outbox must find and keep the same waiting message an ``enqueue`` would."""
        return identities_of(self.app, items) or [None] * len(items)

    async def _through_middleware(self, envs: list[Envelope]) -> list[Envelope]:
        out = await through_middleware(compose_enqueue(self.app.enqueue_middleware), envs)
        check_sendable(out, self.max_message_bytes, "sql")
        return out

    def _plan(self, backend: str, envs: list[Envelope], keys: Sequence[str | None]) -> _Plan:
        """The statements of one outbox enqueue, in order, on the caller's connection. An idempotent
        type's message goes as ``enqueue`` sends it on SQL (the same plan), inside the caller's
        transaction; on PostgreSQL its identity's lock is then held to the caller's commit."""
        now = self.clock()
        plain = [(i, e) for i, e in enumerate(envs) if keys[i] is None]
        receipts: dict[int, EnqueueReceipt] = {}
        queues: set[str] = set()
        if plain:
            rows = [row_for(e, initial_status(self.app, e), now) for _, e in plain]
            # (RETURNING: a message id stored already goes nothing in, and its receipt says duplicate)
            insert = insert_statement(self.tables, backend).returning(self.tables.messages.c.message_id)
            went_in = added([e for _, e in plain], (yield insert, rows).scalars())
            for (i, e), new in zip(plain, went_in, strict=True):
                receipts[i] = self._receipt(
                    e, None if new else IdempotentOutcome(DUPLICATE, e.message_id, e.tracking_id)
                )
                if new:
                    queues.add(e.queue)
        lock = sql_idempotent.batch_lock(backend, envs, keys)
        if lock is not None:
            yield lock
        for i, env in enumerate(envs):
            key = keys[i]
            if key is not None:
                outcome = yield from sql_idempotent.plan(self.tables, backend, self.app, env, key, now)
                receipts[i] = self._receipt(env, outcome)
                if outcome.outcome == "enqueued":
                    queues.add(env.queue)
        if backend == "postgresql":
            for q in sorted(queues):
                yield notify_statement(self.channel, q), None
        return [receipts[i] for i in range(len(envs))]

    def _receipt(self, e: Envelope, sent: IdempotentOutcome | None = None) -> EnqueueReceipt:
        """As ``Producer.sent`` makes it: when not ``enqueued``, the ids are the waiting message's."""
        return EnqueueReceipt(
            sent.message_id if sent is not None else e.message_id,
            sent.tracking_id if sent is not None else e.tracking_id,
            e.type,
            e.queue,
            initial_status(self.app, e),
            e.not_before,
            e.expires_at,
            sent.outcome if sent is not None else "enqueued",
        )

    def enqueue(
        self, conn: Any, messages: QueueMessage | Iterable[QueueMessage], **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """On a sync ``Connection`` or ``Session``, inside its current transaction (not committed here)."""
        items = self._items(messages)
        envs = self._build(items, options)
        keys = self._identities(items)
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
        return sql_idempotent.run_plan(conn, self._plan(_dialect(conn), envs, keys))

    async def enqueue_async(
        self, conn: Any, messages: QueueMessage | Iterable[QueueMessage], **options: Unpack[EnqueueOptions]
    ) -> list[EnqueueReceipt]:
        """On an ``AsyncConnection`` or ``AsyncSession``, inside its current transaction."""
        items = self._items(messages)
        keys = self._identities(items)
        envs = await self._through_middleware(self._build(items, options))
        return await sql_idempotent.run_plan_async(conn, self._plan(_dialect(conn), envs, keys))


def _dialect(conn: Any) -> str:
    bind = conn.get_bind() if hasattr(conn, "get_bind") else conn
    return str(bind.dialect.name)
