"""The SQLite hot path: claims, lease renewals and settlements on ``sqlite3`` itself.

Through SQLAlchemy, every statement on SQLite crosses its greenlet bridge and its result machinery, and
every call of aiosqlite (begin, execute, fetch, commit) is a hop to aiosqlite's thread and back: a
settlement batch was a dozen hops. Here the same contract as the PostgreSQL hot path
(``driver.DriverPath.run``) holds with one hop per call at most:

- **one source of SQL**: the statements are still the SQLAlchemy Core objects of ``statements``,
  compiled once per provider for SQLite with named parameters (:class:`SqliteCompiled`: the same
  values, bind processors and result processors SQLAlchemy would use, so the rows written are the same
  as on the SQLAlchemy path, and the rows read too, but for timestamps (aware UTC times) and UUIDs
  (their text), read for the claimed envelope's validation);
- **the same connection**: each call runs one function against the provider's one pooled
  connection's ``sqlite3`` connection (on aiosqlite's thread, or on the event loop's: below), so the
  connection's PRAGMAs are those of the rest of the provider. When another user has that connection
  borrowed (a transaction of the SQLAlchemy path may be open on it) the call borrows it too, and so
  queues on the pool, in asyncio: straight from the pool, back marked clean (``engine.borrowed``, as
  on the PostgreSQL hot path). When it sits idle in the pool, the call is not borrowed at all: see
  :meth:`SqliteDriverPath.idle`;
- **one transaction**: the statements run between ``BEGIN IMMEDIATE`` and ``COMMIT`` (one WAL
  append), rolled back as a whole on any error, in the thread: a caller cancelled mid-call leaves no
  transaction open, since the function still ends it. A statement whose lease guard refuses its row
  changes nothing and says so by its row count;
- **on the event loop's thread when nothing else can use the connection** (``round_trip``): with no
  call of the connection's queued or running in aiosqlite's thread (``sqlite_thread.Calls``, which
  counts them) and nobody else holding it, the same function runs on the event loop's thread, and so
  without the hop there and back and the GIL's hand-overs between the two threads at every statement
  and row, which made SQLite's work and the event loop's take turns rather than overlap (measured: the
  process's CPU per message -20 to -25 %, see bench/RESULTS.md). What can wait goes to aiosqlite's
  thread instead: SQLite's busy timeout is 0 for the call's span, so another connection's write lock
  sends the call there; no commit on the event loop checkpoints (a checkpoint copies the WAL into the
  database and waits for the disk's flushes): checkpoints run in aiosqlite's thread, queued after
  about as many write transactions as make SQLite's own threshold of WAL pages, and the first write
  after one that copied the whole WAL (it starts the WAL over and flushes its new header) goes there
  too; a database whose commits flush (not in WAL mode, or ``synchronous`` FULL) has every call there.
  Left on the event loop, and rare: the WAL's restart after a checkpoint another process (or this
  one's SQLAlchemy path) made, one flush of its header; and SQLite's own short sleeps when a reader
  meets a checkpointer of another process at the WAL's index.

Errors of ``sqlite3`` go through the provider's one translation (``errors.db_boundary``), which maps
them as it maps SQLAlchemy's wrapping of them ("database is locked" -> unavailable, worth a retry).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from ...clock import as_utc
from .driver import Compiled, Result
from .engine import borrowed
from .errors import db_boundary
from .sqlite_thread import Calls, calls_of

log = logging.getLogger("queueing.sql")


class SqliteCompiled(Compiled):
    """A hot-path statement for ``sqlite3``: as :class:`Compiled`, but for two kinds of returned column,
    read for the one reader of the hot path's rows that takes them, the claimed envelope
    (``rows.delivery_from_row``):

    - a **timestamp** comes back timezone-aware in UTC, as psycopg returns it on the PostgreSQL hot
      path. SQLite keeps timestamps as UTC text without an offset; SQLAlchemy reads them as naive
      times, which the envelope's validation then marked UTC one by one, with a
      ``datetime.replace(tzinfo=...)`` that costs several times the parse itself;
    - a **UUID** stays the text SQLite keeps: the envelope's validation parses it (in Rust) at no
      cost over taking a ``uuid.UUID``, which SQLAlchemy's reading builds in Python for about a
      microsecond each. A reader of these rows other than the envelope must parse it itself.
    """

    def result_processor(self, type_: Any, dialect: sa.Dialect) -> Callable[[Any], Any] | None:
        if isinstance(type_, sa.Uuid):
            return None
        process = super().result_processor(type_, dialect)
        if process is None or not isinstance(type_, sa.DateTime):
            return process
        return _utc_reader(process)


def _utc_reader(fallback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Reads SQLite's timestamp text as an aware UTC datetime: the text SQLAlchemy writes
    (``2026-01-02 03:04:05.123456``) parsed with its offset added, in C; anything else (none written by
    the kit) through SQLAlchemy's own reading, then marked UTC as every reader did. Text that neither
    reads (a damaged row) comes back as it is: the envelope's validation then refuses that one row,
    which is dead-lettered as malformed, instead of an error here failing every claim of its queue."""

    def read(value: Any) -> datetime | str | None:
        if value is None:
            return None
        try:
            aware = datetime.fromisoformat(value + "+00:00")
            if aware.tzinfo is UTC:  # (a date alone would take the offset for a time of day)
                return aware
        except (TypeError, ValueError):
            pass
        try:
            parsed = fallback(value)
        except (TypeError, ValueError):
            return value  # type: ignore[no-any-return]
        return None if parsed is None else as_utc(parsed)

    return read


