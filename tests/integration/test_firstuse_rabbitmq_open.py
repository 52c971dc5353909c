"""A producer-only process on RabbitMQ makes one connection, however many first enqueues race.

Two first enqueues at once both found the runtime unopened and both opened the provider: two robust
connections, the second replacing the first in the provider, and the first (with its channels) left
open and reconnecting after ``runtime.close()`` (found in review).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import aio_pika

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import bootstrap
from queueing_core.settings import load_settings
from tests.services import RABBITMQ_URL, require

QUEUE = f"firstuse-open-{uuid.uuid4().hex[:8]}"


@queue(QUEUE)
class Ping(QueueMessage):
    n: int


async def test_two_first_enqueues_make_one_connection_and_close_leaves_none(tmp_path, monkeypatch):
    require("RabbitMQ", "127.0.0.1", 5672)
    import queueing_core.providers.rabbitmq as rabbitmq

    made: list[aio_pika.abc.AbstractRobustConnection] = []
    real = aio_pika.connect_robust

    async def counting(*args, **kwargs):
        conn = await real(*args, **kwargs)
        made.append(conn)
        return conn

    monkeypatch.setattr(rabbitmq.aio_pika, "connect_robust", counting)
    app = QueueingApp("firstuse-open")
    app.message(Ping)
    cfg = load_settings(
        provider="rabbitmq",
        rabbitmq_url=RABBITMQ_URL,
        database_url=f"sqlite:///{tmp_path}/side.db",
        history_journal="off",
    )
    runtime = bootstrap(app, cfg)
    try:
        await asyncio.gather(app.enqueue(Ping(n=1)), app.enqueue(Ping(n=2)))
        assert len(made) == 1
    finally:
        await runtime.close()
        await asyncio.sleep(0.2)
        left = [c for c in made if not c.is_closed]
        for conn in left:
            await conn.close()
        conn = await real(RABBITMQ_URL)
        try:
            for name in (QUEUE, f"{QUEUE}.dead-letter"):
                channel = await conn.channel()
                with contextlib.suppress(aio_pika.exceptions.AMQPError):  # (one never declared)
                    await channel.queue_delete(name)
        finally:
            await conn.close()
    assert left == []
