"""How durable a claim is on PostgreSQL: the setting reaches the connections claims really run on."""

from __future__ import annotations

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import make_provider
from queueing_core.decisions import Complete
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.settings import load_settings
from queueing_core.transport import Settlement


@queue("durability")
class Job(QueueMessage):
    n: int


def app() -> QueueingApp:
    a = QueueingApp("durability")

    @a.handler()
    async def handle(msg: Job) -> None:
        return None

    return a


async def synchronous_commit(engine) -> str:
    async with engine.connect() as conn:
        return str((await conn.execute(sa.text("SHOW synchronous_commit"))).scalar_one())


async def test_claims_are_durable_by_default(pg_db):
    prov = pg_db.provider()
    await prov.open(app())
    assert prov.durable_claims
    assert prov.claims is prov.auto  # no pool of their own: the engine's, in autocommit
    assert await synchronous_commit(prov.claims) == "on"
    assert await synchronous_commit(prov.engine) == "on"


async def test_relaxed_claims_skip_the_wal_flush_and_nothing_else_does(pg_db):
    prov = pg_db.provider(durable_claims=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    assert prov.claims is not prov.auto
    assert await synchronous_commit(prov.claims) == "off"
    assert await synchronous_commit(prov.engine) == "on"  # settlements and enqueues stay durable
    assert await synchronous_commit(prov.auto) == "on"
    # and the relaxed path claims, renews and settles like the durable one
    await a.enqueue_many([Job(n=i) for i in range(3)])
    got = await prov.receive(a.subscription("Job"), 10)
    assert len(got) == 3
    assert await prov.renew(got) == []
    await prov.settle([Settlement(d, Complete()) for d in got])
    assert not any(d.refused for d in got)
    assert await prov.receive(a.subscription("Job"), 10) == []


async def test_the_setting_reaches_the_claim_connection(pg_db, monkeypatch):
    monkeypatch.setenv("QUEUEING_DATABASE_SCHEMA", pg_db.schema)
    for value, expected in (("false", "off"), ("true", "on")):
        monkeypatch.setenv("QUEUEING_DURABLE_CLAIMS", value)
        settings = load_settings(provider="sql", database_url=pg_db.url)
        prov = make_provider(settings)
        assert isinstance(prov, SqlProvider)
        pg_db.providers.append(prov)  # closed by the fixture
        await prov.open(app())
        assert await synchronous_commit(prov.claims) == expected
