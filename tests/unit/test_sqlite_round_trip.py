"""The SQLite hot path's one transaction, on a real ``sqlite3`` connection: a transaction it cannot roll
back is never left open for the connection's next user, and a call on the event loop's thread that meets
another connection's lock leaves nothing behind and hands the work on whole."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace
from typing import Any

import pytest

from queueing_core.providers.sql import sqlite_driver


class FailsOnce:
    """A real connection on which one statement (``sql``) fails once, with ``error``: a ROLLBACK that a
    disk I/O error fails, a COMMIT that finds the database locked, an interrupt between two PRAGMAs."""

    def __init__(self, db: sqlite3.Connection, sql: str, error: BaseException) -> None:
        self.db, self.sql, self.error = db, sql, error
        self.failed = False

    def execute(self, sql: str, *params: Any) -> sqlite3.Cursor:
        if sql == self.sql and not self.failed:
            self.failed = True
            raise self.error
        return self.db.execute(sql, *params)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def close(self) -> None:
        self.db.close()


def statement(sql: str) -> Any:
    return SimpleNamespace(sql=sql, results={})


def opened(path: Any, *schema: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # (the kit's: a commit flushes nothing)
    for sql in schema:
        db.execute(sql)
    return db


def test_a_transaction_that_cannot_be_rolled_back_is_closed_before_anyone_else_runs(tmp_path):
    path = tmp_path / "q.db"
    opened(path, "CREATE TABLE t (v TEXT)").close()
    db = opened(path)
    work = [
        (statement("INSERT INTO t (v) VALUES ('partial')"), {}),
        (statement("INSERT INTO nope VALUES (1)"), {}),
    ]

    with pytest.raises(sqlite_driver._Unusable):
        sqlite_driver._round_trip(FailsOnce(db, "ROLLBACK", sqlite3.OperationalError("disk I/O error")), work)  # type: ignore[arg-type]

    # the next user of that connection cannot join (or, in autocommit, commit) the half-done transaction
    with pytest.raises(sqlite3.ProgrammingError):
        db.execute("INSERT INTO t (v) VALUES ('next user')")
    reader = sqlite3.connect(path)
    assert reader.execute("SELECT v FROM t").fetchall() == []
    reader.close()


def test_a_lock_met_at_commit_rolls_the_call_back_and_hands_it_on(tmp_path):
    """A call on the event loop's thread that meets the lock after its statements ran (at COMMIT)
    leaves nothing behind: its transaction is rolled back, None hands it to aiosqlite's thread, and the
    connection's settings are put back."""
    db = opened(tmp_path / "q.db", "CREATE TABLE t (v TEXT)")
    state = sqlite_driver._settings(db)
    work = [(statement("INSERT INTO t (v) VALUES ('once')"), {})]
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY  # type: ignore[attr-defined]
    assert sqlite_driver._inline(FailsOnce(db, "COMMIT", busy), work, state) is None  # type: ignore[arg-type]
    assert not db.in_transaction
    assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)
    assert db.execute("PRAGMA busy_timeout").fetchone() == (state.busy_timeout,)
    assert db.execute("PRAGMA wal_autocheckpoint").fetchone() == (state.autocheckpoint,)
    # the same work again (in aiosqlite's thread, as the caller does): once
    sqlite_driver._round_trip(db, work)
    assert db.execute("SELECT count(*) FROM t").fetchone() == (1,)
    db.close()


def test_an_interrupt_between_the_two_settings_still_puts_both_back(tmp_path):
    """A ``KeyboardInterrupt`` (a signal's, where no handler catches it) after the busy timeout went to
    0 and before anything else: the connection's own settings are back before it propagates."""
    db = opened(tmp_path / "q.db", "CREATE TABLE t (v TEXT)")
    settings = sqlite_driver._settings(db)
    work = [(statement("INSERT INTO t (v) VALUES ('never')"), {})]
    interrupted = FailsOnce(db, "PRAGMA wal_autocheckpoint = 0", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        sqlite_driver._inline(interrupted, work, settings)  # type: ignore[arg-type]
    assert db.execute("PRAGMA busy_timeout").fetchone() == (settings.busy_timeout,)
    assert db.execute("PRAGMA wal_autocheckpoint").fetchone() == (settings.autocheckpoint,)
    assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)
    db.close()


def test_the_next_checkpoint_is_due_after_as_many_transactions_as_make_sqlites_threshold(tmp_path):
    """After ``n`` write transactions the checkpoint finds F frames of WAL (counted here from the WAL
    file's own size: a 32-byte header, then each frame a 24-byte header and a page): the next one is
    due after as many transactions as write ``wal_autocheckpoint`` pages at that rate."""
    path = tmp_path / "q.db"
    db = opened(path, "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("PRAGMA wal_autocheckpoint = 0")
    for _ in range(40):  # (each: a row of half a page, so some transactions write two pages)
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO t (v) VALUES (?)", ("x" * 2000,))
        db.execute("COMMIT")
    (page,) = db.execute("PRAGMA page_size").fetchone()
    frames = (path.with_name("q.db-wal").stat().st_size - 32) // (24 + page)
    db.execute("PRAGMA wal_autocheckpoint = 1000")
    state = sqlite_driver.Inline(thread=0, settings=sqlite_driver._settings(db))
    sqlite_driver._checkpoint(db, state, 40)
    assert frames > 40
    assert state.checkpoint_every == round(1000 / (frames / 40))
    assert state.restart  # (nothing read or wrote meanwhile: it copied the whole WAL)
    db.close()


def test_a_call_from_another_thread_than_the_first_goes_to_aiosqlites_thread(tmp_path):
    """The calls on the event loop's thread rely on there being one such thread: a call from another
    (a second event loop sharing the engine, which SQLAlchemy forbids) is handed on, never run."""
    import threading

    from queueing_core.providers.sql.sqlite_thread import Calls

    db = opened(tmp_path / "q.db", "CREATE TABLE t (v TEXT)")
    calls = Calls(queue=None)
    calls.inline = sqlite_driver.Inline(thread=threading.get_ident() + 1)
    work = [(statement("INSERT INTO t (v) VALUES ('never')"), {})]
    assert sqlite_driver.SqliteDriverPath()._inline(db, work, calls) is None  # type: ignore[arg-type]
    assert db.execute("SELECT count(*) FROM t").fetchone() == (0,)
    db.close()
