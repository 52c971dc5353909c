"""The PostgreSQL hot path: claims, lease renewals and settlements on psycopg's own async connection.

SQLAlchemy runs the async driver through its greenlet bridge: every statement crosses it, and its
result machinery wraps every row. On the hot path (a claim and a settlement per batch, renewals) that
was a quarter of the worker's CPU. Here the same statements run on the psycopg connection itself:

- **one source of SQL**: the statements are still the SQLAlchemy Core objects of ``statements``,
  compiled once per provider for the psycopg dialect (:class:`Compiled`): the text, the constant values
  the statement binds, and SQLAlchemy's bind processors (JSON) are kept and reused;
- **the same connections**: each call borrows a connection from the provider's SQLAlchemy pool (the
  ``claims`` engine for claims and renewals, the autocommit engine for settlements), so the pools'
  sizes, the Entra token sign-in of each new connection and ``synchronous_commit=off`` on relaxed
  claims (a setting of their own pool's connections) are exactly those of the rest of the provider;
- **straight from the pool** (``engine.borrowed``, shared with the SQLite hot path): not through a
  SQLAlchemy ``Connection``, which on both engines (each in ``AUTOCOMMIT``) set the isolation level on
  the way out and reset it on the way back, and whose pool then rolled back even an idle connection.
  Here psycopg's autocommit (what ``AUTOCOMMIT`` is to SQLAlchemy's psycopg dialect) is turned on for
  the call and put back before the connection returns, neither a round trip on an idle connection,
  so SQLAlchemy's users of the pool find it as SQLAlchemy left it. It returns marked clean
  (``engine.RETURNED_CLEAN``: the kit's engines have ``pool_reset_on_return=None`` and a ``reset``
  listener that rolls back every connection not so marked) only when it is certainly out of any
  transaction, statement and pipeline; otherwise (a call cancelled mid-statement that psycopg could
  not get out of, a broken connection) it is invalidated: its state is not worth a guess, and it is
  rare. An engine passed in by the caller has no such listener: its connections are not marked, and
  its pool's own reset runs;
- **prepared statements**: each statement is prepared on the server at its first use on a connection
  (off when the provider's ``prepared_statements`` is false: poolers that cannot keep them);
- **rows in binary, as tuples**: results come in PostgreSQL's binary format (a timestamp, a UUID or an
  integer is read from its bytes, not parsed from text, whatever the session's ``DateStyle``) and as
  plain tuples, zipped with the statement's column names (read once per statement: its text, hence
  its columns, never changes) into the rows the callers read; psycopg's own dict rows would describe
  every column of every result again;
- **times in UTC**: a ``timestamptz`` read in binary on these connections comes back in UTC (the same
  instant), not converted to the session's time zone: the kit works in UTC, and converting each time
  to the session's zone (a ``ZoneInfo``) and back, once per time read and again at every use, was
  about 7 % of the hot path's instructions; and a time late in year 9999 stays readable in a session
  ahead of UTC (there it would be in year 10000, which no ``datetime`` holds, and the claim carrying
  it failed as a whole). Only binary reads change (SQLAlchemy reads in text), on the connections the
  hot path borrows;
- **pipeline mode**: a settlement batch (every kind of outcome and its wake-ups), a settlement batch
  with the next claim, or a renewal of several queues is one round trip. The statements between two
  syncs run in one implicit transaction, so the batch commits (one WAL flush) or fails as a whole, as
  the transaction of the SQLAlchemy path did; a statement whose lease guard refuses its row changes
  nothing and fails nothing, and its own row count says which one it was.

Errors of psycopg go through the provider's one translation (``errors.db_boundary``); a connection
psycopg reports broken is invalidated in SQLAlchemy's pool, as SQLAlchemy does on a disconnect. A
statement's error leaves the connection idle (autocommit, or the pipeline's sync, ends its implicit
transaction): it goes back to the pool as any other.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from struct import Struct
from typing import TYPE_CHECKING, Any, cast

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from .engine import borrowed
from .errors import db_boundary

if TYPE_CHECKING:
    import psycopg
    from sqlalchemy.sql.compiler import SQLCompiler


@functools.cache
def _idle() -> tuple[Any, Any]:
    """psycopg's words for a connection out of any transaction and out of pipeline mode."""
    from psycopg.pq import PipelineStatus, TransactionStatus

    return TransactionStatus.IDLE, PipelineStatus.OFF


