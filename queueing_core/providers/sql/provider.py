"""The SQL provider: durable rows, atomic batch claims, leases, wake-ups, retention.

- Claim: one ``UPDATE ... FROM (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED) RETURNING`` per batch
  (PostgreSQL skips rows other workers are claiming; SQLite's single writer makes it atomic). Paused
  queues/types and types whose circuit holds work are filtered in the claim itself, so a pause or an
  open circuit never hands out (or burns) an attempt, and a held backlog is not claimed over and over.
- Finalize: every claim sets a new lease token on the row, and every settlement, renewal and release
  is an UPDATE guarded by that token (and ``status = 'Leased'``), so a run whose lease expired or was
  released never overwrites the outcome of the run that holds it now, even in the same process.
- Hot path: claims, renewals and settlements run on the driver's own connection, the statements
  compiled once from the Core definitions in ``statements``; a settlement batch is one round trip and
  one commit: pipelined and prepared on psycopg (see ``driver``), one call in aiosqlite's thread on
  SQLite (see ``sqlite_driver``). With durable claims and ``settle_with_claims``, a settlement batch
  and the next claim go in one call too (``settle_and_receive``): one commit for both, or neither.
- Wake-ups: ``pg_notify`` in the enqueuing transaction, one LISTEN connection per worker; the worker's
  adaptive polling is the fallback (and the only mechanism on SQLite across processes).
- Maintenance (every few seconds, safe to run on every host at once): expired leases back to retry
  (or Abandoned, per queue), expired waiting rows to Expired, auto-archive, retention deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from ...clock import Clock, as_utc
from ...control.base import CANCEL_KEPT
from ...decisions import Complete, DeadLetter, DeadLetterReason, Defer, Expire, Release, RetryAfter
from ...envelope import Envelope
from ...errors import ConfigurationError, NotConfigured, ProviderUnavailable, first_line
from ...messages import MessageStatus
from ...naming import Transport
from ...producer import IdempotentOutcome, identity_of
from ...runtime import default_worker_id, jsonable
from ...tracking import MessageQuery, MessageRecord, Reopen, nothing_to_reopen
from ...transport import Capabilities, Delivery, Settlement
from . import idempotent as sql_idempotent
from . import ops as sql_ops
from .control import CANCEL_PREFIX, SqlControlStore
from .db_clock import DatabaseClock
from .driver import Compiled, DriverPath, HotStatements, Result
from .engine import create_engine, normalize_url, redact
from .entra import DatabaseAuth, EntraPassword, uses_entra
from .errors import db_boundary, down_errors
from .listener import PgListener, channel_name
from .retention import RetentionPolicy
from .rows import Lease, copy_rows, delivery_from_row, row_for, unnest_params
from .schema import DONE_PREFIX, LATEST, Tables, current_version, done_channel_for, migrate
from .sqlite_driver import SqliteCompiled, SqliteDriverPath, named_dialect
from .statements import Statements, bind, claim_params, leases_of
from .statements import notify_statement as notify_statement  # the outbox's wake-ups
from .tracker import SqlTracker

if TYPE_CHECKING:
    from ...app import QueueingApp, Subscription
    from ...messages import QueueMessage
    from .schedules import SqlTickStore

log = logging.getLogger("queueing.sql")

LEASED = MessageStatus.LEASED.value
#: from this many rows, enqueue_many uses COPY (below, one INSERT statement is cheaper)
COPY_FROM = 64


def initial_status(app: QueueingApp | None, env: Envelope) -> str:
    if env.not_before is not None:
        return MessageStatus.SLEEPING.value
    sub = app.subscription(env.type) if app is not None else None
    return sub.options.default_status if sub is not None else MessageStatus.PENDING.value


def added(envelopes: Sequence[Envelope], inserted: Iterable[UUID] | None) -> list[bool]:
    """Of each envelope, whether its row went in, from the message ids the insert returned (None: all
    of them). A message id the table held already went nothing in; one twice in a batch went in once,
    the first time."""
    if inserted is None:
        return [True] * len(envelopes)
    left = set(inserted)
    out = []
    for env in envelopes:
        out.append(env.message_id in left)
        left.discard(env.message_id)
    return out


def insert_statement(tables: Tables, backend: str) -> sa.Insert:
    """INSERT that ignores a message id already present: enqueue is idempotent per message id,
    so a producer that retries after an unclear failure adds nothing."""
    t = tables.messages
    dialect_insert: Any
    if backend == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    stmt: sa.Insert = dialect_insert(t).on_conflict_do_nothing(index_elements=[t.c.message_id])
    return stmt


def _inserted(answer: Any) -> set[UUID]:
    """The message ids the PostgreSQL ``insert_unnest`` put in (its rows: a queue woken, its ids)."""
    return {UUID(str(mid)) for row in answer for mid in row.ids}


def _many(backend: str, deliveries: Sequence[Delivery], **values: Any) -> dict[str, Any]:
    """Parameters of a statement on many leased rows: their ids and their (id, token) fences."""
    leases: list[Lease] = [d.handle for d in deliveries]
    return {**leases_of(backend, [x.row for x in leases], [x.token for x in leases]), **bind(**values)}


def _deliveries(rows: Sequence[Any]) -> list[Delivery]:
    deliveries = [delivery_from_row(r) for r in rows]
    deliveries.sort(key=lambda d: d.handle)
    return deliveries


def _mark_refused(refused: Sequence[Delivery]) -> None:
    for d in refused:
        d.refused = True
    if refused:
        # (or, after a combined call that committed but whose caller stopped waiting for it, an
        # earlier try of the same settlements, committed with that claim: settled again, refused)
        log.warning(
            "%d outcome(s) not recorded: their lease had passed to another run, or an earlier try of "
            "the same outcome had already been recorded",
            len(refused),
        )


def _nothing_refused(results: Sequence[Result]) -> list[Delivery]:
    return []


def channel_for(schema: str | None) -> str:
    return channel_name("queueing", schema)


class SqlProvider:
    transport = Transport.SQL

    def __init__(
        self,
        url: str | URL,
        *,
        schema: str | None = None,
        worker_id: str | None = None,
        auto_migrate: bool = True,
        listen: bool = True,
        retention: RetentionPolicy | None = None,
        max_message_bytes: int = 1024 * 1024,
        connect_retries: int = 8,
        maintenance_interval: float = 5.0,
        clock: Clock | None = None,
        engine: AsyncEngine | None = None,
        database_auth: DatabaseAuth = "auto",
        client_id: str | None = None,
        credential: Any = None,
        durable_claims: bool = True,
        pool_size: int = 5,
        max_overflow: int = 10,
        claim_pool_size: int = 2,
        prepared_statements: bool = True,
        settle_with_claims: bool = False,
        sqlite_synchronous: str = "normal",
    ) -> None:
        self.url = normalize_url(url)
        self.backend = self.url.get_backend_name()
        #: an Entra token as the password of each new connection (Azure Database for PostgreSQL)
        self._password = (
            EntraPassword(credential, client_id=client_id) if uses_entra(self.url, database_auth) else None
        )
        if schema is not None and self.backend != "postgresql":
            raise ConfigurationError("QUEUEING_DATABASE_SCHEMA", "schemas are a PostgreSQL feature")
        self.tables = Tables.build(schema)
        self.worker_id = worker_id or default_worker_id()
        self.auto_migrate = auto_migrate
        self.retention = retention or RetentionPolicy()
        self.connect_retries = connect_retries
        self.maintenance_interval = maintenance_interval
        # leases on the database's time (db_clock.py), every other time on the host's: a message's
        # times are stamped by its producer's clock and judged by the pipeline's, which are the host's.
        # A plain clock passed in is used as it is for both (tests move it to travel in time)
        self.lease_clock: Clock = DatabaseClock() if clock is None else clock
        lease_clock = self.lease_clock
        self.clock: Clock = lease_clock.host if isinstance(lease_clock, DatabaseClock) else lease_clock
        self.capabilities = Capabilities(
            max_delay=None,
            lock_renewal=True,
            native_dead_letter=True,
            push_wakeups=self.backend == "postgresql",
            durable_history=True,
            transactions=True,
            max_message_bytes=max_message_bytes,
            filters_paused=True,
            overlapping_receives=True,
            settles_as_one=True,
        )
        self.channel = channel_for(schema)
        self._engine = engine
        self._own_engine = engine is None
        #: claims and lease renewals wait for the WAL flush (PostgreSQL); when off they run on their own
        #: small pool with ``synchronous_commit=off``: faster, and a database crash right after a claim
        #: only makes its messages claimable again (a second delivery, never a loss)
        self.durable_claims = durable_claims
        #: a worker's claim carries the settlements waiting for it (``settle_and_receive``): one commit
        #: for both instead of two. Off by default: it halves the commits (and WAL flushes) per batch,
        #: but it puts the settlement's server work on the claim's critical path, where the separate
        #: settlement ran beside it on another connection; measured slower in the burn-down where the
        #: server's CPU, not its flush, limits (see bench/RESULTS.md)
        self.settle_with_claims = settle_with_claims
        #: SQLite's ``synchronous``: "normal" (a commit reaches the disk at the next checkpoint) or
        #: "full" (at each commit, which also sends every hot-path call to aiosqlite's thread)
        self.sqlite_synchronous = sqlite_synchronous
        #: connections of the provider's own engine, and of the claims' pool when claims are relaxed
        #: (it may overflow by twice its size, never by more than ``max_overflow``); LISTEN adds one
        self.pool_size, self.max_overflow, self.claim_pool_size = pool_size, max_overflow, claim_pool_size
        self._app: QueueingApp | None = None
        #: where the trigger of migration 10 tells result waiters their message is done: a channel of
        #: its own, so hosts of an older version (which hear only ``channel``) never receive these
        self.done_channel = done_channel_for(schema)
        self._listener = (
            self.listener(self.channel, also=(self.done_channel,))
            if listen and self.backend == "postgresql"
            else None
        )
        self._wakeups: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        #: told of each cancellation request NOTIFY brings (the runtime sets it)
        self.on_cancel: Callable[[UUID], None] | None = None
        #: result waiters of this process, by message id: NOTIFY sets their events (see ``watch_result``)
        self._result_waiters: dict[UUID, set[asyncio.Event]] = defaultdict(set)
        self._next_due: dict[str, datetime] = {}
        self.statements = Statements(self.tables, self.worker_id, self.backend)
        #: claims, renewals and settlements on the driver's own connection: psycopg's (see ``driver``),
        #: with server-side prepared statements unless a pooler in front of the server cannot keep them,
        #: or sqlite3's in aiosqlite's thread (see ``sqlite_driver``; nothing to prepare there)
        self.prepared_statements = prepared_statements
        self._driver: DriverPath | SqliteDriverPath = (
            DriverPath(prepare=prepared_statements) if self.backend == "postgresql" else SqliteDriverPath()
        )
        self._hot: HotStatements | None = None
        self._auto: AsyncEngine | None = None
        self._claims: AsyncEngine | None = None
        self._control = SqlControlStore(self)
        self._tracker = SqlTracker(self)
        self._open_lock: asyncio.Lock | None = None
        self._opened = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def listener(self, channel: str, *, also: Sequence[str] = ()) -> PgListener:
        """A LISTEN connection to this database, signing in as the engines do."""
        return PgListener(self.url, channel, also=also, password=self._password)

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise NotConfigured("the SQL provider is not open yet: await runtime.open()")
        return self._engine

    @property
    def auto(self) -> AsyncEngine:
        """The engine in autocommit: one statement, one round trip, durable at its end."""
        if self._auto is None:
            raise NotConfigured("the SQL provider is not open yet: await runtime.open()")
        return self._auto

    @property
    def claims(self) -> AsyncEngine:
        """Where claims and lease renewals run, in autocommit: the engine itself when claims are durable
        (the default), else a pool whose sessions do not wait for the WAL flush (PostgreSQL)."""
        if self._claims is None:
            raise NotConfigured("the SQL provider is not open yet: await runtime.open()")
        return self._claims

    def control_store(self) -> SqlControlStore:
        return self._control

    def tracker(self) -> SqlTracker:
        return self._tracker

    def schedule_store(self) -> SqlTickStore:
        """Schedule ticks claimed in the same transaction as their messages."""
        from .schedules import SqlTickStore

        return SqlTickStore(self, transactional=True)

    async def open(self, app: QueueingApp | None = None) -> None:
        if app is not None:
            self._app = app
        if self._open_lock is None:
            self._open_lock = asyncio.Lock()
        async with self._open_lock:
            if self._opened:
                return
            if self._engine is None:
                # SQLite keeps its one connection per process (its single writer): see create_engine
                pools = {"pool_size": self.pool_size, "max_overflow": self.max_overflow}
                self._engine = create_engine(
                    self.url,
                    password=self._password,
                    prepared_statements=self.prepared_statements,
                    sqlite_synchronous=self.sqlite_synchronous,
                    **(pools if self.backend == "postgresql" else {}),
                )
            self._auto = self._engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.backend == "postgresql" and not self.durable_claims:
                self._claims = create_engine(
                    self.url,
                    password=self._password,
                    pool_size=self.claim_pool_size,
                    max_overflow=min(2 * self.claim_pool_size, self.max_overflow),
                    prepared_statements=self.prepared_statements,
                    connect_args={"options": "-c synchronous_commit=off"},
                ).execution_options(isolation_level="AUTOCOMMIT")
            else:
                self._claims = self._auto
            if self.backend == "postgresql":
                self._hot = HotStatements(self.statements, self._engine.dialect)
            elif self._own_engine:
                # only on the kit's own SQLite engine: its pool hands a connection to one user at a
                # time and resets it as the hot path expects; an engine of the caller's (a static pool
                # shared by every user, the pool's own rollback on return) keeps SQLAlchemy's path
                self._hot = HotStatements(self.statements, named_dialect(self._engine), SqliteCompiled)
            await self._wait_for_database()
            await self._read_database_clock(at_open=True)
            if self.auto_migrate:
                applied = await migrate(self.engine, self.tables, now=self.clock)
                if applied:
                    # (the last this host applied need not be the last: another may have applied it)
                    log.info("queueing schema migrated to version %d on %s", LATEST, redact(self.url))
            else:
                async with self.engine.connect() as conn:
                    version = await current_version(conn, self.tables)
                if version < LATEST:
                    problem = f"the database schema is at version {version}, this kit needs {LATEST}"
                    raise ConfigurationError("QUEUEING_AUTO_MIGRATE", f"{problem}: run `queueing migrate`")
            if self._listener is not None:
                self._listener.on_notify = self._wake
                await self._listener.start()
            self._opened = True

    async def _wait_for_database(self) -> None:
        delay = 0.5
        unreachable: tuple[type[BaseException], ...] = (*down_errors(), sa.exc.DBAPIError)
        for attempt in range(1, self.connect_retries + 2):
            try:
                async with self.engine.connect() as conn:
                    await conn.execute(sa.text("SELECT 1"))
                return
            except unreachable as exc:
                if self.backend == "sqlite" and "unable to open database file" in str(exc):
                    # a missing directory or one this user may not write in: configuration, which no
                    # retry mends (the engine let go first: nothing of it outlives the error)
                    from .engine import sqlite_cannot_open

                    if self._own_engine and self._engine is not None:
                        await self._engine.dispose()
                    raise sqlite_cannot_open(self.url) from None
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if attempt > self.connect_retries:
                    raise ProviderUnavailable(
                        f"database {redact(self.url)} is unreachable after {attempt} tries: {first}"
                    ) from None
                log.warning(
                    "database %s is unreachable (%s); retry %d/%d in %.1fs",
                    redact(self.url),
                    first,
                    attempt,
                    self.connect_retries,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.stop()
        if self._claims is not None and self._claims is not self._auto:
            await self._claims.dispose()
        self._claims = self._auto = None
        self._hot = None
        if self._engine is not None and self._own_engine:
            await self._engine.dispose()
            self._engine = None
        if self._password is not None:
            await self._password.close()
        self._opened = False

    async def ensure_open(self) -> None:
        if not self._opened:
            await self.open()

    # -- producing ---------------------------------------------------------------------------------
    def rows_for(self, envelopes: Sequence[Envelope], now: datetime) -> list[dict[str, Any]]:
        return [row_for(e, initial_status(self._app, e), now) for e in envelopes]

    async def notify_statements(self, conn: Any, queues: set[str]) -> None:
        """``pg_notify`` each queue inside the caller's transaction: delivered at commit."""
        if self.backend == "postgresql":
            for q in sorted(queues):
                await conn.execute(self.statements.notify, bind(channel=self.channel, queue=q))

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        await self.send_new(envelopes, wait=wait)

    async def send_new(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> list[bool]:
        """:meth:`send`, saying of each envelope whether its row went in: a message id the table holds
        already (a producer's retry, a message sent again, maybe long finished) adds nothing, and the
        producer must not tell it enqueued. Only a batch that met one pays for finding out which."""
        # every send commits before returning, so ``wait`` (durably accepted) holds either way
        with db_boundary("a send"):
            await self.ensure_open()
            now = self.clock()
            rows = self.rows_for(envelopes, now)
            if self.backend == "postgresql" and len(rows) >= COPY_FROM:
                inserted = await self._copy_in(rows)
            elif self.backend == "postgresql":
                # one statement, one round trip: arrays in, wake-ups and the ids that went in out
                async with self.auto.connect() as conn:
                    answer = await conn.execute(
                        self.statements.insert_unnest, unnest_params(rows, self.channel)
                    )
                    inserted = _inserted(answer)
            else:
                inserted = await self._insert_sqlite(rows)
        for env in envelopes:
            self._note_due(env.queue, env.not_before or now)
        return added(envelopes, inserted)

    async def _insert_sqlite(self, rows: list[dict[str, Any]]) -> set[UUID] | None:
        """The rows in one transaction; the message ids that went in, or None for all of them. The
        plain executemany, whose count says whether every row went in, unless a message id was stored
        already: then again, in a new transaction, as one INSERT ... RETURNING (costlier: so only then)."""
        insert = insert_statement(self.tables, self.backend)
        async with self.engine.connect() as conn:
            async with conn.begin() as tx:
                if (await conn.execute(insert, rows)).rowcount == len(rows):
                    return None
                # the count cannot say which went in: none does, and they go again, asking
                await tx.rollback()
            async with conn.begin():
                answer = await conn.execute(insert.returning(self.tables.messages.c.message_id), rows)
                return set(answer.scalars())

    async def _copy_in(self, rows: list[dict[str, Any]]) -> set[UUID] | None:
        """Large batches through binary COPY (rows formatted in C, not adapted value by value); the
        message ids that went in, or None for all of them.

        COPY cannot skip an existing message id, so it runs in a savepoint; if a producer re-sent a
        message (rare), the batch goes again through the INSERT that ignores duplicates, which says
        which went in.
        """
        from psycopg.errors import UniqueViolation

        async with self.engine.begin() as conn:
            try:
                async with conn.begin_nested():
                    await copy_rows(conn, self.tables, rows)
            except UniqueViolation:
                answer = await conn.execute(self.statements.insert_unnest, unnest_params(rows, self.channel))
                return _inserted(answer)
            else:
                await self.notify_statements(conn, {r["queue"] for r in rows})
                return None

    # -- consuming ---------------------------------------------------------------------------------
    async def sole_claimer(self) -> bool:
        """No other worker holds a lease in this database: a worker with ``receives_in_flight="auto"``
        may then keep a second claim in flight (``queueing_core.overlap``). Never on SQLite, whose one
        writer runs two claims one after the other: a second claim there only costs."""
        if self.backend != "postgresql":
            return False
        await self.ensure_open()
        async with self.auto.connect() as conn:
            return not (await conn.execute(self.statements.other_claimer)).scalar_one()

    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        await self.ensure_open()
        await self._read_database_clock()  # once a minute, also on a host that runs no upkeep
        now = self.clock()
        if sub.handler is None:
            # no handler here: say so on the rows (unleased, untouched otherwise) and take nothing
            async with self.auto.connect() as conn:
                await conn.execute(self.statements.mark_waiting, bind(queue=sub.queue, now=now))
            return []
        lease_until = self.lease_clock() + sub.options.lease_duration
        params = self._claim_params(sub, max_messages, now, lease_until)
        # ordered queues take the head of the line only (a retried head holds the rest back)
        rows: Sequence[Any]
        if self._hot is not None:
            [claimed] = await self._driver.run(self.claims, "a claim", [self._hot_claim(sub, params)])
            rows = claimed.rows
        else:
            stmt = self.statements.claim_head if sub.options.ordered else self.statements.claim
            async with self.claims.connect() as conn:
                rows = (await conn.execute(stmt, params)).mappings().all()
        return await self._leased(_deliveries(rows), sub, lease_until)

    @staticmethod
    def _claim_params(
        sub: Subscription, max_messages: int, now: datetime, lease_until: datetime
    ) -> dict[str, Any]:
        return claim_params(sub.queue, max_messages, now, lease_until)

    async def _leased(
        self, claimed: list[Delivery], sub: Subscription, lease_until: datetime
    ) -> list[Delivery]:
        """The claimed deliveries, their leases long enough to start on. A lease's end is set before the
        claim waits (for a pooled connection, or for SQLite's write lock, which another process may
        hold for seconds), so a claim that waited long commits leases that are short or over, and the
        worker's first renewal comes a third of a lease later: the sweep of any host could take the
        message back meanwhile, and on its last attempt dead-letter it while it runs. With less than
        two thirds of the lease left, the leases are renewed at once, and those the sweep took back
        already are not run (their outcome would be refused)."""
        if not claimed or lease_until - self.lease_clock() > sub.options.lease_duration * 2 / 3:
            return claimed
        try:
            lost = {id(d) for d in await self.renew(claimed)}
        except Exception as exc:
            # (the slow database that made the claim wait may fail this too: the messages run as
            # claimed, and the worker's renewals go on trying; dropped, they would wait out the lease)
            log.warning("could not renew the leases of a claim that waited (%s): running it as claimed", exc)
            return claimed
        if lost:
            log.warning(
                "a claim waited past most of its lease: %d of its %d message(s) were taken back before "
                "it returned, and are not run here",
                len(lost),
                len(claimed),
            )
        return [d for d in claimed if id(d) not in lost]

    def _hot_claim(self, sub: Subscription, params: dict[str, Any]) -> tuple[Compiled, dict[str, Any]]:
        """The claim as a hot-path statement: ordered queues take the head of the line only."""
        assert self._hot is not None
        return (self._hot.claim_head if sub.options.ordered else self._hot.claim), params

    def claim_sql(
        self, queue: str, limit: int, now: datetime, lease_until: datetime, *, ordered: bool = False
    ) -> tuple[str, dict[str, Any]]:
        """The batch claim (or an ordered queue's claim of its head) as the driver receives it (SQL text
        and bound values), to read its plan."""
        stmt = self.statements.claim_head if ordered else self.statements.claim
        compiled = stmt.compile(dialect=self.engine.dialect)
        params = {**compiled.params, **claim_params(queue, limit, now, lease_until)}
        return str(compiled), params

    def _wake(self, queue: str) -> None:
        if queue.startswith(DONE_PREFIX):
            with contextlib.suppress(ValueError):
                for event in self._result_waiters.get(UUID(queue[len(DONE_PREFIX) :]), ()):
                    event.set()
            return
        if queue.startswith(CANCEL_PREFIX):
            if self.on_cancel is not None:
                with contextlib.suppress(ValueError):
                    self.on_cancel(UUID(queue[len(CANCEL_PREFIX) :]))
            return
        self._wakeups[queue].set()

    def _note_due(self, queue: str, when: datetime) -> None:
        current = self._next_due.get(queue)
        if current is None or when < current:
            self._next_due[queue] = when
        if when <= self.clock():
            self._wake(queue)

    # -- result waiters (PostgreSQL) -----------------------------------------------------------------
    async def watch_result(self, message_id: UUID, wake: asyncio.Event) -> bool:
        """Have ``wake`` set when this message reaches a final status, from whichever process settles
        it: its row is flagged ``awaited``, and the counts trigger of UPDATE statements (migration 14)
        NOTIFYs for flagged rows only, so nobody pays for waiters that do not exist. False where there
        is no NOTIFY (SQLite, or LISTEN turned off): the caller polls."""
        if self._listener is None:
            return False
        await self.ensure_open()
        self._result_waiters[message_id].add(wake)  # before the flag: a NOTIFY right after it finds it
        m = self.tables.messages
        try:
            async with self.auto.connect() as conn:
                await conn.execute(
                    sa.update(m)
                    .where(m.c.message_id == message_id, sa.not_(m.c.awaited))
                    .values(awaited=True)
                )
        except BaseException:
            self.unwatch_result(message_id, wake)
            raise
        return True

    def unwatch_result(self, message_id: UUID, wake: asyncio.Event) -> None:
        waiters = self._result_waiters.get(message_id)
        if waiters is not None:
            waiters.discard(wake)
            if not waiters:
                del self._result_waiters[message_id]

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        due = self._next_due.get(sub.queue)
        if due is not None:
            until_due = (due - self.clock()).total_seconds()
            if until_due <= timeout:
                self._next_due.pop(sub.queue, None)
                timeout = max(0.0, until_due)
        event = self._wakeups[sub.queue]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        event.clear()

    # -- settling ----------------------------------------------------------------------------------
    def _settle_params(
        self, settlements: Sequence[Settlement], now: datetime
    ) -> tuple[list[Delivery], dict[str, list[tuple[Delivery, dict[str, Any]]]], set[str]]:
        fast: list[Delivery] = []
        shaped: dict[str, list[tuple[Delivery, dict[str, Any]]]] = defaultdict(list)
        wake: set[str] = set()
        # the requests a waiting outcome honours (settled Cancelled instead), as the control state's
        since = now - CANCEL_KEPT
        for s in settlements:
            d, decision = s.delivery, s.decision
            if isinstance(decision, Complete) and decision.result is None and not decision.cancelled:
                fast.append(d)  # most of a batch: settled together by lease, nothing more to shape
                continue
            lease: Lease = d.handle
            base = {"id": lease.row, "token": lease.token, "now": now}
            used = d.attempts_used(decision)
            params: dict[str, Any]
            if isinstance(decision, Complete):
                shape = "complete"
                params = {
                    **base,
                    "status": decision.status.value,
                    "attempt": used,
                    "result": jsonable(decision.result),
                    "reason": decision.reason,
                }
            elif isinstance(decision, RetryAfter):
                shape = "retry"
                at = now + decision.delay
                params = {
                    **base,
                    "attempt": used,
                    "available_at": at,
                    "last_error": decision.error,
                    "since": since,
                }
                self._note_due(d.queue, at)
            elif isinstance(decision, DeadLetter):
                shape = "dead"
                raw = d.text() if decision.reason is DeadLetterReason.MALFORMED_ENVELOPE else None
                params = {
                    **base,
                    "attempt": used,
                    "reason": decision.reason.value,
                    "description": decision.description,
                    "raw": raw,
                }
            elif isinstance(decision, Defer):
                shape = "defer"
                sleeping = decision.status is MessageStatus.SLEEPING
                params = {
                    **base,
                    "status": decision.status.value,
                    "attempt": used,
                    "available_at": decision.until,
                    "reason": decision.reason,
                    "not_before": decision.until if sleeping else None,
                    "renew": decision.reset_attempts,
                    "expires_at": decision.expires_at,
                    "since": since,
                }
                self._note_due(d.queue, decision.until)
            elif isinstance(decision, Release):
                shape = "release"
                params = {**base, "attempt": used, "since": since}
                if self.backend == "postgresql":  # (a NOTIFY: SQLite's workers poll)
                    wake.add(d.queue)
            else:
                assert isinstance(decision, Expire)
                shape, params = "expire", base
            shaped[shape].append((d, bind(**params)))
        return fast, shaped, wake

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        if not settlements:
            return
        now = self.clock()
        refused: list[Delivery]
        if self._hot is not None:
            work, read = self._settle_work(settlements, now)
            refused = read(await self._driver.run(self.auto, "a settlement", work))
        else:
            fast, shaped, wake = self._settle_params(settlements, now)
            with db_boundary("a settlement"):  # (as the hot path's: "database is locked" is a retry)
                refused = await self._settle_engine(fast, shaped, wake, now)
        _mark_refused(refused)

    def settles_with_claims(self) -> bool:
        """The combined call is offered when asked for (``settle_with_claims``) where claims run on the
        hot path and on the durable engine (the settlements' own): a settlement is never committed
        without waiting for its WAL flush, so relaxed claims (their own ``synchronous_commit=off``
        pool) stay apart; measured, moving them onto the durable engine to combine was slower too."""
        return (
            self.settle_with_claims
            and self._hot is not None
            and self._claims is not None
            and self._claims is self._auto
        )

    async def settle_and_receive(
        self, settlements: Sequence[Settlement], sub: Subscription, max_messages: int
    ) -> list[Delivery]:
        """Settle a batch and claim the next in one pipeline on the durable engine: one round trip,
        one transaction, one commit. A failure anywhere (the claim included) rolls back the lot, so
        the settlements may go to ``settle`` again; a refused settlement is marked and fails nothing."""
        if sub.handler is None:
            # a subscription without a handler claims nothing (see ``receive``): nothing to combine
            raise ValueError(f"{sub.queue} has no handler here: settle, then receive")
        if not self.settles_with_claims():
            raise NotConfigured(
                "settling with claims needs settle_with_claims, the hot path and durable claims"
            )
        now = self.clock()
        work, read = self._settle_work(settlements, now) if settlements else ([], _nothing_refused)
        lease_until = self.lease_clock() + sub.options.lease_duration
        claim = self._hot_claim(sub, self._claim_params(sub, max_messages, now, lease_until))
        results = await self._driver.run(self.auto, "a settlement and a claim", [*work, claim])
        _mark_refused(read(results[: len(work)]))
        return await self._leased(_deliveries(results[-1].rows), sub, lease_until)

    def _settle_work(
        self, settlements: Sequence[Settlement], now: datetime
    ) -> tuple[list[tuple[Compiled, dict[str, Any]]], Callable[[Sequence[Result]], list[Delivery]]]:
        """A settlement batch as hot-path work (``settle`` and ``settle_and_receive`` run the same):
        every kind of outcome and the wake-ups, for one call (one round trip, one commit), and how
        to read the refused deliveries from its results. Each statement is fenced by its leases; a
        refused one changes nothing and says so by its row count (or, for the successes, by the ids
        it returns)."""
        assert self._hot is not None
        fast, shaped, wake = self._settle_params(settlements, now)
        work: list[tuple[Compiled, dict[str, Any]]] = []
        if fast:
            work.append((self._hot.complete_many, _many(self.backend, fast, now=now)))
        singles = [d for items in shaped.values() for d, _ in items]
        work += [(self._hot.settle[shape], p) for shape, items in shaped.items() for _, p in items]
        work += [(self._hot.notify, bind(channel=self.channel, queue=q)) for q in sorted(wake)]

        def refused(results: Sequence[Result]) -> list[Delivery]:
            out: list[Delivery] = []
            if fast:
                # the leases, not the rows: a stale run's lease of a row whose live run is in the
                # same batch is refused, though the row was settled (under the live run's token)
                done = {Lease(r["id"], r["lease_token"]) for r in results[0].rows}
                out += [d for d in fast if d.handle not in done]
            first = 1 if fast else 0
            # (the wake-ups follow the single-row statements: zip stops at the last of those)
            out += [d for d, res in zip(singles, results[first:], strict=False) if res.rowcount != 1]
            return out

        return work, refused

    async def _settle_engine(
        self,
        fast: list[Delivery],
        shaped: dict[str, list[tuple[Delivery, dict[str, Any]]]],
        wake: set[str],
        now: datetime,
    ) -> list[Delivery]:
        refused: list[Delivery] = []
        if fast:
            # the common batch (all successes): one autocommit round trip that says what it settled
            async with self.auto.connect() as conn:
                stmt, params = self.statements.complete_many, _many(self.backend, fast, now=now)
                done = {Lease(*r) for r in (await conn.execute(stmt, params)).all()}
            refused += [d for d in fast if d.handle not in done]  # (by lease, as the hot path's)
        for shape, items in shaped.items():
            refused += await self._settle_each(self.statements.settle[shape], items)
        if wake and self.backend == "postgresql":
            async with self.auto.connect() as conn:
                await self.notify_statements(conn, wake)
        return refused

    async def _settle_each(
        self, stmt: sa.Update, items: list[tuple[Delivery, dict[str, Any]]]
    ) -> list[Delivery]:
        """One statement per row, each fenced by its lease token; returns the deliveries refused.

        All rows go in one executemany transaction (one round trip with psycopg); only when the guards
        refused some (rare: a lease passed to another run) is it undone and done row by row, to learn
        which. Each statement is independent, so either way the outcome is the same.
        """
        if len(items) > 1:
            async with self.engine.connect() as conn:
                tx = await conn.begin()
                if (await conn.execute(stmt, [p for _, p in items])).rowcount == len(items):
                    await tx.commit()
                    return []
                await tx.rollback()
        refused: list[Delivery] = []
        async with self.auto.connect() as conn:
            for d, params in items:
                if (await conn.execute(stmt, params)).rowcount != 1:
                    refused.append(d)
        return refused

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        if not deliveries or self._app is None:
            return []
        now = self.lease_clock()  # a lease's end only (see __init__)
        by_queue: dict[str, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            by_queue[d.queue].append(d)
        lost: list[Delivery] = []
        groups: list[tuple[list[Delivery], datetime, dict[str, Any]]] = []
        for queue, ds in by_queue.items():
            sub = self._app.by_queue().get(queue)
            until = now + (sub.options.lease_duration if sub else timedelta(seconds=30))
            groups.append((ds, until, _many(self.backend, ds, until=until)))
        # the leases renewed, (row, token): a stale run's lease sent with the live run's of the same
        # row is lost, though the row was renewed (under the live run's token)
        kept_per_group: list[set[Lease]]
        if self._hot is not None:
            # every queue's renewal in one pipeline (one round trip), on the claims' connections
            hot = self._hot.renew
            results = await self._driver.run(self.claims, "a lease renewal", [(hot, p) for _, _, p in groups])
            kept_per_group = [{Lease(r["id"], r["lease_token"]) for r in res.rows} for res in results]
        else:
            kept_per_group = []
            async with self.claims.connect() as conn:
                for _, _, params in groups:
                    renewed = (await conn.execute(self.statements.renew, params)).all()
                    kept_per_group.append({Lease(*r) for r in renewed})
        for (ds, until, _), kept in zip(groups, kept_per_group, strict=True):
            for d in ds:
                if d.handle in kept:
                    d.lease_until = until
                else:
                    lost.append(d)
        return lost

    # -- ops actions (the ops service decides; these carry out, guarded by the state it saw) ---------
    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        await self.ensure_open()  # the retry statement reopens the row: nothing else to record
        return await sql_ops.retry(self, record, envelope, now)

    async def send_idempotent(
        self, envelopes: Sequence[Envelope], identities: Sequence[str]
    ) -> list[IdempotentOutcome]:
        with db_boundary("an idempotent send"):
            await self.ensure_open()
            return await sql_idempotent.send(self, envelopes, identities)

    async def previous_of(self, sub: Subscription, message: QueueMessage) -> QueueMessage | None:
        with db_boundary("reading a previous version"):
            await self.ensure_open()
            return await sql_idempotent.previous(self, sub, message, identity_of(sub.options, message))

    async def superseded_by(self, sub: Subscription, message: QueueMessage) -> UUID | None:
        """The newer version that supersedes this one, if any; a failed lookup runs it (a duplicate run
        beats a lost one), as on the other transports."""
        try:
            await self.ensure_open()
            return await sql_idempotent.newer_version(self, message)
        except Exception as exc:
            log.warning("could not look for a newer version of %s (%s): running it", message.message_id, exc)
            return None

    async def ops_update_status_where(
        self,
        queue: str,
        steps: Sequence[str | int],
        op: str,
        value: str | int | float | bool | None,
        new_status: str,
        only: Sequence[str] | None,
        now: datetime,
    ) -> int:
        from . import where

        await self.ensure_open()
        return await where.update_status(self, queue, steps, op, value, new_status, only, now)

    async def ops_cancel(self, record: MessageRecord, now: datetime) -> bool:
        await self.ensure_open()
        return await sql_ops.cancel(self, record, now)

    async def store_progress(self, delivery: Delivery, progress: dict[str, Any]) -> None:
        await self.ensure_open()
        await sql_ops.store_progress(self, delivery.handle, progress)

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        await self.ensure_open()
        return await sql_ops.release(self, record, now)

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool:
        await self.ensure_open()
        return await sql_ops.archive(self, record, now)

    async def ops_purge(self, query: MessageQuery) -> tuple[int, int]:
        await self.ensure_open()
        return await sql_ops.purge(self, query)

    async def ops_held(self, record: MessageRecord) -> str | None:
        return None  # the row is the history: it never calls a dead row waiting

    # -- maintenance ---------------------------------------------------------------------------------
    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]:
        """Sweep expired leases, expire overdue waiting rows, archive and prune. Safe on every host."""
        from .maintenance import run_maintenance

        with db_boundary("maintenance"):
            await self.ensure_open()
            lease_now = await self.lease_time()
            return await run_maintenance(self, app or self._app, self.clock(), lease_now)

    async def lease_time(self) -> datetime:
        """The time leases are written and compared on (a sweep of lapsed leases): the database's,
        read again first when that is due."""
        await self._read_database_clock()
        return self.lease_clock()

    async def _read_database_clock(self, *, at_open: bool = False) -> None:
        """Correct the lease clock by the database's, when it is a :class:`DatabaseClock` and due. A
        failed reading keeps the last difference; the next try is a minute later."""
        clock = self.lease_clock
        if not isinstance(clock, DatabaseClock) or not (at_open or clock.due()):
            return
        try:
            async with self.auto.connect() as conn:
                # only the statement is timed: a wait for a pooled connection is no part of it
                before = clock.host()
                value = (await conn.execute(self.statements.database_now)).scalar_one()
                after = clock.host()
        except Exception as exc:
            clock.failed()
            log.warning("could not read the database's clock (%s); will try again", first_line(exc))
            return
        database_now = as_utc(value if isinstance(value, datetime) else datetime.fromisoformat(value))
        clock.correct(database_now, before, after)
