"""SQL provider: the database being unreachable reaches callers as the kit's ProviderUnavailable.

Before, only the claim, settle and renew paths went through the provider's translation
(``errors.db_boundary``): with PostgreSQL cut off, ``app.enqueue`` and ``provider.maintain`` raised
SQLAlchemy's raw ``OperationalError`` (the other transports raise ProviderUnavailable), and the ops
API answered ``GET health`` and ``GET stats`` with a 500 ``internal`` and a traceback in the log, where
it documents "the store being unreachable is a 503". PostgreSQL is cut off for real, by a TCP proxy in
front of it; SQLite's equivalent is its write lock held by another process past the busy timeout.
"""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import AsyncIterator

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import ops_client, wait_until
from tests.services import drop_schema, require
from tests.tcp_proxy import TcpProxy

STORE_UNAVAILABLE = "urn:queueing-kit:problem:store-unavailable"


@queue("outage-sql/job")
class Job(QueueMessage):
    n: int


@queue("outage-sql/sync", idempotent=True, identity="account")
class Sync(QueueMessage):
    account: str


def make_app() -> QueueingApp:
    app = QueueingApp("outage-sql")

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    app.message(Sync)
    return app


@pytest.fixture
async def proxy() -> AsyncIterator[TcpProxy]:
    require("PostgreSQL", "127.0.0.1", 5432)
    p = TcpProxy("127.0.0.1", 5432)
    await p.start()
    yield p
    await p.stop()


@contextlib.asynccontextmanager
async def through(proxy: TcpProxy) -> AsyncIterator[tuple[Runtime, SqlProvider]]:
    """A runtime on PostgreSQL through ``proxy``, in a schema of its own (dropped after)."""
    schema = f"outage_{uuid.uuid4().hex[:10]}"
    provider = SqlProvider(
        f"postgresql://postgres@127.0.0.1:{proxy.port}/test", schema=schema, listen=False, connect_retries=0
    )
    rt = Runtime(make_app(), provider, control_ttl=0.05)
    await rt.open()
    try:
        yield rt, provider
    finally:
        if not proxy.up:
            await proxy.restore()
        with contextlib.suppress(Exception):
            await rt.close()
        await drop_schema(schema)


async def recovers(call) -> bool:
    """``call`` succeeds (the pool's connections the cut broke are dropped on their first failure)."""
    try:
        await call()
    except ProviderUnavailable:
        return False
    return True


async def test_enqueue_and_maintain_raise_provider_unavailable_while_postgres_is_cut(proxy):
    async with through(proxy) as (rt, provider):
        app = rt.app
        first = await app.enqueue(Job(n=1))
        record = await rt.tracker.get(first.message_id)
        assert record is not None
        await proxy.cut()

        with pytest.raises(ProviderUnavailable, match="unreachable during a send"):
            await app.enqueue(Job(n=2))
        with pytest.raises(ProviderUnavailable, match="unreachable during an idempotent send"):
            await app.enqueue(Sync(account="a"))
        # (the worker's maintenance loop logs it and tries again; the provider's caller sees the kit's error)
        with pytest.raises(ProviderUnavailable, match="unreachable during maintenance"):
            await provider.maintain(app)
        # the ops actions' own statements (the ops service reads the message first: that read, too)
        now = provider.clock()
        with pytest.raises(ProviderUnavailable, match="unreachable during reading a message"):
            await rt.tracker.get(first.message_id)
        with pytest.raises(ProviderUnavailable, match="unreachable during an operator's cancel"):
            await provider.ops_cancel(record, now)
        with pytest.raises(ProviderUnavailable, match="unreachable during a purge"):
            await provider.ops_purge(MessageQuery(queue="outage-sql/job"))
        with pytest.raises(ProviderUnavailable, match="unreachable during an update of statuses"):
            await provider.ops_update_status_where("outage-sql/job", ["n"], "eq", 1, "Paused", None, now)

        await proxy.restore()
        await wait_until(
            lambda: recovers(lambda: app.enqueue(Job(n=3))), timeout=30, what="enqueue works again"
        )
        await app.enqueue(Sync(account="a"))
        assert isinstance(await provider.maintain(app), dict)
        counts = await rt.tracker.counts()
        assert counts[("outage-sql/job", "Pending")] >= 2
        assert counts[("outage-sql/sync", "Pending")] == 1


async def test_health_stats_and_ops_are_503_while_postgres_is_cut(proxy):
    async with through(proxy) as (rt, _provider), ops_client(rt) as client:
        await rt.app.enqueue(Job(n=1))
        assert (await client.get("/health")).status_code == 200
        await proxy.cut()

        for method, path in [
            ("GET", "/health"),
            ("GET", "/stats"),
            ("GET", "/messages"),
            ("GET", "/messages/stats"),
            ("POST", "/queues/outage-sql/job/pause"),
        ]:
            r = await client.request(method, path)
            assert r.status_code == 503, (method, path, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["type"] == STORE_UNAVAILABLE, (method, path, r.json())
            assert r.headers["retry-after"]

        await proxy.restore()

        async def healthy() -> bool:
            r = await client.get("/health")
            return r.status_code == 200 and r.json()["status"] == "Healthy"

        await wait_until(healthy, timeout=30, what="health back to 200 once PostgreSQL is reachable")
        stats = await client.get("/stats")
        assert stats.status_code == 200, stats.text
        [job] = [q for q in stats.json()["queues"] if q["queue"] == "outage-sql/job"]
        assert job["counts"]["Pending"] == 1


async def test_sqlite_write_lock_held_past_the_busy_timeout_is_provider_unavailable(tmp_path):
    """SQLite's equivalent: another process holds the one write lock past the busy timeout."""
    file = str(tmp_path / "q.db")
    provider = SqlProvider(f"sqlite:///{file}")
    rt = Runtime(make_app(), provider, control_ttl=0.05)
    await rt.open()
    try:
        app = rt.app
        await app.enqueue(Job(n=1))
        async with provider.engine.connect() as conn:  # the provider's one pooled connection: wait 50 ms
            await conn.exec_driver_sql("PRAGMA busy_timeout=50")
        holder = sqlite3.connect(file, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(ProviderUnavailable, match=r"during a send: .*database is locked"):
                await app.enqueue(Job(n=2))
            with pytest.raises(ProviderUnavailable, match=r"during an idempotent send: .*database is locked"):
                await app.enqueue(Sync(account="a"))
            with pytest.raises(ProviderUnavailable, match=r"during maintenance: .*database is locked"):
                await provider.maintain(app)
            async with ops_client(rt) as client:
                r = await client.post("/queues/outage-sql/job/pause")
                assert r.status_code == 503, r.text
                assert r.json()["type"] == STORE_UNAVAILABLE
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        await app.enqueue(Job(n=3))
        await app.enqueue(Sync(account="a"))
        await provider.maintain(app)
        counts = await rt.tracker.counts()
        assert counts[("outage-sql/job", "Pending")] == 2
        assert counts[("outage-sql/sync", "Pending")] == 1
    finally:
        await rt.close()
