"""The SQL provider's side of the ops actions: single statements guarded by the state the ops
service checked, so a concurrent change makes the action a clean no-op (reported as 409)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...envelope import Envelope
from ...messages import MessageStatus
from ...tracking import MessageQuery, MessageRecord
from ...tracking.base import RETRIED_BY_OPERATOR
from .errors import db_boundary
from .rows import Lease
from .schema import archived

if TYPE_CHECKING:
    from .provider import SqlProvider

LEASED = MessageStatus.LEASED.value


async def retry(p: SqlProvider, record: MessageRecord, envelope: Envelope, now: datetime) -> bool:
    with db_boundary("an operator's retry"):
        m = p.tables.messages
        async with p.engine.begin() as conn:
            res = await conn.execute(
                sa.update(m)
                .where(m.c.message_id == record.message_id, m.c.status == record.status, archived(m, False))
                .values(
                    status=MessageStatus.PENDING.value,
                    attempt=0,
                    available_at=now,
                    not_before=None,
                    expires_at=envelope.expires_at,
                    reason=RETRIED_BY_OPERATOR,  # (as the history of the other transports says it)
                    # an idempotent type's version the operator retried runs, whatever came after it
                    superseded_by=None,
                    description=None,
                    settled_at=None,
                    locked_by=None,
                    locked_until=None,
                    updated_at=now,
                )
            )
            await p.notify_statements(conn, {record.queue})
        return res.rowcount == 1


async def cancel(p: SqlProvider, record: MessageRecord, now: datetime) -> bool:
    """Cancel a message no worker holds, guarded by the state the caller saw: it is never claimed."""
    with db_boundary("an operator's cancel"):
        m = p.tables.messages
        async with p.auto.connect() as conn:
            res = await conn.execute(
                sa.update(m)
                .where(
                    m.c.message_id == record.message_id,
                    m.c.status == record.status,
                    m.c.status != LEASED,
                    archived(m, False),
                )
                .values(status=MessageStatus.CANCELLED.value, settled_at=now, updated_at=now)
            )
        return res.rowcount == 1


async def store_progress(p: SqlProvider, lease: Lease, progress: dict[str, Any]) -> None:
    """A running handler's progress, on its row while its own lease holds it: fenced by the claim's
    token like a settlement, so a run whose lease was released or swept (the row claimed again, by this
    process or another) never writes over the progress of the run that holds it now."""
    with db_boundary("storing progress"):
        m = p.tables.messages
        async with p.claims.connect() as conn:
            await conn.execute(
                sa.update(m)
                .where(
                    m.c.id == lease.row,
                    m.c.lease_token == lease.token,
                    m.c.locked_by == p.worker_id,  # (as a settlement's: a claim by an older version)
                    m.c.status == LEASED,
                )
                .values(progress=progress)
            )


async def release(p: SqlProvider, record: MessageRecord, now: datetime) -> bool:
    """Give back the lease the operator saw (its worker's). The run holding it may go on, but the
    row's lease token moves on with the next claim, so whatever that run settles is refused."""
    with db_boundary("an operator's release"):
        m = p.tables.messages
        async with p.engine.begin() as conn:
            res = await conn.execute(
                sa.update(m)
                .where(
                    m.c.message_id == record.message_id,
                    m.c.status == LEASED,
                    m.c.locked_by == record.locked_by,
                )
                .values(
                    status=MessageStatus.PENDING.value,
                    locked_by=None,
                    locked_until=None,
                    available_at=now,
                    updated_at=now,
                )
            )
            await p.notify_statements(conn, {record.queue})
        return res.rowcount == 1


async def archive(p: SqlProvider, record: MessageRecord, now: datetime) -> bool:
    with db_boundary("an operator's archive"):
        m = p.tables.messages
        async with p.engine.begin() as conn:
            res = await conn.execute(
                sa.update(m)
                .where(m.c.message_id == record.message_id, m.c.status == record.status, archived(m, False))
                .values(archived=True, archived_at=now)
            )
        return res.rowcount == 1


async def purge(p: SqlProvider, query: MessageQuery) -> tuple[int, int]:
    """Delete what matches, except messages a worker holds right now (counted, not touched). In
    batches of the retention's size, each its own transaction: a purge of a million rows must not hold
    SQLite's one write lock (or PostgreSQL's row locks) for the whole of it while workers wait."""
    with db_boundary("a purge"):
        m = p.tables.messages
        where = [*p.tracker().where(query), m.c.status != LEASED]
        deleted = 0
        while True:
            async with p.engine.begin() as conn:
                ids = list(
                    (await conn.execute(sa.select(m.c.id).where(*where).limit(p.retention.batch))).scalars()
                )
                if ids:
                    # the conditions again on the rows themselves: PostgreSQL checks those against a row a
                    # worker claimed since it was selected (and waited for), which then stays
                    res = await conn.execute(sa.delete(m).where(m.c.id.in_(ids), *where))
                    deleted += res.rowcount or 0
            # ended by what was selected, not deleted: a batch a claim shortened is not the last one
            if len(ids) < p.retention.batch:
                break
        async with p.engine.connect() as conn:
            held = (
                await conn.execute(
                    sa.select(sa.func.count()).where(*p.tracker().where(query), m.c.status == LEASED)
                )
            ).scalar_one()
        return deleted, int(held)
