"""The hot path's statements compiled for psycopg: one text for any values, every value required."""

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
    # the SQLite form of the statements expands its lists: it never goes to the hot path
    with pytest.raises(ValueError, match="expanding"):
        HotStatements(Statements(Tables.build(None), "w", "sqlite"), pg_dialect.dialect())
