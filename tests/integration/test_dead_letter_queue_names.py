"""A queue may not take the name of another queue's dead-letter queue on the broker (SQS's ``-dlq``,
RabbitMQ's ``.dead-letter``). An app with ``Shop.Orders`` and ``Shop.Orders-dlq`` opened on SQS, and
the second queue's worker read the first one's dead letters and ran them again, as attempt 2; the
letter then went to ``Shop-Orders-dlq-dlq``, where no retry or purge of ``Shop.Orders`` looks (found in
review). Two queues the broker's naming makes one shared it, each setting it up as its own. The
runtime now refuses both before it declares or creates anything, naming the two queues."""

from __future__ import annotations

import uuid

import aio_pika
import pytest

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.errors import ConfigurationError
from queueing_core.infra import check_names
from queueing_core.naming import Transport
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from tests.services import RABBITMQ_URL, require


@queue("Shop.Orders")
class Order(QueueMessage):
    n: int


@queue("Shop.Orders-dlq")
class OrderLetter(QueueMessage):
    n: int


@queue("Shop-Orders")
class OrderDashed(QueueMessage):
    n: int


@queue("mail")
class Mail(QueueMessage):
    n: int


@queue("mail.dead-letter")
class MailLetter(QueueMessage):
    n: int


def _app(*types: type[QueueMessage]) -> QueueingApp:
    app = QueueingApp("letters")
    for t in types:
        app.message(t)
    return app


def test_a_queue_named_like_another_queues_dead_letter_queue_is_refused_on_sqs():
    with pytest.raises(ConfigurationError) as caught:
        check_names(_app(Order, OrderLetter), (Transport.SQS,))
    text = str(caught.value)
    assert "'Shop-Orders-dlq'" in text
    assert "'Shop.Orders'" in text
    assert "dead-letter queue" in text


def test_two_queues_the_broker_names_alike_are_refused_on_sqs():
    with pytest.raises(ConfigurationError, match="is also the name of queue"):
        check_names(_app(Order, OrderDashed), (Transport.SQS,))


def test_names_that_stay_apart_pass_on_each_transport():
    check_names(_app(Order, Mail), (Transport.SQS, Transport.RABBITMQ, Transport.STORAGE_QUEUE))


async def test_the_runtime_refuses_them_before_declaring_anything_on_rabbitmq(tmp_path):
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = f"dlqnames{uuid.uuid4().hex[:6]}-"
    app = _app(Mail, MailLetter)
    app.naming = QueueNaming(prefix=prefix)
    provider = RabbitMQProvider(RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/side.db"))
    rt = Runtime(app, provider)
    try:
        with pytest.raises(ConfigurationError) as caught:
            await rt.open()
        text = str(caught.value)
        assert f"'{prefix}mail.dead-letter'" in text
        assert "'mail'" in text
        assert "dead-letter queue" in text
    finally:
        await rt.close()
    # nothing was declared: the broker has neither queue
    conn = await aio_pika.connect(RABBITMQ_URL)
    try:
        for name in (f"{prefix}mail", f"{prefix}mail.dead-letter"):
            channel = await conn.channel()
            with pytest.raises(aio_pika.exceptions.ChannelNotFoundEntity):
                await channel.declare_queue(name, passive=True)
    finally:
        await conn.close()
