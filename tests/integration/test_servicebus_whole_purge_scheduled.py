"""Service Bus: emptying a queue whole (``DELETE messages?queue=Q&all=true``) takes its scheduled
messages too (a delayed message, a retry's copy waiting for its backoff). The drain receives and
deletes, and a receive never sees a scheduled message: they survived the purge, kept their history and
ran later (found in review)."""

from __future__ import annotations

from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.fakes.servicebus import FakeServiceBusNamespace
from queueing_core.ops import OpsService
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking import MessageQuery


@queue("purge-me")
class Job(QueueMessage):
    n: int


async def test_emptying_a_queue_whole_cancels_its_scheduled_messages_and_their_history() -> None:
    app = QueueingApp("sbpurge")

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    rt = in_memory_servicebus(app, FakeServiceBusNamespace(), provider_options={"receive_wait": 0.1})
    await rt.open()
    try:
        physical = rt.provider.physical("purge-me")
        delayed = [await app.enqueue(Job(n=i), delay=timedelta(hours=1)) for i in range(3)]
        waiting = await app.enqueue(Job(n=9))
        props = await rt.provider.admin.get_queue_runtime_properties(physical)
        assert props.scheduled_message_count == 3
        assert props.active_message_count == 1

        result = await OpsService(rt).purge(MessageQuery(queue="purge-me"), whole=True)

        props = await rt.provider.admin.get_queue_runtime_properties(physical)
        assert props.scheduled_message_count == 0
        assert props.active_message_count == 0
        assert result.deleted == 4
        assert result.left_waiting == 0
        for receipt in [*delayed, waiting]:
            assert await rt.tracker.get(receipt.message_id) is None
    finally:
        await rt.close()
