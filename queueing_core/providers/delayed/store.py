"""The delayed-message store on the kit's SQL database (``queueing_delayed``).

Messages due later than a transport can hold (RabbitMQ: any delay; SQS: beyond 15 minutes) wait
here as rows and a :class:`~.dispatcher.DelayedDispatcher` forwards them when due.

**Fetching under a lock.** :meth:`fetch_due` selects due rows ``FOR UPDATE SKIP LOCKED`` (PostgreSQL;
on SQLite the transaction is ``BEGIN IMMEDIATE``, the single writer) and, in the same transaction,
moves their due time forward by ``lease``. The row lock makes two concurrent fetches disjoint; the
moved due time keeps the row out of every other fetch after the commit, for as long as the forward
takes, without holding a transaction (and a pooled connection, and on SQLite the write lock) open
across a broker round trip. A dispatcher that dies between fetch and :meth:`remove` only delays the
message by ``lease``; then another dispatcher forwards it (at least once: a forward is never
undone, so a crash after it and before :meth:`remove` sends it twice). The dispatcher removes each
row as soon as its own forward is accepted, so a crash repeats at most the forwards in flight; each
fetch counts a claim on the row, never cleared while the row is kept (a forward that failed may have
reached the transport all the same: a publish the broker took whose confirm was lost, a send whose
answer never came), so such a repeat is known: the row comes back with ``claims`` > 1 and its
forward is marked and logged.

**The database's clock.** Due times and leases are judged on the database's time (the store's
:class:`~..sql.db_clock.DatabaseClock`: this host's clock corrected by its difference to the
database's, read at most once a minute), the one clock every host shares. On each host's own clock, a
dispatcher whose clock ran ahead forwarded a message early, a worker sent it back as not due yet, and
the dispatcher, finding it due, forwarded it again at once, for as long as the clocks differed; and a
host whose clock ran behind by more than the lease wrote leases the others read as over already. A
due time is stamped by the storing host's clock (a message's ``not_before``); a row is forwarded no
sooner than both the database's clock and the storing host's say it is due: a worker whose clock runs
behind the database's, sending a message back as not due yet, stores it until its own clock says it
is due, not for the dispatcher to forward again at once.

**Renewed while forwarded.** A dispatcher renews the lease of the rows it still forwards (see
:meth:`renew`), so a forward that outlasts the lease (a transport's SDK retrying) is not fetched by
another dispatcher, nor taken by a purge by status, while it is still under way.

Each :meth:`store` wakes the dispatchers of this process at once and, on PostgreSQL, those of other
processes through ``NOTIFY`` on the store's own channel.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from ...clock import Clock, as_utc, opt_utc, utcnow
from ...envelope import Envelope
from ...errors import ProviderError, ProviderUnavailable
from ...naming import Transport
from ..sql import errors as sql_errors
from ..sql.db_clock import DatabaseClock
from ..sql.listener import channel_name
from ..sql.provider import SqlProvider
from ..sql.schema import IN_LIST_BATCH
from .breaker import CircuitBreaker, first_line

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

log = logging.getLogger("queueing.delayed")


@contextlib.contextmanager
def db_boundary(action: str) -> Iterator[None]:
    """The SQL provider's translation of driver errors, naming the delayed store."""
    with sql_errors.db_boundary(action, store="delayed store"):
        yield


class Purged(NamedTuple):
    """What a purge of the delayed store did (see :meth:`DelayedStore.purge`)."""

    gone: set[uuid.UUID]
    forgotten: int
    #: messages whose rows stay: a dispatcher is forwarding them, or they moved on since read
    left: set[uuid.UUID]


@dataclass(frozen=True, slots=True)
class DelayedMessage:
    id: uuid.UUID
    message_id: uuid.UUID
    destination: str  # the physical queue on the transport
    due_at: datetime
    envelope: str  # the envelope's JSON text, forwarded as it is
    failures: int
    created_at: datetime
    last_error: str | None = None
    #: fetches of this row, this one included (> 1: an earlier forward of it may have reached the
    #: transport, before its dispatcher stopped or though it raised)
    claims: int = 1
    #: the lease this fetch wrote (the row's due time while it is forwarded: :meth:`renew` moves it on)
    leased_until: datetime | None = None


