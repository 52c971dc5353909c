"""A run that outlasts RabbitMQ's consumer timeout is cut before it, and the broker's channel closes
are said.

The broker closes the channel of a consumer that holds a message unacknowledged past its
``consumer_timeout`` (30 minutes by default), and every message of the queue held on that channel is
delivered again while its first run goes on: one slow handler ran every other message in flight on
its queue twice, and itself again and again until its attempts were used, the only trace a lost
lease per run (found in review). The kit now cuts a run a margin before the timeout, counted from
the message's delivery to the consumer, as at a time limit. Real RabbitMQ (127.0.0.1:5672).

The broker's own close is not provoked here: its timeout is one setting for the whole broker (3.10
has no per-queue one), checked once a minute, and the broker is shared with the other tests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.rabbitmq import RabbitMQProvider, run_bound
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require
from tests.tcp_proxy import TcpProxy

TIMEOUT = 3.0  # the broker's consumer timeout the kit is told (its margin: a tenth, 0.3 s)


@queue("timeout.jobs", max_concurrency=4, max_attempts=1)
class Job(QueueMessage):
    n: int
    slow: bool = False


@contextlib.asynccontextmanager
async def _opened(tmp_path: Any) -> AsyncIterator[tuple[QueueingApp, RabbitMQProvider]]:
    """A runtime on real RabbitMQ (its side stores on SQLite), opened, and closed after."""
    require("RabbitMQ", "127.0.0.1", 5672)
    app = _app([])
    provider = RabbitMQProvider(RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"))
    rt = Runtime(app, provider)
    await rt.open()
    try:
        yield app, provider
    finally:
        await rt.close()


def _app(runs: list[int]) -> QueueingApp:
    app = QueueingApp("consumer-timeout", naming=QueueNaming(prefix=fresh_prefix()))

    @app.handler()
    async def handle(msg: Job) -> None:
        runs.append(msg.n)
        await asyncio.sleep(120 if msg.slow else 0.3)

    return app


async def test_a_run_nearing_the_consumer_timeout_is_cut_and_the_others_run_once(tmp_path) -> None:
    require("RabbitMQ", "127.0.0.1", 5672)
    runs: list[int] = []
    app = _app(runs)
    provider = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), consumer_timeout=TIMEOUT
    )
    rt = Runtime(app, provider)
    await rt.open()
    try:
        async with running(rt):
            slow = await app.enqueue(Job(n=0, slow=True))
            fast = [await app.enqueue(Job(n=i)) for i in range(1, 7)]

            async def status(mid: Any) -> str | None:
                rec = await rt.tracker.get(mid)
                return rec.status if rec is not None else None

            async def settled() -> bool:
                states = [await status(r.message_id) for r in (slow, *fast)]
                return all(s in (MessageStatus.SUCCEEDED, MessageStatus.DEAD_LETTERED) for s in states)

            # without the cut the slow run went on for its two minutes
            await wait_until(settled, timeout=30, what="every message settled")
        rec = await rt.tracker.get(slow.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED  # its one attempt used by the cut run
        assert "consumer timeout (3 s)" in (rec.description or ""), rec.description
        assert sorted(runs) == list(range(7))  # each ran once: none went back to the broker
    finally:
        await rt.close()


def test_the_consumer_timeout_is_read_from_the_settings_and_zero_means_none() -> None:
    def bound(**overrides: Any) -> Any:
        settings = QueueingSettings(provider="rabbitmq", **overrides)
        return RabbitMQProvider.from_settings(settings).capabilities.longest_run

    default = bound()
    assert default is not None
    assert default.limit.total_seconds() == 1800 - 60
    assert "QUEUEING_RABBITMQ_CONSUMER_TIMEOUT" in default.because
    longer = bound(rabbitmq_consumer_timeout=7200)
    assert longer is not None
    assert longer.limit.total_seconds() == 7200 - 60
    assert bound(rabbitmq_consumer_timeout=0) is None


async def test_a_consumer_channel_the_broker_closes_is_said_at_warning(tmp_path, caplog) -> None:
    """The broker closes a channel for a consumer timeout (or an ack it refuses): its messages come
    back, and the lease each of their runs then loses was the only trace (aio-pika's own line about
    the close is demoted with its reconnect noise). Provoked with an acknowledgement of a delivery
    tag the channel never had, which the broker refuses the same way (PRECONDITION_FAILED)."""
    async with _opened(tmp_path) as (app, provider):
        sub = app.subscription(Job.type_name())
        assert sub is not None
        consumer = await provider._consumer(sub)
        underlay = await consumer.channel.get_underlay_channel()
        with caplog.at_level(logging.WARNING, logger="queueing"):
            await underlay.basic_ack(987654)
            await wait_until(
                lambda: "RabbitMQ closed the consumer channel of" in caplog.text, what="the close said"
            )
        assert "PRECONDITION_FAILED" in caplog.text


async def test_purges_leave_the_admin_channel_nothing_to_declare_again(tmp_path) -> None:
    """Each whole-queue purge (and each publish that failed) declared its queues again on the admin
    channel, which kept every declaration to repeat at a reconnect: more with every purge, for the
    life of the process, each one a round trip before the channels came back."""
    async with _opened(tmp_path) as (app, provider):
        await app.enqueue(Job(n=1))
        for _ in range(3):
            await provider._purge_whole("timeout.jobs")
        admin = provider._admin
        assert isinstance(admin, aio_pika.RobustChannel)
        kept = [q for queues in admin._queues.values() for q in queues]
        assert kept == []


@pytest.mark.parametrize("timeout", [-1.0, float("inf"), float("nan"), 1e12])
def test_a_consumer_timeout_out_of_range_is_refused(timeout: float) -> None:
    """(Infinity failed the start with a raw OverflowError, and 1e12 every run, its slot kept.)"""
    with pytest.raises(ValueError, match="rabbitmq_consumer_timeout"):
        QueueingSettings(provider="rabbitmq", rabbitmq_consumer_timeout=timeout)


def test_a_consumer_timeout_of_a_year_and_more_in_code_is_none() -> None:
    assert run_bound(1e12) is None
    assert run_bound(float("inf")) is None


async def test_a_queue_the_broker_lost_while_disconnected_is_declared_at_the_next_publish(
    tmp_path, caplog
) -> None:
    """The admin channel no longer declares its queues again itself at a reconnect: a broker back
    without them (restarted without its data, a queue deleted meanwhile) returned the first publish to
    each as unroutable (found in review). They are declared again at the next publish."""
    require("RabbitMQ", "127.0.0.1", 5672)
    app = _app([])
    proxy = TcpProxy("127.0.0.1", 5672)
    port = await proxy.start()
    provider = RabbitMQProvider(
        f"amqp://guest:guest@127.0.0.1:{port}/",
        stores=SideStores(f"sqlite:///{tmp_path}/side.db"),
        reconnect_interval=0.5,
    )
    rt = Runtime(app, provider)
    await rt.open()
    try:
        await app.enqueue(Job(n=0))  # (its queues declared)
        physical = provider.physical("timeout.jobs")
        await proxy.cut()
        async with await aio_pika.connect(RABBITMQ_URL) as direct:
            channel = await direct.channel()
            await channel.queue_delete(physical)
            await channel.queue_delete(provider.dead_letter_name(physical))
        with caplog.at_level(logging.WARNING, logger="queueing"):
            await proxy.restore()
            await wait_until(lambda: "reconnected to RabbitMQ" in caplog.text, what="the reconnect")
        await app.enqueue(Job(n=1))  # refused as unroutable before
        assert await provider.depth(physical) == 1
    finally:
        await rt.close()
        await proxy.stop()
