"""A schema name with an upper-case letter is refused up front, with the reason, and nothing is made.

The kit writes the schema name unquoted into its DDL, its triggers' functions and LISTEN, where
PostgreSQL folds it to lower case, while SQLAlchemy quotes it and keeps its case: before, such a name
was accepted, the tables were made in the quoted schema, and the migration that adds the count
triggers failed with ``schema "…" does not exist`` (the provider never opened); LISTEN and NOTIFY would
also have used two different channels. A lower-case name works as before (the integration suite's
own schemas are all lower case).
"""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from queueing_core.errors import ConfigurationError
from queueing_core.providers.sql import SqlProvider, create_engine
from queueing_core.settings import load_settings
from tests.services import POSTGRES_URL, drop_schema, require


async def schemas_named(*names: str) -> list[str]:
    engine = create_engine(POSTGRES_URL)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                sa.text("SELECT nspname FROM pg_namespace WHERE nspname = ANY(:names)"),
                {"names": list(names)},
            )
            return sorted(r[0] for r in rows)
    finally:
        await engine.dispose()


async def test_a_mixed_case_schema_is_refused_before_anything_is_made():
    require("PostgreSQL", "127.0.0.1", 5432)
    name = f"Qi_{uuid.uuid4().hex[:10]}"
    try:
        # (before: the constructor took it, and opening the provider failed at migration 2 with
        # ``schema "qi_…" does not exist``, having made the quoted schema and its first tables)
        with pytest.raises(ConfigurationError) as refused:
            SqlProvider(POSTGRES_URL, schema=name)
        assert refused.value.setting == "QUEUEING_DATABASE_SCHEMA"
        assert name in str(refused.value)
        assert "lower-case" in str(refused.value)
        # neither spelling of the schema exists: the refusal came before any DDL
        assert await schemas_named(name, name.lower()) == []
    finally:
        await drop_schema(name)
        await drop_schema(name.lower())


def test_the_setting_refuses_it_too_and_says_what_would_do():
    with pytest.raises(ConfigurationError) as refused:
        load_settings(database_schema="Staging")
    assert "QUEUEING_DATABASE_SCHEMA" in str(refused.value)
    assert load_settings(database_schema="staging_2").database_schema == "staging_2"
