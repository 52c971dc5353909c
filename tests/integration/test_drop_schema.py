"""The test suite's schema clean-up on PostgreSQL: a session left in a transaction on a test's tables
fails the clean-up within its lock timeout, naming that session, instead of hanging the test."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from queueing_core.providers.sql import create_engine
from tests.services import POSTGRES_URL, drop_schema, require


@pytest.fixture
def schema():
    require("PostgreSQL", "127.0.0.1", 5432)
    return f"qdrop_{uuid.uuid4().hex[:10]}"


async def test_a_lock_left_on_a_table_fails_the_drop_and_names_its_session(schema):
    engine = create_engine(POSTGRES_URL)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            await conn.execute(sa.text(f'CREATE TABLE "{schema}".t (id int)'))
        async with engine.connect() as holder:
            await holder.execute(sa.text("SET application_name = 'left-open-by-a-test'"))
            await holder.execute(sa.text(f'SELECT * FROM "{schema}".t'))  # a transaction, its lock held
            with pytest.raises(AssertionError, match=f"schema {schema} not dropped within 0.5 s") as err:
                await drop_schema(schema, lock_timeout=0.5)
            assert "left-open-by-a-test" in str(err.value)
            await holder.rollback()
        await drop_schema(schema)  # released: dropped
        async with engine.connect() as conn:
            left = await conn.execute(
                sa.text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}
            )
            assert left.scalar() == 0
    finally:
        async with engine.begin() as conn:
            await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        await engine.dispose()
