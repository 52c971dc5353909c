"""A lazily opened runtime opens once, however many first enqueues arrive together.

A producer-only process (a web app) opens its runtime on the first enqueue. Two first requests at once
both found it unopened and both opened the provider: on RabbitMQ the second connection replaced the
first, which nothing closed, and it stayed open (reconnecting) after ``runtime.close()`` (found in
review).
"""

from __future__ import annotations

import asyncio

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime


@queue("first-use-open")
class Ping(QueueMessage):
    n: int


class SlowOpen(InProcessProvider):
    """Opens like a broker: it takes a while, and each open makes a connection of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.opens = 0
        self.connections: list[str] = []

    async def open(self, app: QueueingApp) -> None:
        self.opens += 1
        await asyncio.sleep(0.05)
        self.connections = [*self.connections, f"connection {self.opens}"]
        await super().open(app)

    async def close(self) -> None:
        self.connections = self.connections[1:]  # closes the one it holds
        await super().close()


async def test_two_first_enqueues_at_once_open_the_provider_once():
    app = QueueingApp("first-use-open")
    app.message(Ping)
    provider = SlowOpen()
    runtime = Runtime(app, provider)
    await asyncio.gather(app.enqueue(Ping(n=1)), app.enqueue(Ping(n=2)), runtime.open())
    assert provider.opens == 1
    assert runtime.is_open
    await runtime.close()
    assert provider.connections == []  # nothing left open after the close


async def test_an_open_that_failed_is_tried_again_by_the_next_call():
    class FailsOnce(SlowOpen):
        async def open(self, app: QueueingApp) -> None:
            if self.opens == 0:
                self.opens += 1
                raise ConnectionError("broker down")
            await super().open(app)

    app = QueueingApp("first-use-open")
    app.message(Ping)
    provider = FailsOnce()
    runtime = Runtime(app, provider)
    results = await asyncio.gather(runtime.open(), runtime.open(), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError, type(None)]
    assert runtime.is_open
    await runtime.close()
