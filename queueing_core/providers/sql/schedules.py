"""Schedule ticks in SQL: a row per (schedule, tick), unique, so one host claims each tick.

- The SQL transport (``transactional``): the tick's row and its messages' rows are inserted in one
  transaction. A host that dies mid-way committed neither, so the tick is still free and the next
  round (on any host, or this one after a restart) runs it: never lost, never doubled.
- RabbitMQ and SQS (the side database): the row is inserted as ``claimed`` with a lease, the messages
  are sent, then the row is marked ``sent``. A host that dies between the two leaves a claimed row
  whose lease lapses; the next round takes it over (a conditional update, so one host wins) and sends
  again with the same message ids: a possible duplicate with the same id, never a lost tick.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...clock import as_utc
from .idempotent import batch_lock, plan, run_plan_async
from .provider import insert_statement

if TYPE_CHECKING:
    from ...envelope import Envelope
    from ...producer import IdempotentOutcome
    from ...schedules import Announce, Send
    from .provider import SqlProvider

CLAIMED = "claimed"
SENT = "sent"


def _insert_ignoring(provider: SqlProvider) -> Any:
    t = provider.tables.ticks
    insert: Any
    if provider.backend == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # RETURNING tells whether the row went in (the driver's rowcount may be -1 for an INSERT)
    return insert(t).on_conflict_do_nothing(index_elements=[t.c.schedule, t.c.tick_at]).returning(t.c.tick_at)


class SqlTickStore:
    def __init__(
        self, provider: SqlProvider, *, transactional: bool, lease: timedelta = timedelta(seconds=30)
    ) -> None:
        self.provider = provider
        #: the tick's messages are written by this store, with the tick (the SQL transport)
        self.writes_messages = transactional
        self.lease = lease

    @property
    def _t(self) -> sa.Table:
        return self.provider.tables.ticks

    async def last_ticks(self, names: Sequence[str]) -> dict[str, datetime]:
        if not names:
            return {}
        t = self._t
        await self.provider.ensure_open()
        async with self.provider.auto.connect() as conn:
            rows = await conn.execute(
                sa.select(t.c.schedule, sa.func.max(t.c.tick_at))
                .where(t.c.schedule.in_(list(names)))
                .group_by(t.c.schedule)
            )
            return {name: as_utc(tick) for name, tick in rows}

    async def unfinished(self, schedule: str, now: datetime) -> list[datetime]:
        if self.writes_messages:
            return []  # a tick and its messages commit together: nothing is ever half done
        t = self._t
        await self.provider.ensure_open()
        async with self.provider.auto.connect() as conn:
            rows = await conn.execute(
                sa.select(t.c.tick_at)
                .where(t.c.schedule == schedule, t.c.state == CLAIMED, t.c.claimed_until <= now)
                .order_by(t.c.tick_at)
            )
            return [as_utc(r) for r in rows.scalars()]

    async def fire(
        self,
        schedule: str,
        tick: datetime,
        envelopes: Sequence[Envelope],
        send: Send,
        now: datetime,
        identities: Sequence[str | None] = (),
        announce: Announce | None = None,
    ) -> bool:
        p = self.provider
        await p.ensure_open()
        row = {"schedule": schedule, "tick_at": tick, "messages": len(envelopes), "fired_at": now}
        if self.writes_messages:
            keys = list(identities) or [None] * len(envelopes)
            plain = [e for e, k in zip(envelopes, keys, strict=True) if k is None]
            outcomes: dict[int, IdempotentOutcome] = {}
            async with p.engine.begin() as conn:
                claimed = await conn.execute(_insert_ignoring(p), {**row, "state": SENT})
                if claimed.first() is None:
                    return False
                if plain:
                    await conn.execute(insert_statement(p.tables, p.backend), p.rows_for(plain, now))
                lock = batch_lock(p.backend, envelopes, keys)
                if lock is not None:  # (in the one order every enqueue takes them)
                    await conn.execute(lock[0])
                for i, (env, identity) in enumerate(zip(envelopes, keys, strict=True)):
                    if identity is not None:
                        # an idempotent type's message goes through its identity, as any enqueue of it:
                        # a row without one is invisible to the next enqueue and to ctx.previous
                        outcomes[i] = await run_plan_async(
                            conn, plan(p.tables, p.backend, p._app, env, identity, now)
                        )
                if envelopes:
                    await p.notify_statements(conn, {e.queue for e in envelopes})
            if announce is not None and envelopes:
                await announce(outcomes)
            return True
        if not await self._claim(row, now):
            return False
        t = self._t
        key = (t.c.schedule == schedule) & (t.c.tick_at == tick)
        try:
            await send(envelopes)
        except BaseException:
            async with p.auto.connect() as conn:  # lapse the claim now: the next round sends it again
                await conn.execute(sa.update(t).where(key, t.c.state == CLAIMED).values(claimed_until=now))
            raise
        async with p.auto.connect() as conn:
            await conn.execute(sa.update(t).where(key).values(state=SENT, claimed_until=None))
        return True

    async def _claim(self, row: dict[str, Any], now: datetime) -> bool:
        t = self._t
        until = now + self.lease
        async with self.provider.auto.connect() as conn:
            inserted = await conn.execute(
                _insert_ignoring(self.provider), {**row, "state": CLAIMED, "claimed_until": until}
            )
            if inserted.first() is not None:
                return True
            # a lapsed claim of a host that died: one host's conditional update takes it over
            taken = await conn.execute(
                sa.update(t)
                .where(
                    t.c.schedule == row["schedule"],
                    t.c.tick_at == row["tick_at"],
                    t.c.state == CLAIMED,
                    t.c.claimed_until <= now,
                )
                .values(claimed_until=until, fired_at=now, messages=row["messages"])
            )
            return bool(taken.rowcount == 1)

    async def prune(self, before: datetime) -> int:
        """Delete ticks older than ``before``, keeping each schedule's newest (its place in time)."""
        t = self._t
        other = t.alias("newer")
        newer = sa.exists().where(other.c.schedule == t.c.schedule, other.c.tick_at > t.c.tick_at)
        await self.provider.ensure_open()
        async with self.provider.engine.begin() as conn:
            result = await conn.execute(sa.delete(t).where(t.c.tick_at < before, t.c.state == SENT, newer))
            return int(result.rowcount or 0)