def _out_of_transaction(pg: psycopg.AsyncConnection[Any]) -> bool:
    """Certainly out of any transaction and any statement: usable by the pool's next borrower as it is.
    (Inside a statement, a transaction or a pipeline, or broken: a cancellation mid-round-trip, an
    error psycopg could not get out of; its state is not worth guessing.)"""
    idle, off = _idle()
    pgconn = pg.pgconn
    return (
        not pg.broken
        and not pg.closed
        and pgconn.transaction_status == idle
        and pgconn.pipeline_status == off
    )


#: PostgreSQL's ``timestamptz``: its OID, the instant its binary value counts microseconds from, and that
#: value's layout (a signed 64-bit integer, network order)
_TIMESTAMPTZ_OID = 1184
_PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_INT8 = Struct("!q")
#: how PostgreSQL stores ``infinity`` and ``-infinity`` in a ``timestamptz``
_INFINITIES = {2**63 - 1: "infinity", -(2**63): "-infinity"}


@functools.cache
def _utc_timestamptz() -> type[Any]:
    """psycopg's loader of a binary ``timestamptz``, but for the zone of the time it returns: UTC, not the
    session's (see the module). A time no ``datetime`` holds (``infinity``, a year outside 1-9999 in UTC)
    is read as text naming it, not raised as psycopg's loader does: raised, it failed the whole claim, so
    one row damaged outside the kit stopped its queue; as text, that row's envelope does not decode and
    it is dead-lettered alone as malformed, like any other damaged row."""
    from psycopg.adapt import Loader
    from psycopg.pq import Format

    class UtcTimestamptzLoader(Loader):
        format = Format.BINARY

        def load(self, data: Any) -> datetime | str:
            micros: int = _INT8.unpack(data)[0]
            try:
                return _PG_EPOCH + timedelta(0, 0, micros)
            except OverflowError:
                if micros in _INFINITIES:
                    return _INFINITIES[micros]
                return f"timestamp out of range ({micros} microseconds from 2000-01-01 UTC)"

    return UtcTimestamptzLoader


def _read_times_in_utc(pg: psycopg.AsyncConnection[Any]) -> None:
    """The binary ``timestamptz`` loader of ``pg`` made :func:`_utc_timestamptz`'s, once per connection
    (its cursors copy the connection's loaders when they are made)."""
    from psycopg.pq import Format

    loader = _utc_timestamptz()
    if pg.adapters.get_loader(_TIMESTAMPTZ_OID, Format.BINARY) is not loader:
        pg.adapters.register_loader(_TIMESTAMPTZ_OID, loader)


class Compiled:
    """One statement as the driver receives it (psycopg, or ``sqlite3`` on the SQLite hot path): SQL
    text with named placeholders, its constant values, the processors SQLAlchemy would apply to the
    values bound at run time, and those it would apply to the columns the statement returns."""

    def __init__(self, stmt: sa.ClauseElement, dialect: sa.Dialect) -> None:
        compiled = cast("SQLCompiler", stmt.compile(dialect=dialect))
        if compiled.literal_execute_params or compiled.post_compile_params:
            # an expanding IN has a new text per number of values: not one statement to prepare
            raise ValueError("a hot-path statement must have one text for any values (no expanding IN)")
        self.sql: str = compiled.string
        #: the names of the columns it returns, in order: read from its first result (see ``_result``)
        self.names: tuple[str, ...] | None = None
        self.defaults: dict[str, Any] = dict(compiled.params)
        #: the values each execution must bring (a forgotten one must not run as NULL)
        self.required = frozenset(name for name, bp in compiled.binds.items() if bp.required)
        # (a sequence of processors belongs to a tuple-valued parameter: the hot path binds none)
        self.processors: dict[str, Callable[[Any], Any]] = {
            k: f for k, f in compiled._bind_processors.items() if callable(f)
        }
        #: by returned column: what turns the driver's value into SQLAlchemy's (a timestamp or a UUID
        #: stored as text on SQLite); psycopg returns those types itself, so its path needs none
        self.results: dict[str, Callable[[Any], Any]] = {}
        for column in compiled._result_columns:
            process = self.result_processor(column.type, dialect)
            if process is not None:
                self.results[column.keyname] = process

    def result_processor(self, type_: Any, dialect: sa.Dialect) -> Callable[[Any], Any] | None:
        """What turns the driver's value of a returned column of ``type_`` into the row's value."""
        process: Callable[[Any], Any] | None = type_._cached_result_processor(dialect, None)
        return process

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        if not self.required <= values.keys():
            raise ValueError(f"no value for {sorted(self.required - values.keys())}")
        out = {**self.defaults, **values}
        for name, process in self.processors.items():
            out[name] = process(out[name])
        return out


