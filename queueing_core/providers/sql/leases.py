"""Lease tokens for a transport that cannot fence a settlement by itself (SQS), in its side-store
database (``queueing_leases``, migration v4).

SQS accepts a delete (and a visibility change) with a receipt handle from an earlier receive of the
same message, so a run whose visibility timeout ran out could still settle a message that another
receive now holds. Each receive therefore writes a fresh token per message here (the latest receive
wins), and a settlement or renewal goes ahead only for the messages whose token is still its own:
the check and the removal are one statement, so two runs can never both pass it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from ...clock import as_utc

if TYPE_CHECKING:
    from .provider import SqlProvider

#: rows of leases nobody settled (a consumer that crashed) are pruned this long after they ended
KEEP_LAPSED = timedelta(days=1)


class LeaseToken(NamedTuple):
    key: str  # the transport's own id of the message
    token: uuid.UUID


class SqlLeaseStore:
    def __init__(self, provider: SqlProvider, transport: str) -> None:
        self.sql = provider
        self.transport = transport
        t = provider.tables.leases
        dialect_insert: Any
        if provider.backend == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as dialect_insert
        else:
            from sqlalchemy.dialects.sqlite import insert as dialect_insert
        ins = dialect_insert(t)
        self._take = ins.on_conflict_do_update(
            index_elements=[t.c.transport, t.c.message_key],
            set_={"token": ins.excluded.token, "until": ins.excluded.until},
        )
        mine = sa.and_(
            t.c.transport == transport,
            t.c.message_key.in_(sa.bindparam("keys", expanding=True)),
            sa.tuple_(t.c.message_key, t.c.token).in_(sa.bindparam("leases", expanding=True)),
        )
        self._release = sa.delete(t).where(mine).returning(t.c.message_key)
        self._extend = sa.update(t).where(mine).values(until=sa.bindparam("until")).returning(t.c.message_key)

    async def take(self, keys: Sequence[str], until: datetime) -> list[LeaseToken]:
        """A new token for each message just received; an older receive's token stops counting."""
        tokens = [LeaseToken(k, uuid.uuid4()) for k in keys]
        if tokens:
            rows = [
                {"transport": self.transport, "message_key": k, "token": t, "until": as_utc(until)}
                for k, t in tokens
            ]
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                await conn.execute(self._take, rows)
        return tokens

    async def release(self, leases: Sequence[LeaseToken]) -> set[str]:
        """End these leases; returns the keys that were still ours (the others went to a newer run)."""
        return await self._run(self._release, leases)

    async def extend(self, leases: Sequence[LeaseToken], until: datetime) -> set[str]:
        """Move these leases' end; returns the keys that were still ours."""
        return await self._run(self._extend, leases, until=as_utc(until))

    async def _run(self, stmt: Any, leases: Sequence[LeaseToken], **values: Any) -> set[str]:
        if not leases:
            return set()
        params = {"keys": [x.key for x in leases], "leases": [tuple(x) for x in leases], **values}
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            return set((await conn.execute(stmt, params)).scalars())

    async def prune(self, now: datetime) -> int:
        """Forget leases that ended long ago without a settlement (their consumer died)."""
        t = self.sql.tables.leases
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            res = await conn.execute(
                sa.delete(t).where(t.c.transport == self.transport, t.c.until < as_utc(now) - KEEP_LAPSED)
            )
        return res.rowcount or 0
