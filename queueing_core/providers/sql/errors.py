"""The kit's one translation of database driver errors: unreachable -> ProviderUnavailable, the rest of
the driver's failures -> ProviderError. It covers SQLAlchemy's wrapped errors and the drivers' own, which
the hot paths (``driver`` for psycopg, ``sqlite_driver`` for ``sqlite3``) meet without SQLAlchemy in
between; each driver's error class maps as SQLAlchemy's wrapper of it does."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Iterator

import sqlalchemy as sa

from ...errors import ProviderError, ProviderUnavailable
from ...errors import first_line as first_line  # (where the delayed store's breaker takes it from)


@functools.cache
def _psycopg() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """psycopg's (connection-level, every) error classes; none when the driver is not installed."""
    try:
        import psycopg
    except ImportError:  # a SQLite-only install
        return (), ()
    return (psycopg.OperationalError, psycopg.InterfaceError), (psycopg.Error,)


def down_errors() -> tuple[type[BaseException], ...]:
    """Errors that say the database cannot be reached (or the connection broke): worth a retry."""
    # (sqlite3's as SQLAlchemy wraps them: OperationalError, e.g. "database is locked", is its
    # OperationalError, so a retry, as on the SQLAlchemy path)
    sqlite = (sqlite3.OperationalError, sqlite3.InterfaceError)
    # (the pool's own: no connection came free within its timeout, the database busy or not answering)
    pool = (sa.exc.TimeoutError,)
    return (
        OSError,
        ConnectionError,
        sa.exc.OperationalError,
        sa.exc.InterfaceError,
        *pool,
        *sqlite,
        *_psycopg()[0],
    )


def driver_errors() -> tuple[type[BaseException], ...]:
    """Every error of the database layer (the statement failed, for whatever reason)."""
    return (sa.exc.SQLAlchemyError, sqlite3.Error, *_psycopg()[1])


def _undecodable(exc: BaseException) -> bool:
    """``sqlite3``'s "Could not decode to UTF-8 column ...": a stored text that another program wrote
    in another encoding, met while fetching a row. An OperationalError (as SQLAlchemy wraps it too), yet
    the data's fault, not the database's absence: read as an outage it is retried for ever, and every
    caller is told the database is unreachable while it answers."""
    error = getattr(exc, "orig", None) or exc
    return isinstance(error, sqlite3.OperationalError) and str(error).startswith("Could not decode to UTF-8")


@contextlib.contextmanager
def db_boundary(action: str, store: str = "database") -> Iterator[None]:
    """Driver errors become the kit's: unreachable -> ProviderUnavailable, the rest -> ProviderError."""
    try:
        yield
    except ProviderError:
        raise
    except down_errors() as exc:
        if _undecodable(exc):
            raise ProviderError(f"{store}: {action} failed: {first_line(exc)}") from None
        raise ProviderUnavailable(f"{store} unreachable during {action}: {first_line(exc)}") from None
    except driver_errors() as exc:
        raise ProviderError(f"{store}: {action} failed: {first_line(exc)}") from None