def named_dialect(engine: AsyncEngine) -> sa.Dialect:
    """The engine's SQLite dialect with named parameters (``:name``), which ``sqlite3`` takes from a dict."""
    make: Any = type(engine.dialect)  # (the aiosqlite dialect: DefaultDialect's keywords)
    dialect: sa.Dialect = make(paramstyle="named")
    return dialect


class _Unusable(Exception):
    """The transaction could not be rolled back: the connection's state is unknown."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _round_trip(db: sqlite3.Connection, work: list[tuple[Compiled, dict[str, Any]]]) -> list[Result]:
    """The statements in one transaction, rows as dicts (in aiosqlite's thread, or on the event loop's
    through :func:`_inline`)."""
    # explicit, even for one statement: SQLAlchemy's reset of an autocommit connection hands sqlite3
    # its implicit transactions again (``isolation_level = ""``), which a lone UPDATE would leave open
    db.execute("BEGIN IMMEDIATE")
    try:
        results = []
        for stmt, params in work:
            cur = db.execute(stmt.sql, params)
            rows: list[dict[str, Any]] = []
            if cur.description is not None:
                names = [d[0] for d in cur.description]
                rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
                # then only the columns that have a processor (a claim's timestamps), in place
                processed = [(name, stmt.results[name]) for name in names if name in stmt.results]
                for row in rows:
                    for name, process in processed:
                        row[name] = process(row[name])
            results.append(Result(cur.rowcount, rows))
            cur.close()
        db.execute("COMMIT")
    except BaseException as exc:
        if db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except BaseException:
                # closed here, in the thread, before anything queued behind this call runs: a call on
                # the idle connection is not borrowed (see ``SqliteDriverPath.idle``), so its next
                # user may already be queued, and would run inside this transaction or commit it
                with contextlib.suppress(BaseException):
                    db.close()
                raise _Unusable(exc) from exc
        raise
    return results


@dataclass(frozen=True)
class Settings:
    """A connection's settings as a call on the event loop's thread needs them: whether its commits
    write without waiting for the disk (WAL mode, ``synchronous`` OFF or NORMAL: a commit appends to
    the WAL and flushes nothing), and the two settings such a call changes for its span and puts back."""

    inline: bool
    busy_timeout: int
    autocheckpoint: int


@dataclass
class Inline:
    """What the hot path keeps of a connection on which it runs calls on the event loop's thread."""

    #: the one thread those calls run on (the event loop's that made the first): a call from any other
    #: thread goes to aiosqlite's, whose queue keeps calls apart
    thread: int
    #: read at the first call, and again after any other user of the connection has given it back (it
    #: may have changed them: see ``engine._rollback_unless_clean``)
    settings: Settings | None = None
    #: write transactions committed on the event loop's thread since the last checkpoint was queued
    written: int = 0
    #: how many such transactions make a checkpoint due: about ``autocheckpoint`` pages of WAL, as
    #: SQLite's own automatic checkpoint would have it, from what the last checkpoint found
    checkpoint_every: int = 100
    #: the last checkpoint copied the whole WAL: the next write starts the WAL over, and with it
    #: flushes the WAL's header to disk, so that write goes to aiosqlite's thread (set there)
    restart: bool = False


