"""Idempotent message types on SQL: an enqueue equal (identity and JSON) to the waiting message of
its identity is discarded; one with a changed body replaces the waiting body; the handler's
``ctx.previous`` is the last version of its identity that succeeded."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...messages import MessageStatus, QueueMessage
from .rows import row_for
from .schema import claimable

if TYPE_CHECKING:
    from ...app import Subscription
    from ...envelope import Envelope
    from ...producer import IdempotentOutcome
    from .provider import SqlProvider


async def send(
    p: SqlProvider, envelopes: Sequence[Envelope], identities: Sequence[str]
) -> list[IdempotentOutcome]:
    """One transaction: per envelope, discard, replace the waiting body, or insert."""
    from ...producer import IdempotentOutcome
    from .provider import initial_status, insert_statement

    m = p.tables.messages
    now = p.clock()
    out: list[IdempotentOutcome] = []
    queues: set[str] = set()
    async with p.engine.begin() as conn:
        for env, key in zip(envelopes, identities, strict=True):
            if p.backend == "postgresql":
                # one enqueuer per identity at a time: two hosts cannot both find none and both insert
                await conn.execute(
                    sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"{env.type}\x1f{key}")))
                )
            waiting = (
                await conn.execute(
                    sa.select(
                        m.c.id, m.c.message_id, m.c.tracking_id, sa.cast(m.c.body, sa.Text()).label("b")
                    )
                    .where(m.c.type == env.type, m.c.identity == key, claimable())
                    .order_by(m.c.id)
                    .limit(1)
                )
            ).first()
            if waiting is not None and _same(waiting.b, env.body):
                out.append(IdempotentOutcome("discarded", waiting.message_id, waiting.tracking_id))
                continue
            if waiting is not None:
                res = await conn.execute(
                    sa.update(m)
                    .where(m.c.id == waiting.id, claimable())
                    .values(body=env.body, headers=env.headers, updated_at=now)
                )
                if res.rowcount == 1:
                    out.append(IdempotentOutcome("replaced", waiting.message_id, waiting.tracking_id))
                    continue
            row = {**row_for(env, initial_status(p._app, env), now), "identity": key}
            await conn.execute(insert_statement(p.tables, p.backend), [row])
            out.append(IdempotentOutcome("enqueued", env.message_id, env.tracking_id))
            queues.add(env.queue)
        await p.notify_statements(conn, queues)
    return out


def _same(stored: str | None, body: dict[str, Any]) -> bool:
    try:
        return stored is not None and json.loads(stored) == body
    except ValueError:
        return False


async def previous(p: SqlProvider, sub: Subscription, message: QueueMessage, key: str) -> QueueMessage | None:
    """The last version of this identity that succeeded (another message than this one)."""
    m = p.tables.messages
    async with p.engine.connect() as conn:
        text = (
            await conn.execute(
                sa.select(sa.cast(m.c.body, sa.Text()))
                .where(
                    m.c.type == sub.type_name,
                    m.c.identity == key,
                    m.c.status == MessageStatus.SUCCEEDED.value,
                    m.c.message_id != message.message_id,
                )
                .order_by(m.c.settled_at.desc(), m.c.id.desc())
                .limit(1)
            )
        ).scalar()
    if text is None:
        return None
    return sub.message_type.model_validate(json.loads(text))
