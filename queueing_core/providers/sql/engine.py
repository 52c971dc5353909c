"""Engines for the SQL provider: URL normalization, SQLite tuning, password-free URLs for logs, a
password asked for on every new connection (an Entra access token, see ``entra``), and the hot paths'
way to a pooled connection (:func:`borrowed`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.util import greenlet_spawn

from ... import retry_policy
from ...errors import ConfigurationError
from .sqlite_thread import another_user_returned, count_calls

#: how long a statement on the kit's SQLite connections waits for another connection's write lock
#: (SQLite's busy timeout), in milliseconds
BUSY_TIMEOUT_MS = 30_000

#: the async driver the kit uses for each database family
_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
}


def normalize_url(url: str | URL, *, setting: str = "QUEUEING_DATABASE_URL") -> URL:
    try:
        u = make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        # neither refusal is shown: SQLAlchemy's (before 2.0.41) holds the whole URL, password and
        # all, and a port that is not a number (``int()``'s) may be the tail of an unencoded password
        raise ConfigurationError(
            setting,
            "not a database URL SQLAlchemy reads (percent-encode '@', '/', ':' in the password)",
            "sqlite:///path.db or postgresql://user:password@host:port/db",
        ) from None
    backend = u.get_backend_name()
    if backend not in _ASYNC_DRIVERS:
        raise ConfigurationError(setting, f"database {backend!r} is not supported", "sqlite, postgresql")
    if "+" not in u.drivername or u.drivername.split("+")[1] in {"pysqlite", "psycopg2", "psycopg"}:
        u = u.set(drivername=_ASYNC_DRIVERS[backend])
    return u


def sync_url(url: str | URL) -> URL:
    """The same database through a synchronous driver (for callers' own sync connections/tests)."""
    u = normalize_url(url)
    return u.set(
        drivername={"sqlite": "sqlite+pysqlite", "postgresql": "postgresql+psycopg"}[u.get_backend_name()]
    )


#: query parameters libpq takes that hold a secret: ``?password=`` signs in as the URL's own password
#: does, ``sslpassword`` unlocks the client key (``sslkey``/``sslcert`` are paths, and stay)
SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def redact(url: str | URL) -> str:
    """``url`` fit for a log line or a terminal: its password hidden, whether in the URL's own place
    or in the query string (``?password=...``, ``?sslpassword=...``). Every line that names the
    database goes through here."""
    try:
        u = make_url(url)
    except (sa.exc.ArgumentError, ValueError):  # (a port that is not a number: ``int()``'s refusal)
        return "(not a database URL)"  # its text may hold the password: none of it is shown
    hidden = [key for key in u.query if key.lower() in SECRET_PARAMETERS]
    text = u.update_query_dict(dict.fromkeys(hidden, "***")).render_as_string(hide_password=True)
    for key in hidden:  # the query string's "***" comes back quoted: shown as the password's own is
        text = text.replace(f"{key}=%2A%2A%2A", f"{key}=***")
    return text


def sqlite_cannot_open(url: URL) -> ConfigurationError:
    """SQLite's "unable to open database file" for ``url``, as the configuration error it is (no
    retry makes a missing directory appear), naming the file and the likely cause."""
    name = url.database or ""
    path = Path(name)
    if url.query.get("uri") in ("true", "1") or name.startswith("file:"):
        why = "SQLite cannot open it (does its directory exist, and may this user write there?)"
    else:
        folder = path.absolute().parent
        if path.is_dir():
            why = "it is a directory, not a file"
        elif not folder.is_dir():
            why = f"the directory {str(folder)!r} does not exist"
        elif path.exists() and not os.access(path, os.R_OK | os.W_OK):
            why = "this user may not read and write the file"
        elif not os.access(folder, os.W_OK | os.X_OK):
            # (SQLite writes its journal, or WAL and shared-memory files, beside the database)
            why = f"this user may not write in the directory {str(folder)!r}"
        else:
            why = "SQLite cannot open it (a file system it cannot lock, or a path it cannot follow?)"
    return ConfigurationError(
        "QUEUEING_DATABASE_URL",
        f"cannot open the SQLite database {name!r}: {why}",
        "sqlite:///path/to/queue.db in a directory this user may write",
    )


#: gives the password for the next connection (e.g. a current Entra access token)
PasswordSource = Callable[[], Awaitable[str]]


def libpq_conninfo(url: URL) -> str:
    """The URL as psycopg/libpq take it: no SQLAlchemy driver suffix (and no password, unless it has one)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def create_engine(
    url: str | URL,
    *,
    password: PasswordSource | None = None,
    prepared_statements: bool = True,
    sqlite_synchronous: str = "normal",
    **kwargs: Any,
) -> AsyncEngine:
    u = normalize_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database in (None, "", ":memory:") or u.query.get("mode") == "memory":
            # each connection would have a database of its own: what one enqueues, no other sees
            raise ConfigurationError(
                "QUEUEING_DATABASE_URL",
                "an in-memory SQLite database lives and dies with one connection, and the kit keeps its "
                "queue in a file it can reopen",
                "sqlite:///path/to/queue.db",
            )
        # one connection per process: SQLite has one writer, and transactions queued on the pool wait
        # in asyncio instead of in SQLite's busy handler (which sleeps in steps of up to 100 ms)
        single: dict[str, Any] = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 120, **kwargs}
        # (the pool's rollback of a returned connection is ``_rollback_unless_clean``'s, below)
        engine = create_async_engine(
            u, async_creator=_sqlite_connector(u), pool_reset_on_return=None, **single
        )
        _tune_sqlite(engine, sqlite_synchronous)
        sa.event.listen(engine.sync_engine, "reset", _rollback_unless_clean)
        return engine
    # No pre-ping (a round trip per transaction): when a statement meets a dead connection, SQLAlchemy
    # sees the disconnect, invalidates the whole pool, and the worker's next attempt reconnects (on
    # the hot path, which runs on psycopg's connection, only that connection leaves the pool: each of
    # the others fails its next call once, and the caller retries).
    opts: dict[str, Any] = {
        "pool_size": 5,
        "max_overflow": 10,
        "pool_recycle": 1800,
        # a server that does not answer fails the connection in seconds (the caller retries)
        "connect_args": {"connect_timeout": retry_policy.PG_CONNECT_TIMEOUT},
        # the rollback of a returned connection is ``_rollback_unless_clean``'s (below): the hot path's
        # connections come back known clean, and the rest are rolled back as SQLAlchemy's own reset does
        "pool_reset_on_return": None,
    }
    # a caller's ``connect_args`` (the relaxed claims' ``synchronous_commit=off``) add to the kit's
    # own, the connect timeout included, instead of replacing them
    connect_args = {**opts["connect_args"], **kwargs.pop("connect_args", {})}
    opts.update(kwargs, connect_args=connect_args)
    if not prepared_statements:
        # a pooler that cannot keep server-side prepared statements (PgBouncer in transaction mode
        # before 1.21, or without max_prepared_statements): psycopg never prepares on these connections
        opts["connect_args"] = {**opts.get("connect_args", {}), "prepare_threshold": None}
    if password is not None:
        opts["async_creator"] = _connector(u, password, opts.pop("connect_args", {}))
    engine = create_async_engine(u, **opts)
    sa.event.listen(engine.sync_engine, "reset", _rollback_unless_clean)
    return engine


def _sqlite_connector(url: URL) -> Callable[[], Awaitable[Any]]:
    """Opens the pool's aiosqlite connections so that a cancelled caller cannot leave one open.

    aiosqlite opens its ``sqlite3`` connection in a thread of its own; when the wait for it is
    cancelled (a caller cancelled while the pool opens a connection for it) it stops the thread before
    the connection is handed over, and the ``sqlite3`` connection stays open, unreferenced, until the
    garbage collector finds it. Here the opening runs to its end whatever the caller does, and a
    connection the caller no longer waits for is closed in its thread as soon as it is open."""
    import aiosqlite
    from sqlalchemy.dialects.sqlite import aiosqlite as sa_aiosqlite

    # (the file and options of the URL as SQLAlchemy's own aiosqlite connect would pass them)
    args, kwargs = sa_aiosqlite.dialect().create_connect_args(url)
    # (``check_same_thread``: the hot path also runs on the event loop's thread, when aiosqlite's
    # thread has nothing of the connection's queued or running: see ``sqlite_thread``)
    kwargs = {**kwargs, "timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}

    def close_unclaimed(opening: asyncio.Future[aiosqlite.Connection]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            opening.result().stop()  # (its thread closes the sqlite3 connection, then ends)

    async def connect() -> aiosqlite.Connection:
        conn = aiosqlite.connect(*args, **kwargs)
        conn._thread.daemon = True  # as SQLAlchemy's own aiosqlite connect does
        count_calls(conn)  # (before its thread starts)
        opening: asyncio.Future[aiosqlite.Connection] = asyncio.ensure_future(conn)
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(close_unclaimed)
            raise
        except Exception:
            # the open failed (a missing directory, say): aiosqlite has told its thread to stop, and
            # the thread answers on this loop as it ends; waited for here, or it may answer a loop
            # closed meanwhile and print "Event loop is closed" from the thread
            await asyncio.to_thread(conn._thread.join, 5.0)
            raise

    return connect


def _connector(url: URL, password: PasswordSource, connect_args: dict[str, Any]) -> Any:
    """Every new pool connection signs in with the password current at that moment (SQLAlchemy's
    ``async_creator``: the URL's parameters are handed to psycopg here, with ``connect_args``)."""
    conninfo = libpq_conninfo(url)

    async def connect() -> Any:
        import psycopg

        return await psycopg.AsyncConnection.connect(conninfo, password=await password(), **connect_args)

    return connect


#: set on a pooled connection's ``info`` by whoever returns it out of any transaction for certain (the
#: hot paths, see :func:`borrowed`): the pool's reset skips its rollback, work for nothing (a hop to
#: aiosqlite's thread on SQLite, a call through SQLAlchemy's adapter on PostgreSQL)
RETURNED_CLEAN = "queueing_returned_clean"


def _rollback_unless_clean(dbapi_conn: Any, record: Any, state: Any) -> None:
    """The pool's ``reset`` listener on the kit's engines, which have ``pool_reset_on_return=None``:
    SQLAlchemy's own reset (``pool_reset_on_return="rollback"``), but for connections known clean.

    SQLAlchemy dispatches ``reset`` before it looks at ``pool_reset_on_return``, on every return: with
    ``None`` this is the only rollback a connection left in a transaction gets. The mark is popped on
    every return, so it holds for one return only, never for the connection's next borrower."""
    clean = record is not None and record.info.pop(RETURNED_CLEAN, False)
    if not clean:
        another_user_returned(dbapi_conn)  # (SQLite: the hot path reads the settings again)
    if not clean and state.asyncio_safe and not state.transaction_was_reset:
        dbapi_conn.rollback()


def skips_reset(engine: AsyncEngine) -> bool:
    """Whether ``engine``'s pool takes the clean mark (:func:`_rollback_unless_clean` listens to it):
    the kit's own engines, not necessarily one a caller built, which keeps SQLAlchemy's own reset."""
    # (the pool's own list of listeners: what it will call; ``sa.event.contains`` of the pool does not
    # see a listener registered on its engine, and costs four times as much)
    return _rollback_unless_clean in engine.sync_engine.pool.dispatch.reset


@dataclass
class Lent:
    """A connection of a pool, lent by :func:`borrowed`: its driver's own connection, and whether its
    borrower leaves it out of any transaction and as the pool lent it, for certain (``clean``)."""

    driver: Any
    clean: bool = False


@contextlib.asynccontextmanager
async def borrowed(engine: AsyncEngine) -> AsyncIterator[Lent]:
    """A connection straight from ``engine``'s pool, for the hot paths.

    A SQLAlchemy ``Connection`` around it (``engine.connect()``) would apply the engine's execution
    options on the way (the autocommit engine's isolation level, set on borrow and reset on return)
    and its pool would roll back on return, even a connection out of any transaction: work for
    nothing on every call. The pool's own events still run (the Entra sign-in of a new connection,
    the dialect's set-up), and its size and timeouts hold.

    On the way back the connection is marked clean (no rollback) when its borrower says so
    (``Lent.clean``) and the pool takes the mark (:func:`skips_reset`); when not clean it is
    invalidated (closed and out of the pool): its state is unknown, a connection inside a statement
    or a transaction, broken, or one whose settings could not be put back."""
    pooled = await greenlet_spawn(engine.sync_engine.pool.connect)
    pooled.info.pop(RETURNED_CLEAN, None)  # (only its own borrower marks it, and only on its return)
    lent = Lent(pooled.driver_connection)
    try:
        yield lent
    finally:
        try:
            if not pooled.is_valid:
                pass  # (already out of the pool: nothing to mark or invalidate)
            elif not lent.clean:
                await greenlet_spawn(pooled.invalidate)
            elif skips_reset(engine):
                pooled.info[RETURNED_CLEAN] = True
        finally:
            await greenlet_spawn(pooled.close)


#: SQLite's ``synchronous`` settings the kit takes (``QUEUEING_SQLITE_SYNCHRONOUS``)
SQLITE_SYNCHRONOUS = ("normal", "full")


def _tune_sqlite(engine: AsyncEngine, synchronous: str) -> None:
    if synchronous not in SQLITE_SYNCHRONOUS:
        raise ConfigurationError(
            "QUEUEING_SQLITE_SYNCHRONOUS",
            f"{synchronous!r} is not one of {', '.join(SQLITE_SYNCHRONOUS)}",
            "full",
        )

    @sa.event.listens_for(engine.sync_engine, "connect")
    def on_connect(dbapi_conn: Any, _record: Any) -> None:
        # take transaction control from the driver so every transaction starts IMMEDIATE: SQLite has
        # one writer, and a deferred transaction that upgrades to a write can fail without waiting
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
        # NORMAL: a commit survives the process's crash, and reaches the disk at the next checkpoint
        # (an OS crash or a power cut before it rolls the last commits back); FULL: at each commit
        cur.execute(f"PRAGMA synchronous={synchronous.upper()}")
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA encoding")
        (encoding,) = cur.fetchone()
        cur.close()
        if encoding != "UTF-8":
            # a file another program made UTF-16: the claim reads bodies as their stored bytes, which
            # it decodes as UTF-8 (so that one row that is not stays one malformed message), and every
            # message would have been dead-lettered unread
            raise ConfigurationError(
                "QUEUEING_DATABASE_URL",
                f"the SQLite database's text encoding is {encoding}; the kit reads UTF-8 databases only",
                "a new file (SQLite makes it UTF-8), or this one copied into one",
            )

    @sa.event.listens_for(engine.sync_engine, "begin")
    def on_begin(conn: sa.Connection) -> None:
        if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return  # single statements: SQLite makes each atomic on its own
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    # (the pool calls its dialect's ``do_terminate``; this engine's dialect is its own instance)
    dialect = engine.sync_engine.dialect
    setattr(dialect, "do_terminate", _closing_terminate(dialect.do_terminate))  # noqa: B010


def _closing_terminate(terminate: Callable[[Any], None]) -> Callable[[Any], None]:
    """SQLAlchemy terminates a pooled connection whose user was cancelled mid-statement (a caller that
    timed out, a host shutting down): a graceful close of the aiosqlite connection, shielded, and when
    the wait for it is cancelled too, a forced stop of its thread. When the stop comes first, the
    graceful close finds the connection stopping and forgets its ``sqlite3`` connection without closing
    it: that connection stays open, with whatever lock its statement held, until the garbage collector
    finds it, and the pool's next connection (the only one: ``pool_size=1``) waits for that lock up to
    the busy timeout, then fails. So the ``sqlite3`` connection's own rollback and close go first into
    its thread's queue: they run right after the statement in progress, whatever comes after them."""

    def do_terminate(adapted: Any) -> None:
        aio: Any = getattr(adapted, "_connection", None)  # the aiosqlite.Connection
        raw = getattr(aio, "_connection", None)  # its sqlite3.Connection, None once closed
        if raw is not None and getattr(aio, "_running", False):
            # (aiosqlite's queue of calls to its thread: what its own ``_execute`` and ``stop`` use;
            # no future: nobody waits for it, and a second close of a closed connection does nothing)
            aio._tx.put_nowait((None, functools.partial(_end, raw)))
        terminate(adapted)

    return do_terminate


def _end(raw: sqlite3.Connection) -> None:
    """Runs in aiosqlite's thread: the transaction ended, then the connection closed. A close alone
    is not enough: a statement the cancelled caller left unfinished (its cursor not yet collected)
    keeps the closed connection alive as a zombie, with its transaction and its write lock."""
    try:
        raw.rollback()  # (the ROLLBACK aborts the unfinished statements too)
    finally:
        raw.close()
