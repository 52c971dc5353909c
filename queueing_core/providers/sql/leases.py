"""Lease tokens for a transport that cannot fence a settlement by itself (SQS), in its side-store
database (``queueing_leases``, migration v4).

SQS accepts a delete (and a visibility change) with a receipt handle from an earlier receive of the
same message, so a run whose visibility timeout ran out could still settle a message that another
receive now holds. Each receive therefore writes a fresh token per message here (the latest receive
wins), and a settlement or renewal goes ahead only for the messages whose token is still its own.
A settlement leaves the token in place (see :meth:`SqlLeaseStore.holding`).

"The latest receive" is the one SQS handed the message to last, not the one whose write landed
last: a receive whose write stalls (a paused process, a slow database) past its visibility timeout
would otherwise overwrite the token of the receive that holds the message now, and the stale run
would settle while the live one is refused. So a token carries the receive's count (SQS's
``ApproximateReceiveCount``, which grows with each receive of a message) in its top 48 bits: a
UUIDv8 (RFC 9562's layout for custom contents) whose remaining bits are the time it was made and a
few random ones (see :func:`counted_token`), so tokens compare, as PostgreSQL's ``uuid`` and the 32
hex digits SQLite stores both do, by receive count first and then by when the receive came back. The
upsert replaces a token only with a greater one; a receive whose write is not applied is stale and
must not run (``take`` returns None for it). No column was added for the count: the token is opaque
everywhere else, and a fencing token that grows with each claim is what it is for.

A row an older version wrote holds a random (version 4) token, which need not compare below a new
one: such a row is replaced as before (the last write wins, compared and swapped in the same
transaction), so a message received before an upgrade is not refused for ever.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from ...clock import as_utc, utcnow

if TYPE_CHECKING:
    from .provider import SqlProvider

#: a lease's row is pruned this long after the lease ended, settled or not (a settled one stays the
#: message's fence meanwhile: a receive whose write stalled until after the settlement is refused)
KEEP_LAPSED = timedelta(days=1)


#: the token's bits below the receive count: version, variant, the time and 12 random bits
_COUNT_SHIFT = 80
_MAX_COUNT = (1 << 48) - 1
#: RFC 9562's version for custom layouts: a token that carries a receive count
COUNTED = 8


class LeaseToken(NamedTuple):
    key: str  # the transport's own id of the message
    token: uuid.UUID


def counted_token(receive_count: int) -> uuid.UUID:
    """A fresh token that compares above every token of a lower receive count, and among tokens of
    the same count above those made earlier (and is unique).

    Below the count: the version nibble, then the time in microseconds (62 bits, split around the
    variant bits) and 12 random bits. Two receives SQS reports with the same count (its rare duplicate
    delivery) are then ordered by when they came back, the later one holding the message, as the last
    write did before counts were compared; random bits there would drop the later receive half the
    time and leave the fence with the earlier one."""
    micros = time.time_ns() // 1000 & ((1 << 62) - 1)
    low = (COUNTED << 76) | ((micros >> 50) << 64) | (0x2 << 62)  # version, time's top 12, variant
    low |= (micros & ((1 << 50) - 1)) << 12 | int.from_bytes(os.urandom(2), "big") & 0xFFF
    return uuid.UUID(int=(max(0, min(receive_count, _MAX_COUNT)) << _COUNT_SHIFT) | low)


def receive_count_of(token: uuid.UUID) -> int | None:
    """The receive count a token carries; None for an older version's random token."""
    return token.int >> _COUNT_SHIFT if token.version == COUNTED else None


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
        # only a later receive replaces a token (see the module's text); RETURNING names the rows this
        # statement wrote, inserted or replaced, so the receives whose write was not applied are known
        self._take = ins.on_conflict_do_update(
            index_elements=[t.c.transport, t.c.message_key],
            set_={"token": ins.excluded.token, "until": ins.excluded.until},
            where=t.c.token < ins.excluded.token,
        ).returning(t.c.message_key, t.c.token)
        self._held = sa.select(t.c.message_key, t.c.token).where(
            t.c.transport == transport, t.c.message_key.in_(sa.bindparam("keys", expanding=True))
        )
        self._swap = (
            sa.update(t)
            .where(
                t.c.transport == transport,
                t.c.message_key == sa.bindparam("key"),
                t.c.token == sa.bindparam("held"),
            )
            .values(token=sa.bindparam("token"), until=sa.bindparam("until"))
        )
        mine = sa.and_(
            t.c.transport == transport,
            t.c.message_key.in_(sa.bindparam("keys", expanding=True)),
            sa.tuple_(t.c.message_key, t.c.token).in_(sa.bindparam("leases", expanding=True)),
        )
        # the pairs, not the keys: two receives of one message (a lapsed one and the one holding it
        # now) share the key, and a check by key let the stale one pass beside the live one in a batch
        self._holding = sa.select(t.c.message_key, t.c.token).where(mine)
        self._extend = (
            sa.update(t).where(mine).values(until=sa.bindparam("until")).returning(t.c.message_key, t.c.token)
        )

    async def take(self, received: Sequence[tuple[str, int]], until: datetime) -> list[LeaseToken | None]:
        """A new token for each message just received, as ``(key, receive count)``: an earlier
        receive's token stops counting. None for a receive that is itself stale: a receive with a
        higher count (SQS handed the message on since) wrote its token first. It must not run."""
        tokens = [LeaseToken(k, counted_token(n)) for k, n in received]
        if not tokens:
            return []
        rows = [
            {"transport": self.transport, "message_key": k, "token": t, "until": as_utc(until)}
            for k, t in tokens
        ]
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            written = {(k, t) for k, t in (await conn.execute(self._take, rows)).all()}
            refused = [x for x in tokens if tuple(x) not in written]
            if refused:
                keys = [x.key for x in refused]
                held = dict((await conn.execute(self._held, {"keys": keys})).all())
                for x in refused:
                    old = held.get(x.key)
                    if old is not None and receive_count_of(old) is None:
                        # an older version's random token: replaced as it was before, last write wins
                        swap = {"key": x.key, "held": old, "token": x.token, "until": as_utc(until)}
                        if (await conn.execute(self._swap, swap)).rowcount:
                            written.add((x.key, x.token))
        return [x if tuple(x) in written else None for x in tokens]

    async def writable(self) -> None:
        """Raises unless the store takes a lease write now: a row written and deleted again in one
        transaction, as a lease is (a read-only server refuses the statement, a locked SQLite file its
        ``BEGIN IMMEDIATE``, a full disk or a trigger the row; a statement that wrote no row passed a
        store that refused every row: review)."""
        t = self.sql.tables.leases
        probe = {"transport": self.transport, "message_key": f"~probe-{uuid.uuid4()}", "token": uuid.uuid4()}
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            await conn.execute(sa.insert(t).values(**probe, until=utcnow()))
            await conn.execute(
                sa.delete(t).where(t.c.transport == self.transport, t.c.message_key == probe["message_key"])
            )

    async def count(self, keys: Sequence[str], now: datetime) -> dict[str, int]:
        """Count one more for each key, kept as a counted token (see :func:`counted_token`), and return
        each key's count *before* this one. RabbitMQ counts its hand-outs of redelivered copies here:
        its classic queues count no deliveries themselves. One holder per key at a time (a message is
        delivered to one consumer at once); the row is pruned like a lapsed lease's."""
        if not keys:
            return {}
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            held = dict((await conn.execute(self._held, {"keys": list(keys)})).all())
            before = {k: receive_count_of(held[k]) or 0 if k in held else 0 for k in keys}
            rows = [
                {
                    "transport": self.transport,
                    "message_key": k,
                    "token": counted_token(n + 1),
                    "until": as_utc(now),
                }
                for k, n in before.items()
            ]
            await conn.execute(self._take, rows)
        return before

    async def holding(self, leases: Sequence[LeaseToken]) -> set[LeaseToken]:
        """Those of these leases that are still ours (the others went to a newer receive). A caller
        tests the lease itself, key and token, for membership: a stale receive of a message shares
        its key with the live one, which may be in the same batch.

        A settlement asks this, and leaves the row as it is: the token stays the message's fence after
        the settlement, until :meth:`prune` (a day after its lease ended). Deleted at the settlement, a
        receive of the same message whose write stalled until then would find no row, write its
        older token, and run a message already settled; and the settling run's own renewals would be
        refused while its copy and delete were still on their way, so another receive could take the
        message in between. A settlement that fails is tried again under the same token."""
        return await self._run(self._holding, leases)

    async def extend(self, leases: Sequence[LeaseToken], until: datetime) -> set[LeaseToken]:
        """Move these leases' end; returns those that were still ours (as :meth:`holding`)."""
        return await self._run(self._extend, leases, until=as_utc(until))

    async def _run(self, stmt: Any, leases: Sequence[LeaseToken], **values: Any) -> set[LeaseToken]:
        if not leases:
            return set()
        params = {"keys": [x.key for x in leases], "leases": [tuple(x) for x in leases], **values}
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            return {LeaseToken(k, t) for k, t in (await conn.execute(stmt, params)).all()}

    async def prune(self, now: datetime) -> int:
        """Forget leases that ended long ago, settled or not (a consumer that died settled nothing)."""
        t = self.sql.tables.leases
        await self.sql.ensure_open()
        async with self.sql.engine.begin() as conn:
            res = await conn.execute(
                sa.delete(t).where(t.c.transport == self.transport, t.c.until < as_utc(now) - KEEP_LAPSED)
            )
        return res.rowcount or 0
