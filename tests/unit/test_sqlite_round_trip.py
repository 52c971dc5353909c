"""The SQLite hot path's one function in aiosqlite's thread, on a real ``sqlite3`` connection: a
transaction it cannot roll back is never left open for the connection's next user."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace
from typing import Any

import pytest

from queueing_core.providers.sql import sqlite_driver


class RollbackFails:
    """A real connection whose ROLLBACK fails (as a disk I/O error would make it)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *params: Any) -> sqlite3.Cursor:
        if sql == "ROLLBACK":
            raise sqlite3.OperationalError("disk I/O error")
        return self.db.execute(sql, *params)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def close(self) -> None:
        self.db.close()


def statement(sql: str) -> Any:
    return SimpleNamespace(sql=sql, results={})


def test_a_transaction_that_cannot_be_rolled_back_is_closed_before_anyone_else_runs(tmp_path):
    path = tmp_path / "q.db"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE t (v TEXT)")
    setup.close()
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    work = [
        (statement("INSERT INTO t (v) VALUES ('partial')"), {}),
        (statement("INSERT INTO nope VALUES (1)"), {}),
    ]

    with pytest.raises(sqlite_driver._Unusable):
        sqlite_driver._round_trip(RollbackFails(db), work)

    # the next user of that connection cannot join (or, in autocommit, commit) the half-done transaction
    with pytest.raises(sqlite3.ProgrammingError):
        db.execute("INSERT INTO t (v) VALUES ('next user')")
    reader = sqlite3.connect(path)
    assert reader.execute("SELECT v FROM t").fetchall() == []
    reader.close()
