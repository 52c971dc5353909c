"""The RabbitMQ consumer at its edges, on the real broker (found in review):

- a prefetch over AMQP's limit (``max_concurrency x prefetch`` above 65,535) is capped, so the worker
  consumes and reconnects, and a subscribe that fails closes the channel it opened;
- a message of a paused type that passes its expiry waits in its queue (no broker time to live), and
  the worker records it ``Expired``, with its reason, once the type is resumed;
- a worker whose wait for work is longer than ``idle_timeout`` keeps its consumer, so a message that
  arrives wakes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from datetime import timedelta

import aio_pika
import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.envelope import REASON
from queueing_core.errors import ProviderError
from queueing_core.providers.rabbitmq import MAX_PREFETCH, RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker
from tests.contract.harness import wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require
from tests.tcp_proxy import TcpProxy


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


async def _delete(names: list[str]) -> None:
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        for n in names:
            channel = await conn.channel()
            with contextlib.suppress(Exception):  # (a failed delete closes its channel: each gets its own)
                await channel.queue_delete(n)


def _worker(rt: Runtime, **kw: float) -> Worker:
    opts = {"poll_min": 0.01, "poll_max": 0.1, "pause_poll": 0.1, **kw}
    return Worker(rt, shutdown_timeout=5, schedules=False, **opts)  # type: ignore[arg-type]


@queue("Limits.Wide")
class Wide(QueueMessage):
    n: int


async def test_a_prefetch_over_amqps_limit_is_capped_and_the_worker_consumes_and_reconnects(tmp_path, caplog):
    """1,000 slots x prefetch 100 = 100,000: the subscribe failed with pamqp's raw TypeError for ever,
    and each try left a robust channel that asked for it again at every reconnect."""
    proxy = TcpProxy("127.0.0.1", 5672)
    await proxy.start()
    prefix = fresh_prefix()
    app = QueueingApp("limits", naming=QueueNaming(prefix=prefix))
    ran: list[int] = []

    @app.handler(max_concurrency=1000)
    async def handle(msg: Wide, ctx) -> None:
        ran.append(msg.n)

    url = RABBITMQ_URL.replace("127.0.0.1:5672", f"127.0.0.1:{proxy.port}")
    assert str(proxy.port) in url
    provider = RabbitMQProvider(
        url,
        stores=SideStores(f"sqlite:///{tmp_path}/side.db"),
        idle_timeout=0.5,
        prefetch=100,
        reconnect_interval=0.5,
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Limits.Wide"
    caplog.set_level(logging.WARNING, logger="queueing.rabbitmq")
    try:
        await rt.open()
        w = _worker(rt)
        await w.start()
        try:
            first = await app.enqueue(Wide(n=1))
            await wait_until(lambda: ran == [1], what="the first run")

            async def settled() -> bool:
                rec = await rt.tracker.get(first.message_id)
                return rec is not None and rec.status == MessageStatus.SUCCEEDED

            # its ack is in before the cut: cut between the run and the ack, the broker delivers the
            # message again after the reconnect (a duplicate, as it should), and ``ran`` is [1, 1, 2]
            await wait_until(settled, what="the first run's settlement")
            c = provider._consumers[physical]
            assert c.tag is not None
            assert c.channel._prefetch_count == MAX_PREFETCH  # type: ignore[attr-defined]
            # the connection drops once (a broker restart, a network blip), then the broker is back
            await proxy.cut()
            await asyncio.sleep(1.0)
            await proxy.restore()
            await wait_until(lambda: provider._conn.connected.is_set(), timeout=15, what="the reconnect")
            await app.enqueue(Wide(n=2))
            await wait_until(lambda: ran == [1, 2], timeout=15, what="a run after the reconnect")
        finally:
            await w.shutdown()
        capped = [r for r in caplog.records if "over AMQP's limit" in r.getMessage()]
        assert len(capped) == 1, [r.getMessage() for r in capped]  # said once, not at every subscribe
        assert "100000" in capped[0].getMessage()
        assert str(MAX_PREFETCH) in capped[0].getMessage()
    finally:
        if not proxy.up:
            await proxy.restore()
        await asyncio.wait_for(rt.close(), 15)
        await proxy.stop()
        await _delete([physical, physical + ".dead-letter"])


async def test_a_subscribe_that_fails_closes_the_channel_it_opened(tmp_path):
    """The queue deleted and declared again with other arguments behind the kit's back: each subscribe
    fails (PRECONDITION_FAILED), and each failed try left an open channel with the connection, which
    it reopened (and asked its declarations again) at every reconnect."""
    prefix = fresh_prefix()
    app = QueueingApp("limits", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=2)
    async def handle(msg: Wide, ctx) -> None:
        return None

    provider = RabbitMQProvider(RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"))
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Limits.Wide"
    sub = app.subscription("Wide")
    try:
        await rt.open()  # declares the queue with its dead-letter arguments
        async with await aio_pika.connect(RABBITMQ_URL) as conn:
            channel = await conn.channel()
            await channel.queue_delete(physical)
            await channel.declare_queue(physical, durable=True)  # no dead-letter exchange
        assert provider._conn is not None
        assert provider._conn.transport is not None
        channels = provider._conn.transport.connection.channels
        before = len(channels)
        for _ in range(3):
            with pytest.raises(ProviderError, match=r"PRECONDITION_FAILED|inequivalent"):
                await provider.receive(sub, 10)
        for _ in range(20):  # (a channel the broker closed may be reopened a few tasks later)
            await asyncio.sleep(0.05)
        gc.collect()
        assert len(channels) == before, f"{len(channels) - before} channel(s) left by failed subscribes"
        assert physical not in provider._consumers
    finally:
        await asyncio.wait_for(rt.close(), 15)
        await _delete([physical, physical + ".dead-letter"])


@queue("Limits.Short", expiration=timedelta(seconds=2))
class Short(QueueMessage):
    n: int


async def test_a_message_that_expires_while_its_type_is_paused_waits_and_is_recorded_expired(tmp_path):
    """The AMQP expiration was expiry + ttl_grace. A paused type is not read, so the broker's
    dead-letter exchange moved the message itself, without the kit's reason, and its history stayed
    Pending: a dead letter no DeadLettered or Expired listing showed. Now the message waits in its
    queue, as on Storage Queues, and the worker that reads it after the resume records it Expired."""
    prefix = fresh_prefix()
    app = QueueingApp("limits", naming=QueueNaming(prefix=prefix))
    ran: list[int] = []

    @app.handler(max_concurrency=2)
    async def handle(msg: Short, ctx) -> None:
        ran.append(msg.n)

    provider = RabbitMQProvider(
        RABBITMQ_URL,
        stores=SideStores(f"sqlite:///{tmp_path}/side.db"),
        idle_timeout=0.5,
        ttl_grace=timedelta(seconds=1),
    )
    rt = Runtime(app, provider, control_ttl=0.05, pause_recheck=timedelta(milliseconds=200))
    physical = f"{prefix}Limits.Short"
    try:
        await rt.open()
        await rt.control.set_paused("type", "Short", True)
        w = _worker(rt)
        await w.start()
        try:
            r = await app.enqueue(Short(n=1))
            await asyncio.sleep(4.5)  # past its expiry (2 s) and the grace (1 s)
            waiting = await provider.depth(physical)
            dead = await provider.depth(physical, dead=True)
            rec = await rt.tracker.get(r.message_id)
            assert (waiting, dead) == (1, 0), "the broker moved the message of a paused type itself"
            assert rec is not None
            assert rec.status == MessageStatus.PENDING
            await rt.control.set_paused("type", "Short", False)

            async def expired() -> bool:
                rec = await rt.tracker.get(r.message_id)
                return rec is not None and rec.status == MessageStatus.EXPIRED

            await wait_until(expired, timeout=15, what="Expired")
        finally:
            await w.shutdown()
        assert ran == []  # expired work is never handed to a handler
        async with await aio_pika.connect(RABBITMQ_URL) as conn:
            channel = await conn.channel()
            dlq = await channel.declare_queue(physical + ".dead-letter", passive=True)
            letter = await dlq.get(no_ack=True, timeout=5)
        assert letter.message_id == str(r.message_id)
        assert letter.headers[REASON] == "expired"
        assert letter.expiration is None
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])


@queue("Limits.Push")
class Push(QueueMessage):
    n: int


async def test_a_worker_waiting_longer_than_idle_timeout_is_woken_at_once(tmp_path):
    """The idle clean-up judged a consumer by the time since its wait for work *began*: a wait longer
    than ``idle_timeout`` (poll_max 6 s here, 1 s idle) had its consumer cancelled mid-wait, and a
    message that arrived then waited out the rest of the wait."""
    prefix = fresh_prefix()
    app = QueueingApp("limits", naming=QueueNaming(prefix=prefix))
    done: dict[int, float] = {}

    @app.handler(max_concurrency=2)
    async def handle(msg: Push, ctx) -> None:
        done[msg.n] = asyncio.get_running_loop().time()

    provider = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), idle_timeout=1.0
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Limits.Push"
    try:
        await rt.open()
        w = _worker(rt, poll_min=0.05, poll_max=6.0)
        await w.start()
        try:
            await asyncio.sleep(8.0)  # idle: the wait for work has grown to poll_max
            assert provider._consumers[physical].tag is not None, (
                "the waiting worker's consumer was cancelled"
            )
            sent = asyncio.get_running_loop().time()
            await app.enqueue(Push(n=1))
            await wait_until(lambda: 1 in done, timeout=20, what="the run")
            latency = done[1] - sent
        finally:
            await w.shutdown()
        assert latency < 1.0, f"an idle worker took {latency:.1f}s to take a message (its wake-up was lost)"
        # and once nobody waits, the consumer is still cancelled as idle (its work handed back)
        await wait_until(lambda: provider._consumers[physical].tag is None, timeout=10, what="idle cancel")
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])


@queue("Limits.Held")
class Held(QueueMessage):
    n: int


async def test_a_whole_queue_purge_says_when_a_consumer_may_still_hold_messages(tmp_path):
    """AMQP's purge removes the messages waiting, not those delivered to a consumer and not acked yet
    (a worker's prefetch buffer): those run afterwards. Its answer counts only what it removed, so the
    provider says whether anything may be left (a consumer of the queue, or a message waiting), for
    the purge's history to keep theirs."""
    prefix = fresh_prefix()
    app = QueueingApp("limits", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=2)  # prefetch 2: two delivered to the consumer, the rest wait
    async def handle(msg: Held, ctx) -> None:
        return None

    provider = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), idle_timeout=60
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    physical = f"{prefix}Limits.Held"
    sub = app.subscription("Held")
    try:
        await rt.open()
        await app.enqueue_many([Held(n=i) for i in range(5)], wait=True)
        c = await provider._consumer(sub)
        await wait_until(lambda: len(c.buffer) == 2, what="two messages in the consumer's buffer")
        held = await provider._purge_whole("Limits.Held")
        assert held.purged == 3  # the buffered two are not the broker's to purge
        assert held.live_all_gone is False
        assert held.dead is None  # (no dead letter, no reader of them)
        # the consumer cancelled, its buffer handed back (as a paused or stopped worker's is): now the
        # purge takes everything
        await provider._stop_consumer(c)
        alone = await provider._purge_whole("Limits.Held")
        assert (alone.purged, alone.live_all_gone) == (2, True)
    finally:
        await rt.close()
        await _delete([physical, physical + ".dead-letter"])