def _busy(exc: BaseException) -> bool:
    """SQLite's "database is locked": another connection has the write lock (or is recovering the WAL)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.OperationalError) and code is not None and code & 0xFF == sqlite3.SQLITE_BUSY
    )


def _settings(db: sqlite3.Connection) -> Settings:
    (mode,) = db.execute("PRAGMA journal_mode").fetchone()
    (sync,) = db.execute("PRAGMA synchronous").fetchone()
    (busy,) = db.execute("PRAGMA busy_timeout").fetchone()
    (pages,) = db.execute("PRAGMA wal_autocheckpoint").fetchone()
    # (synchronous: 0 OFF, 1 NORMAL; FULL and EXTRA flush the WAL at every commit)
    inline = str(mode).lower() == "wal" and int(sync) <= 1
    return Settings(inline=inline, busy_timeout=int(busy), autocheckpoint=int(pages))


class _Committed(Exception):
    """The call committed, but the connection's settings could not be put back: it leaves the pool
    (its next user would meet "database is locked" at once instead of waiting), and the caller has
    its results all the same (reported failed, a settlement would be retried and refused by its own
    fence as a lease that passed to another run)."""

    def __init__(self, results: list[Result], error: BaseException) -> None:
        super().__init__(str(error))
        self.results = results
        self.error = error


def _put_back(db: sqlite3.Connection, settings: Settings) -> None:
    """The connection's own busy timeout and automatic checkpoint, for its next user (the SQLAlchemy
    path, or a call in aiosqlite's thread); a connection whose settings cannot be put back is closed
    (:class:`_Unusable`)."""
    try:
        db.execute(f"PRAGMA busy_timeout = {settings.busy_timeout}")
        db.execute(f"PRAGMA wal_autocheckpoint = {settings.autocheckpoint}")
    except BaseException as exc:
        with contextlib.suppress(BaseException):
            db.close()
        raise _Unusable(exc) from exc


def _inline(
    db: sqlite3.Connection, work: list[tuple[Compiled, dict[str, Any]]], settings: Settings
) -> list[Result] | None:
    """``_round_trip`` on the event loop's own thread, without waiting for another connection: SQLite's
    busy timeout is 0 for its span, so a write lock held by another connection fails it at once
    ("database is locked", its transaction rolled back as any error's), and None says so (the caller
    goes to aiosqlite's thread, which waits for the lock); and the automatic checkpoint is off, so
    that no commit here copies the WAL into the database and waits for the disk's flushes
    (:func:`_checkpoint` runs in aiosqlite's thread instead). Every way out puts both settings back."""
    try:
        db.execute("PRAGMA busy_timeout = 0")
        db.execute("PRAGMA wal_autocheckpoint = 0")
        results = _round_trip(db, work)
    except _Unusable:
        raise  # (closed: nothing to put back)
    except BaseException as exc:
        _put_back(db, settings)
        if _busy(exc):
            return None  # (nothing changed: no transaction began, or it was rolled back)
        raise
    try:
        _put_back(db, settings)
    except _Unusable as unusable:
        raise _Committed(results, unusable.error) from None
    return results


def _checkpoint(db: sqlite3.Connection, state: Inline, transactions: int) -> None:
    """In aiosqlite's thread: a passive checkpoint (it copies what it can of the WAL into the database
    and waits for no reader or writer), due after ``transactions`` write transactions on the event
    loop's thread; the next one is due after as many as make about the connection's
    ``wal_autocheckpoint`` pages of WAL, by what this one found."""
    try:
        _, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    except sqlite3.Error as exc:  # (the next one is due as soon: the WAL only waits longer)
        log.debug("SQLite checkpoint failed: %s", exc)
        return
    settings = state.settings
    if frames > 0 and transactions > 0 and settings is not None:
        per = frames / transactions
        state.checkpoint_every = max(1, min(10_000, round(settings.autocheckpoint / per)))
    state.restart = frames > 0 and copied == frames


def _wrote(results: Sequence[Result]) -> bool:
    return any(r.rowcount > 0 or r.rows for r in results)


class SqliteDriverPath:
    """Runs compiled statements on the ``sqlite3`` connection under the provider's pooled connection."""

    def __init__(self) -> None:
        #: the pool and the aiosqlite connection this path last borrowed from it (see :meth:`idle`)
        self._known: tuple[sa.pool.QueuePool, Any] | None = None

    def idle(self, engine: AsyncEngine) -> Any | None:
        """The pool's one connection (an ``aiosqlite.Connection``) when it sits idle in the pool, else
        None: then a call needs no borrowing, which costs two greenlets and the pool's bookkeeping
        (about 45 µs of the event loop's CPU a call, as much as the hop itself).

        A call is one function, whole transaction included, on the event loop's thread (nothing of the
        connection's queued in aiosqlite's: see :meth:`round_trip`) or in aiosqlite's thread, which runs
        its queue in order. What the pool's lending adds is that nobody else's transaction is open on
        the connection meanwhile. Idle in the pool, nobody has it; whoever borrows it after this call
        runs its own statements after this call's COMMIT (in the same thread, queued behind it). So a call
        that finds it idle is queued there straight away, and only then (on the kit's own one-connection
        pool, the one this path is built for; the pool this path last borrowed from, still the
        engine's; that connection still running, not closed since): anything else borrows."""
        known = self._known
        if known is None:
            return None
        pool, aio = known
        if engine.sync_engine.pool is not pool or pool.checkedout() != 0 or pool.checkedin() != 1:
            return None  # (another user has it, or it is being closed, or the pool was replaced)
        if not aio._running or aio._connection is None:
            return None  # (closed, or closing: its replacement is borrowed and known from then on)
        return aio

    async def run(
        self, engine: AsyncEngine, action: str, work: Sequence[tuple[Compiled, Mapping[str, Any]]]
    ) -> list[Result]:
        """``work`` in one transaction and one hop to the database's thread, errors translated."""
        # the values are processed here, where a missing one fails before the connection is borrowed
        bound = [(stmt, stmt.params(values)) for stmt, values in work]
        with db_boundary(action):
            aio = self.idle(engine)
            if aio is not None:
                try:
                    # (no await between ``idle`` and the function queued in the thread)
                    return await self.round_trip(aio, bound)
                except UnicodeError:
                    raise  # (a value ``sqlite3`` could not encode, rolled back: the data's, see below)
                except (_Unusable, _Committed, ValueError) as failed:
                    # its state is unknown, or it is gone: out of the pool, as a borrowed one would be
                    self._known = None
                    async with borrowed(engine) as lent:
                        # (not marked clean: invalidated on its return; unless the pool already holds
                        # another connection, which another call's failure replaced)
                        lent.clean = lent.driver is not aio
                    if isinstance(failed, _Committed):
                        return failed.results
                    if isinstance(failed, _Unusable):
                        raise failed.error from None
                    raise sqlite3.OperationalError(f"the SQLite connection is closed: {failed}") from failed
            # straight from the pool (``engine.borrowed``): a SQLAlchemy connection of the autocommit
            # engine would set and reset its isolation level on the way, three more hops to the thread
            async with borrowed(engine) as lent:
                pool = engine.sync_engine.pool
                if isinstance(pool, sa.pool.QueuePool) and pool.size() == 1:
                    self._known = (pool, lent.driver)
                # whatever happens here (an error, a cancelled caller), the function that runs in
                # aiosqlite's thread ends its own transaction, and anything later queued there runs
                # after it: back to the pool clean, no rollback needed, but in the two cases below
                lent.clean = True
                try:
                    return await self.round_trip(lent.driver, bound)
                except _Committed as done:
                    lent.clean = False  # (out of the pool)
                    self._known = None
                    return done.results
                except _Unusable as broken:
                    lent.clean = False  # (out of the pool)
                    self._known = None
                    raise broken.error from None
                except UnicodeError:
                    # a ValueError too, but the data's: text ``sqlite3`` could not encode (a lone
                    # surrogate), its transaction rolled back; the connection is fine, and the caller
                    # must not read it as the database's absence (retried for ever, the pool's one
                    # connection thrown away at every try)
                    raise
                except ValueError as closed:
                    # aiosqlite's words for a connection (or its thread) that is gone: out of the pool,
                    # and a retryable error, as SQLAlchemy's adapter treats them
                    lent.clean = False
                    self._known = None
                    raise sqlite3.OperationalError(f"the SQLite connection is closed: {closed}") from closed

    async def round_trip(self, aio: Any, bound: list[tuple[Compiled, dict[str, Any]]]) -> list[Result]:
        """The call on ``aio`` (an ``aiosqlite.Connection`` nobody else has now): on the event loop's own
        thread when nothing is queued or running in aiosqlite's thread and SQLite's write lock is free at
        once (:func:`_inline`), else the one hop, ``_round_trip`` in that thread, which waits for the lock.

        On the event loop's thread the call skips the hop there and back (the queue, the future, the
        wake-up of the event loop through its self-pipe) and every hand-over of the GIL between the two
        threads, which each statement and row of the call needed; it holds the event loop for the
        statements' own time, as long as the hop's work held the GIL before (a claim or a settlement
        batch: about 0.3-3 ms)."""
        calls = calls_of(aio)
        if calls is not None and calls.idle:
            results = self._inline(aio._conn, bound, calls)
            if results is not None:
                return results
        # (aiosqlite's one way to run a function in its thread: what its own calls use)
        hopped: list[Result] = await aio._execute(_round_trip, aio._conn, bound)
        if calls is not None and calls.inline is not None and calls.inline.restart and _wrote(hopped):
            calls.inline.restart = False  # (this write started the WAL over, in aiosqlite's thread)
        return hopped

    def _inline(
        self, db: sqlite3.Connection, bound: list[tuple[Compiled, dict[str, Any]]], calls: Calls
    ) -> list[Result] | None:
        """The call on the event loop's thread, or None: it goes to aiosqlite's thread, which waits for
        what the event loop must not: another connection's write lock, the disk (a database whose
        commits flush, or the first write after a checkpoint that copied the whole WAL, which flushes
        the WAL's new header), or another thread's call. Then a checkpoint in aiosqlite's thread when
        one is due."""
        state = calls.inline
        if state is None:
            state = calls.inline = Inline(thread=threading.get_ident())
        elif state.thread != threading.get_ident():
            return None
        if state.restart:
            return None
        settings = state.settings
        if settings is None:
            settings = state.settings = _settings(db)
        if not settings.inline:
            return None
        results = _inline(db, bound, settings)
        if results is not None and _wrote(results):
            state.written += 1
            if state.written >= state.checkpoint_every:
                # queued while nothing else is (calls.idle): it runs next, outside any transaction, and
                # the calls after it go to aiosqlite's thread until it has ended
                calls.put_nowait((None, functools.partial(_checkpoint, db, state, state.written)))
                state.written = 0
        return results
