"""Databases for the SQL integration tests: a SQLite file, or a fresh PostgreSQL schema, per test."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest
import sqlalchemy as sa

from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.engine import sync_url
from tests.contract.conftest import harness  # noqa: F401  (every transport, as the contract suite runs them)
from tests.services import POSTGRES_URL, drop_schema, require


@dataclass
class SqlDb:
    backend: str
    url: str
    schema: str | None
    providers: list[SqlProvider] = field(default_factory=list)

    def provider(self, **kw) -> SqlProvider:
        kw.setdefault("maintenance_interval", 0.2)
        prov = SqlProvider(self.url, schema=self.schema, **kw)
        self.providers.append(prov)
        return prov

    def sync_engine(self) -> sa.Engine:
        kwargs = {}
        if self.schema:
            kwargs["connect_args"] = {"options": f"-csearch_path={self.schema}"}
        return sa.create_engine(sync_url(self.url), **kwargs)


@pytest.fixture(params=["sqlite", "postgres"])
async def sql_db(request, tmp_path):
    if request.param == "sqlite":
        db = SqlDb("sqlite", f"sqlite:///{tmp_path}/q.db", None)
        yield db
        for p in db.providers:
            await p.close()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qi_{uuid.uuid4().hex[:10]}"
    db = SqlDb("postgresql", POSTGRES_URL, schema)
    yield db
    for p in db.providers:
        await p.close()
    await drop_schema(schema)


@pytest.fixture
async def pg_db():
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qi_{uuid.uuid4().hex[:10]}"
    db = SqlDb("postgresql", POSTGRES_URL, schema)
    yield db
    for p in db.providers:
        await p.close()
    await drop_schema(schema)


@pytest.fixture
async def api(sql_db):
    """The ops API over a fresh SQL store with the test app: (client with the key, runtime, handled)."""
    import httpx

    from queueing_core.ops import OpsService
    from queueing_core.ops.api import PREFIX, create_app
    from queueing_core.runtime import Runtime

    from .test_ops_api import AUTH, KEY, build_app

    app, sent = build_app()
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
        base_url="http://test" + PREFIX,
        headers=AUTH,
    )
    yield client, rt, sent
    await client.aclose()
    await rt.close()
