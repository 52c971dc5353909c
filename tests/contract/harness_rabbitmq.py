"""The contract suite on RabbitMQ (the broker on 127.0.0.1:5672), with the side stores (history,
pause/circuit state, delayed messages) in a fresh PostgreSQL schema per test."""

from __future__ import annotations

import contextlib
import uuid
from datetime import timedelta

from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Provider

from .harness import Harness, native_dead_letters


def make_harness() -> Harness:
    from queueing_core.providers.rabbitmq import RabbitMQProvider
    from queueing_core.providers.sql.history import SideStores
    from tests.services import POSTGRES_URL, RABBITMQ_URL, drop_schema, require

    require("RabbitMQ", "127.0.0.1", 5672)
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qr_{uuid.uuid4().hex[:10]}"
    made: list[RabbitMQProvider] = []

    async def make() -> Provider:
        prov = RabbitMQProvider(
            RABBITMQ_URL,
            stores=SideStores(POSTGRES_URL, schema=schema),
            idle_timeout=0.5,
            reconnect_interval=0.5,
            dispatcher_options={"retry_delay": timedelta(milliseconds=100)},
        )
        made.append(prov)
        return prov

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        import aio_pika

        prov = rt.provider
        assert isinstance(prov, RabbitMQProvider)
        await prov._publish(prov.physical(queue), aio_pika.Message(raw))

    async def cleanup() -> None:
        for prov in made:
            await prov.close()
        await drop_schema(schema)

    async def channel_fails(rt: Runtime, delivery: Delivery) -> None:
        """The consumer's channel dies, as on a network fault or a channel error: the broker puts
        what it held back in the queue and the provider's robust channel consumes again. Here the
        error is the broker's own answer to an ack of a delivery tag it never gave out."""
        prov = rt.provider
        assert isinstance(prov, RabbitMQProvider)
        channel = prov._consumers[prov.physical(delivery.queue)].channel
        raw = await channel.get_underlay_channel()
        with contextlib.suppress(Exception):
            await raw.basic_ack(delivery_tag=2**31)

    # retries are republished copies: no order promise
    return Harness(
        "rabbitmq",
        make_provider=make,
        inject_raw=inject,
        ordered=False,
        cleanup=cleanup,
        lose_lease=channel_fails,
        dead_letters=native_dead_letters,
    )