@dataclass
class Result:
    """What one statement of a round trip did: its row count and the rows it returned."""

    rowcount: int
    rows: list[dict[str, Any]]


class DriverPath:
    """Runs compiled statements on the psycopg connection of a SQLAlchemy pooled connection."""

    def __init__(self, *, prepare: bool) -> None:
        self.prepare = prepare

    @contextlib.asynccontextmanager
    async def connection(self, engine: AsyncEngine) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A psycopg connection of ``engine``'s pool, in autocommit for the call (see the module)."""
        async with borrowed(engine) as lent:
            pg: psycopg.AsyncConnection[Any] = lent.driver
            # as SQLAlchemy left it (its reset of the autocommit engine's isolation level turns
            # autocommit off); neither change is a round trip on an idle connection
            left = pg.autocommit
            try:
                if not left:
                    await pg.set_autocommit(True)
                yield pg
            finally:
                # whatever happened (an error, a cancelled caller): back to the pool only as it was
                # lent, out of any transaction with autocommit as it was; else ``borrowed`` takes it
                # out of the pool (psycopg refuses to change autocommit inside a transaction anyway)
                if _out_of_transaction(pg):
                    try:
                        if pg.autocommit != left:
                            await pg.set_autocommit(left)
                    finally:
                        # (psycopg's wait may yield once to a loop that has been busy for a while:
                        # a cancellation there finds autocommit already put back, and the connection
                        # is as good as any; only one not as it was lent leaves the pool)
                        lent.clean = pg.autocommit == left and _out_of_transaction(pg)

    async def run(
        self, engine: AsyncEngine, action: str, work: Sequence[tuple[Compiled, Mapping[str, Any]]]
    ) -> list[Result]:
        """``work`` in one round trip on a connection of ``engine``, errors translated."""
        with db_boundary(action):
            async with self.connection(engine) as pg:
                return await self.round_trip(pg, work)

    async def round_trip(
        self, pg: psycopg.AsyncConnection[Any], work: Sequence[tuple[Compiled, Mapping[str, Any]]]
    ) -> list[Result]:
        """One statement alone, or several in a pipeline (one implicit transaction, one sync)."""
        from psycopg.rows import tuple_row

        _read_times_in_utc(pg)
        if len(work) == 1:
            stmt, values = work[0]
            cur = pg.cursor(row_factory=tuple_row)
            await cur.execute(stmt.sql, stmt.params(values), prepare=self.prepare, binary=True)
            return [await _result(cur, stmt)]
        sent = []
        async with pg.pipeline():
            for stmt, values in work:
                cur = pg.cursor(row_factory=tuple_row)
                await cur.execute(stmt.sql, stmt.params(values), prepare=self.prepare, binary=True)
                sent.append((cur, stmt))
        return [await _result(cur, stmt) for cur, stmt in sent]


async def _result(cur: psycopg.AsyncCursor[tuple[Any, ...]], stmt: Compiled) -> Result:
    """What ``stmt`` did on ``cur``: its row count, and its rows as dicts by column name."""
    from psycopg.pq import ExecStatus

    res = cur.pgresult
    if res is None or res.status != ExecStatus.TUPLES_OK:
        return Result(cur.rowcount, [])  # (no rows to read: an UPDATE without RETURNING)
    names = stmt.names
    if names is None:
        # (``description`` builds an object per column on every call: once per statement is enough)
        names = stmt.names = tuple(column.name for column in cur.description or ())
    return Result(cur.rowcount, [dict(zip(names, row, strict=True)) for row in await cur.fetchall()])


class HotStatements:
    """The hot path's statements of a provider (``statements.Statements``), compiled for its driver
    (``dialect``: psycopg's, or SQLite's with named parameters and ``sqlite_driver.SqliteCompiled``)."""

    def __init__(self, statements: Any, dialect: sa.Dialect, compiled: type[Compiled] = Compiled) -> None:
        self.claim = compiled(statements.claim, dialect)
        self.claim_head = compiled(statements.claim_head, dialect)
        self.complete_many = compiled(statements.complete_many, dialect)
        self.settle = {shape: compiled(stmt, dialect) for shape, stmt in statements.settle.items()}
        self.renew = compiled(statements.renew, dialect)
        self.notify = compiled(statements.notify, dialect)
