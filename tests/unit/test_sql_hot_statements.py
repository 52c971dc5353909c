"""The hot path's statements, for psycopg and SQLite: one text for any values, every value required."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as pg_dialect

from queueing_core.providers.sql.driver import Compiled, HotStatements
from queueing_core.providers.sql.schema import Tables
from queueing_core.providers.sql.statements import Statements, bind, leases_of


def hot() -> HotStatements:
    return HotStatements(Statements(Tables.build("s"), "worker-1", "postgresql"), pg_dialect.dialect())


def test_each_statement_has_one_text_whatever_the_number_of_rows():
    h = hot()
    few = h.complete_many.params({**leases_of("postgresql", [1], [3]), **bind(now=None)})
    many = h.complete_many.params({**leases_of("postgresql", list(range(50)), [0] * 50), **bind(now=None)})
    assert few["b_ids"] == [1]
    assert len(many["b_ids"]) == 50
    assert "%(b_ids)s" in h.complete_many.sql
    assert "%(b_tokens)s" in h.complete_many.sql
    # the lease fence and the worker's name are in the statement, not left to the caller
    assert "lease_token" in h.complete_many.sql
    assert h.complete_many.defaults["locked_by_1"] == "worker-1"
    assert "lease_token" in h.settle["retry"].sql


def test_a_forgotten_value_is_an_error_not_a_null():
    with pytest.raises(ValueError, match="b_token"):
        hot().settle["expire"].params(bind(id=1, now=None))


def test_an_expanding_in_cannot_be_a_hot_statement():
    t = Tables.build(None).messages
    stmt = sa.select(t.c.id).where(t.c.id.in_(sa.bindparam("ids", expanding=True)))
    with pytest.raises(ValueError, match="expanding"):
        Compiled(stmt, pg_dialect.dialect())


def test_the_sqlite_statements_have_one_text_too():
    """SQLite's fence reads its (id, token) pairs from one JSON value: one text for any number of rows,
    with named parameters, which sqlite3 takes from a dict."""
    from sqlalchemy.dialects.sqlite import aiosqlite

    h = HotStatements(
        Statements(Tables.build(None), "worker-1", "sqlite"), aiosqlite.dialect(paramstyle="named")
    )
    few = h.complete_many.params({**leases_of("sqlite", [1], [3]), **bind(now=None)})
    many = h.renew.params({**leases_of("sqlite", list(range(50)), [0] * 50), **bind(until=None)})
    assert few["b_leases"] == "[[1, 3]]"
    assert many["b_leases"].count("[") == 51
    assert ":b_leases" in h.complete_many.sql
    assert "json_each" in h.renew.sql
    assert h.complete_many.defaults["locked_by_1"] == "worker-1"
    # SQLite returns timestamps and UUIDs as text: SQLAlchemy's result processors come along
    assert {"created_at", "message_id", "locked_until"} <= h.claim.results.keys()


def test_the_sqlite_fence_finds_its_rows_by_primary_key():
    """The JSON pairs are read by ``json_each``; the rows must still be found on the primary key, not by
    a scan of the messages table (which grows with the history of every message)."""
    import json

    from sqlalchemy.dialects.sqlite import aiosqlite

    tables = Tables.build(None)
    h = HotStatements(Statements(tables, "w", "sqlite"), aiosqlite.dialect(paramstyle="named"))
    engine = sa.create_engine("sqlite://")
    with engine.begin() as conn:
        tables.metadata.create_all(conn)
    values = {"b_leases": json.dumps([[1, 1], [2, 1]]), "b_now": "2026-01-01", "b_until": "2026-01-01"}
    with engine.connect() as conn:
        db = conn.connection.driver_connection
        for stmt in (h.complete_many, h.renew):
            params = {k: v for k, v in {**stmt.defaults, **values}.items() if f":{k}" in stmt.sql}
            plan = [row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {stmt.sql}", params)]
            assert any("queueing_messages USING INTEGER PRIMARY KEY" in p for p in plan), plan
            assert not any(p.startswith("SCAN queueing_messages") for p in plan), plan
    engine.dispose()