def channel_for(schema: str | None) -> str:
    return channel_name("queueing_delayed", schema)


class SqlDelayedStore:
    def __init__(
        self,
        sql: SqlProvider,
        transport: Transport,
        *,
        clock: Clock = utcnow,
        lease: timedelta = timedelta(seconds=60),
        store_breaker: CircuitBreaker | None = None,
    ) -> None:
        self.sql = sql
        self.transport = transport
        #: due times and leases are judged on the database's time (see the module's note), as the SQL
        #: provider's leases: the host's own clock (the default) is corrected by the database's, a
        #: ``DatabaseClock`` passed keeps its correction, and a plain callable is used as it is (tests
        #: move it to travel in time; corrected, a clock moved ahead was measured against the real one
        #: and nothing it stored came due)
        self.db_clock: DatabaseClock | None
        if isinstance(clock, DatabaseClock):
            self.clock, self.db_clock = clock.host, clock
        else:
            self.clock, self.db_clock = clock, DatabaseClock(clock) if clock is utcnow else None
        self.lease = lease
        self.store_breaker = store_breaker or CircuitBreaker("delayed store (store)")
        self.channel = channel_for(sql.tables.metadata.schema)
        self._wakers: set[Callable[[], None]] = set()

    @property
    def _t(self) -> sa.Table:
        return self.sql.tables.delayed

    @property
    def is_postgres(self) -> bool:
        return self.sql.backend == "postgresql"

    # -- wake-ups ----------------------------------------------------------------------------------
    def add_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.add(wake)

    def remove_waker(self, wake: Callable[[], None]) -> None:
        self._wakers.discard(wake)

    def _wake(self) -> None:
        for wake in list(self._wakers):
            wake()

    async def close(self) -> None:
        self._wakers.clear()

    # -- the database's clock ----------------------------------------------------------------------
    async def database_time(self) -> datetime:
        """The database's time now: this host's clock corrected by the difference to the database's,
        read again first when that is due (a failed reading keeps the last difference)."""
        clock = self.db_clock
        if clock is None:
            return as_utc(self.clock())
        if clock.due():
            try:
                await self.sql.ensure_open()
                async with self.sql.engine.connect() as conn:
                    before = clock.host()
                    value = (await conn.execute(self.sql.statements.database_now)).scalar_one()
                    after = clock.host()
            except Exception as exc:
                clock.failed()
                log.warning("could not read the database's clock (%s); will try again", first_line(exc))
            else:
                at = value if isinstance(value, datetime) else datetime.fromisoformat(value)
                clock.correct(as_utc(at), as_utc(before), as_utc(after))
        return self.now()

    def now(self) -> datetime:
        """The database's time by the difference last read (no round trip)."""
        return as_utc(self.clock() if self.db_clock is None else self.db_clock())

    # -- the seed's operations ---------------------------------------------------------------------
    async def store(self, envelope: Envelope, destination: str, due: datetime) -> uuid.UUID:
        """Keep ``envelope`` until ``due``, then it goes to ``destination`` (a physical queue)."""
        return (await self.store_many([(envelope, destination, due)]))[0]

    async def store_many(self, items: Sequence[tuple[Envelope, str, datetime]]) -> list[uuid.UUID]:
        wait = self.store_breaker.blocked()
        if wait > 0:
            # fail fast while the breaker is open: the caller keeps its message and retries later
            raise ProviderUnavailable(
                f"the delayed store is failing (circuit breaker open); next try in {wait:.1f}s"
            )
        now = self.clock()
        if items:
            await self.database_time()
        # a host behind the database's clock: its due times fall that much later on the database's, so
        # a worker that sends a message back as not due yet gets it when its own clock says it is due
        # (a host ahead keeps its own: the database's clock reaches it later still)
        behind = max(self.db_clock.offset, timedelta(0)) if self.db_clock is not None else timedelta(0)
        ids = [uuid.uuid4() for _ in items]
        rows = [
            {
                "id": id,
                "message_id": env.message_id,
                "transport": self.transport.value,
                "destination": destination,
                "due_at": _later(as_utc(due), behind),
                "envelope": env.encode_text(),
                "failures": 0,
                "created_at": now,
            }
            for id, (env, destination, due) in zip(ids, items, strict=True)
        ]
        if not rows:
            return []
        try:
            with db_boundary(f"storing {len(rows)} delayed message(s)"):
                await self.sql.ensure_open()
                async with self.sql.engine.begin() as conn:
                    await conn.execute(self._t.insert(), rows)
                    if self.is_postgres:  # delivered at commit, to every listening dispatcher
                        await conn.execute(sa.select(sa.func.pg_notify(self.channel, self.transport.value)))
        except ProviderError as exc:
            self.store_breaker.failure(exc)
            raise
        self.store_breaker.success()
        self._wake()
        return ids

    async def fetch_next_due(self, now: datetime | None = None) -> DelayedMessage | None:
        """The oldest due message, taken so that no other dispatcher gets it (see the module doc)."""
        found = await self.fetch_due(now, limit=1)
        return found[0] if found else None

    async def fetch_due(self, now: datetime | None = None, *, limit: int = 50) -> list[DelayedMessage]:
        """Take up to ``limit`` rows due at ``now`` (the database's time, read when not given) under a
        lease of ``lease``; each message's ``leased_until`` says to what time."""
        t = self._t
        at = as_utc(now or await self.database_time())
        until = at + self.lease
        stmt = (
            sa.select(t)
            .where(t.c.transport == self.transport.value, t.c.due_at <= at)
            .order_by(t.c.due_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        with db_boundary("fetching due delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                rows = (await conn.execute(stmt)).all()
                if rows:
                    await conn.execute(
                        sa.update(t)
                        .where(t.c.id.in_([r.id for r in rows]))
                        .values(due_at=until, claims=t.c.claims + 1)
                    )
        return [_message(r, claimed=True, until=until) for r in rows]

    async def renew(self, ids: Sequence[uuid.UUID], held_until: datetime) -> tuple[set[uuid.UUID], datetime]:
        """Move the lease of the rows ``ids`` still forwarded on to ``lease`` from now: only those whose
        due time is still ``held_until``, the lease their fetch (or the last renewal) wrote; a row
        given back (a failed forward's retry time), made an operator's copy, fetched again by another
        dispatcher after the lease ended, or removed is left as it is. Returns the rows renewed and
        their new lease."""
        t = self._t
        until = await self.database_time() + self.lease
        renewed: set[uuid.UUID] = set()
        with db_boundary("renewing the lease of delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                for start in range(0, len(ids), IN_LIST_BATCH):
                    part = list(ids[start : start + IN_LIST_BATCH])
                    res = await conn.execute(
                        sa.update(t)
                        .where(t.c.id.in_(part), t.c.due_at == as_utc(held_until))
                        .values(due_at=until)
                        .returning(t.c.id)
                    )
                    renewed |= {r[0] for r in res.all()}
        return renewed, until

    async def remove(self, id: uuid.UUID) -> bool:
        """True when the row was removed; False when it was already gone."""
        return await self.remove_many([id]) == 1

    async def remove_many(self, ids: Sequence[uuid.UUID]) -> int:
        if not ids:
            return 0
        with db_boundary("removing delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                res = await conn.execute(sa.delete(self._t).where(self._t.c.id.in_(list(ids))))
        return res.rowcount or 0

    async def increment_failure(
        self, id: uuid.UUID, *, error: str | None = None, retry_at: datetime | None = None
    ) -> bool:
        """Count a failed forward (and make it due again at ``retry_at``); False if it is gone."""
        t = self._t
        # the claims stay: the forward that failed may have reached the transport (see the module)
        values: dict[str, Any] = {"failures": t.c.failures + 1}
        if error is not None:
            values["last_error"] = error[:4000]
        if retry_at is not None:
            values["due_at"] = as_utc(retry_at)
        with db_boundary("counting a failed forward"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                res = await conn.execute(sa.update(t).where(t.c.id == id).values(**values))
        return res.rowcount == 1

    async def release(self, id: uuid.UUID, due: datetime) -> bool:
        """Make a fetched message due again at ``due`` without counting a failure."""
        t = self._t
        with db_boundary("releasing a delayed message"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                res = await conn.execute(
                    # the claims stay: the forward given up may have reached the transport
                    sa.update(t).where(t.c.id == id).values(due_at=as_utc(due))
                )
        return res.rowcount == 1

    async def next_due(self) -> datetime | None:
        """When the next message falls due (it may be now or past), or None when the store is empty."""
        t = self._t
        stmt = sa.select(sa.func.min(t.c.due_at)).where(t.c.transport == self.transport.value)
        with db_boundary("reading the next due time"):
            await self.sql.ensure_open()
            async with self.sql.engine.connect() as conn:
                value = (await conn.execute(stmt)).scalar()
        return opt_utc(value)

    # -- for the ops actions -----------------------------------------------------------------------
    async def take_message(
        self, message_id: uuid.UUID, *, rows: Sequence[uuid.UUID] | None = None
    ) -> list[DelayedMessage]:
        """Remove and return the stored copies of a message (an operator brings it forward): only the
        rows ``rows`` when given (those :meth:`copies` found before the copy was sent: a row stored
        since, the copy's own retry, must stay), else every one."""
        t = self._t
        cond = [t.c.message_id == message_id, t.c.transport == self.transport.value]
        if rows is not None:
            if not rows:
                return []
            cond.append(t.c.id.in_(list(rows)))
        stmt = sa.delete(t).where(*cond).returning(*t.c)
        with db_boundary("taking a delayed message"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                found = (await conn.execute(stmt)).all()
        return [_message(r) for r in found]

    async def hold(
        self,
        rows: Sequence[uuid.UUID],
        envelope: Envelope,
        then: Callable[[AsyncConnection], Awaitable[None]] | None = None,
    ) -> int:
        """Make ``rows`` the copy an operator sends next to bring their message forward: ``envelope``
        (its fresh attempts) in place of theirs, due once ``lease`` has passed, a claim counted on each
        as a fetch does, for that send is a forward of them. A bring-forward that stops after this (its
        send failed, its process died, its :meth:`take_message` failed) leaves the rows to come back
        when the lease ends, not when their delay was due, as the operator's copy: a forward of them
        then is known as a repeat, and a host that finds that copy's success recorded completes it
        without running it. (A dispatcher that fetched a row just before may still forward it, as it
        would have: a duplicate.) ``then`` runs in the same transaction once a row was held (the
        history reopened: it must say what the rows now are); an error it raises undoes the hold.
        Returns the rows held."""
        if not rows:
            return 0
        t = self._t
        until = await self.database_time() + self.lease
        with db_boundary("holding delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                res = await conn.execute(
                    sa.update(t)
                    .where(t.c.id.in_(list(rows)))
                    .values(
                        due_at=until,
                        envelope=envelope.encode_text(),
                        claims=t.c.claims + 1,
                        # a fresh copy: the forward tries before it is dead-lettered start again
                        failures=0,
                        last_error=None,
                    )
                )
                held = res.rowcount or 0
                if held and then is not None:
                    await then(conn)
                if self.is_postgres:  # every dispatcher looks again: these rows are due sooner now
                    await conn.execute(sa.select(sa.func.pg_notify(self.channel, self.transport.value)))
        self._wake()
        return held

    async def copies(self, message_id: uuid.UUID) -> list[uuid.UUID]:
        """The ids of the rows that hold a copy of the message now (none: it is not waiting here)."""
        t = self._t
        stmt = sa.select(t.c.id).where(t.c.message_id == message_id, t.c.transport == self.transport.value)
        with db_boundary("looking for a delayed message"):
            await self.sql.ensure_open()
            async with self.sql.engine.connect() as conn:
                return [r[0] for r in (await conn.execute(stmt)).all()]

    async def holds(self, message_id: uuid.UUID) -> bool:
        """Whether a copy of the message waits here."""
        t = self._t
        stmt = sa.select(t.c.id).where(t.c.message_id == message_id, t.c.transport == self.transport.value)
        with db_boundary("looking for a delayed message"):
            await self.sql.ensure_open()
            async with self.sql.engine.connect() as conn:
                return (await conn.execute(stmt.limit(1))).first() is not None

    async def purge(
        self,
        destination: str,
        message_ids: Sequence[uuid.UUID] | None = None,
        *,
        history_while: Sequence[str] = (),
    ) -> Purged:
        """Delete what waits for ``destination`` (only ``message_ids`` when given); returns the
        message ids deleted, how many history records went with them, and the ids whose rows stay.
        With ``message_ids``, a row a dispatcher is forwarding stays (fetched, its lease not ended;
        or given back after a forward that failed but may have reached the transport): deleted, its
        message was reported gone and its history with it, and ran all the same when the forward
        landed. With
        ``history_while``, the
        history records of the messages deleted go in the same transaction while their status is one
        of those (where the history shares this database, RabbitMQ's and SQS's): a purge that stopped
        between the two, or whose answer was lost, would leave history for a message no store holds,
        which no later purge could find. With both, only the rows of messages whose history still
        says so go: a row whose message moved on since the purge read it (an operator's retry made it
        the copy it brings forward, and reopened its history) stays, to be forwarded."""
        t = self._t
        cond = [t.c.transport == self.transport.value, t.c.destination == destination]
        # (on the database's clock, as the lease was written: a purging host's own clock ahead by more
        # than the lease read every forward's lease as over)
        forwarding = sa.and_(t.c.claims > 0, t.c.due_at > await self.database_time())
        given = list(message_ids) if message_ids is not None else None
        # bound values per statement: bounded (PostgreSQL takes 65,535 at most)
        parts = (
            [None]
            if given is None
            else [given[i : i + IN_LIST_BATCH] for i in range(0, len(given), IN_LIST_BATCH)]
        )
        with db_boundary("purging delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.begin() as conn:
                gone: list[uuid.UUID] = []
                left: set[uuid.UUID] = set()
                h = self.sql.tables.history
                for part in parts:
                    where = cond if part is None else [*cond, t.c.message_id.in_(part)]
                    # (a purge by status leaves a row being forwarded, to land and run; one of the whole
                    # queue takes it: left, a forward that landed before the queue was emptied would
                    # leave its history behind a message that is nowhere, which no purge could clear)
                    taken = [*where] if part is None else [*where, sa.not_(forwarding)]
                    if part is not None and history_while:
                        still = sa.select(h.c.message_id).where(
                            h.c.message_id.in_(part), h.c.status.in_(list(history_while))
                        )
                        taken.append(t.c.message_id.in_(still))
                    rows = (await conn.execute(sa.delete(t).where(*taken).returning(t.c.message_id))).all()
                    gone += [r[0] for r in rows]
                    # what stays of them (being forwarded, or moved on since the purge read them)
                    left |= {r[0] for r in await conn.execute(sa.select(t.c.message_id).where(*where))}
                forgotten = 0
                for start in range(0, len(gone) if history_while else 0, IN_LIST_BATCH):
                    part = gone[start : start + IN_LIST_BATCH]
                    res = await conn.execute(
                        sa.delete(h).where(h.c.message_id.in_(part), h.c.status.in_(list(history_while)))
                    )
                    forgotten += res.rowcount or 0
        return Purged(set(gone), forgotten, left)

    async def counts(self) -> dict[str, int]:
        """Messages waiting per destination."""
        t = self._t
        stmt = (
            sa.select(t.c.destination, sa.func.count())
            .where(t.c.transport == self.transport.value)
            .group_by(t.c.destination)
        )
        with db_boundary("counting delayed messages"):
            await self.sql.ensure_open()
            async with self.sql.engine.connect() as conn:
                rows = (await conn.execute(stmt)).all()
        return {str(r[0]): int(r[1]) for r in rows}


def _later(due: datetime, by: timedelta) -> datetime:
    try:
        return due + by
    except OverflowError:  # a due time near the end of time: later still is no different
        return due


def _message(r: Any, *, claimed: bool = False, until: datetime | None = None) -> DelayedMessage:
    return DelayedMessage(
        id=r.id,
        message_id=r.message_id,
        destination=r.destination,
        due_at=as_utc(r.due_at),
        envelope=r.envelope,
        failures=r.failures,
        created_at=as_utc(r.created_at),
        last_error=r.last_error,
        claims=r.claims + 1 if claimed else r.claims,
        leased_until=until,
    )
