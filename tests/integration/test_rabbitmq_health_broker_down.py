"""RabbitMQ: ``GET health`` and ``GET stats`` while the broker is unreachable.

The broker's counts per queue (``native_counts``) leave out a queue that is not declared (auto_declare
off: no counts, not an error). Before, the broker being unreachable was taken for the same thing: the
counts went missing and ``GET health`` answered 200 "Healthy", though the route documents "the store
being unreachable is a 503". The broker is cut off for real, by a TCP proxy in front of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aio_pika
import pytest

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require
from tests.tcp_proxy import TcpProxy


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


@queue("HealthDown.Job")
class Job(QueueMessage):
    n: int


@contextlib.asynccontextmanager
async def through(proxy: TcpProxy, tmp_path, *, auto_declare: bool = True) -> AsyncIterator[Runtime]:
    """A runtime whose connection to the broker goes through ``proxy``; its queues deleted after."""
    prefix = fresh_prefix()
    app = QueueingApp("health-down", naming=QueueNaming(prefix=prefix))
    app.message(Job)
    provider = RabbitMQProvider(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
        stores=SideStores(f"sqlite:///{tmp_path}/{prefix}side.db"),
        idle_timeout=0.5,
        reconnect_interval=0.5,
        auto_declare=auto_declare,
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    try:
        yield rt
    finally:
        if not proxy.up:
            await proxy.restore()
        with contextlib.suppress(Exception):
            await rt.close()
        physical = provider.physical("HealthDown.Job")
        async with await aio_pika.connect(RABBITMQ_URL) as conn:
            channel = await conn.channel()
            for name in (physical, f"{physical}.dead-letter"):
                with contextlib.suppress(Exception):
                    await channel.queue_delete(name)


@pytest.fixture
async def proxy() -> AsyncIterator[TcpProxy]:
    p = TcpProxy("127.0.0.1", 5672)
    await p.start()
    yield p
    await p.stop()


async def test_health_and_stats_are_503_while_the_broker_is_unreachable(tmp_path, proxy):
    async with through(proxy, tmp_path) as rt, ops_client(rt) as client:
        await rt.app.enqueue(Job(n=1))
        stats = (await client.get("/stats")).json()
        assert stats["queues"][0]["transport_counts"]["ready"] == 1
        assert (await client.get("/health")).status_code == 200

        await proxy.cut()

        async def refused() -> bool:
            return (await client.get("/health")).status_code == 503

        await wait_until(refused, timeout=15, what="health answering 503 with the broker cut off")
        health = await client.get("/health")
        assert health.headers["content-type"].startswith("application/problem+json")
        assert "cannot be reached" in health.json()["detail"]
        assert (await client.get("/stats")).status_code == 503

        # the broker back: healthy again, with its counts
        await proxy.restore()

        async def healthy() -> bool:
            r = await client.get("/health")
            return r.status_code == 200 and r.json()["status"] == "Healthy"

        await wait_until(healthy, timeout=30, what="health back to 200 once the broker is reachable")
        stats = (await client.get("/stats")).json()
        assert stats["queues"][0]["transport_counts"]["ready"] == 1


async def test_a_queue_not_declared_has_no_counts_and_is_no_error(tmp_path, proxy):
    """auto_declare off and the queue not declared yet: no broker counts for it, health stays 200."""
    async with through(proxy, tmp_path, auto_declare=False) as rt, ops_client(rt) as client:
        health = await client.get("/health")
        stats = await client.get("/stats")
        assert health.status_code == 200, health.text
        assert health.json()["status"] == "Healthy"
        assert stats.status_code == 200, stats.text
        assert stats.json()["queues"][0]["transport_counts"] is None
