"""``in_memory_servicebus`` keeps the history and control stores a test passes in, empty ones included
(an empty ``MemoryTracker`` has no length, and was taken for "not given" and replaced)."""

from __future__ import annotations

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.control import MemoryControlStore
from queueing_core.messages import MessageStatus
from queueing_core.testing import in_memory_servicebus, run_until_idle
from queueing_core.tracking import MemoryTracker


@queue("helper-given")
class Given(QueueMessage):
    pass


async def test_the_empty_tracker_and_control_store_passed_in_are_the_ones_used() -> None:
    app = QueueingApp("helper-given")

    @app.handler()
    async def handle(msg: Given) -> None:
        pass

    tracker, control = MemoryTracker(), MemoryControlStore()
    rt = in_memory_servicebus(app, tracker=tracker, control=control)
    async with rt:
        assert rt.tracker is tracker
        sent = await app.enqueue(Given())
        await run_until_idle(rt)
    record = await tracker.get(sent.message_id)
    assert record is not None
    assert record.status == MessageStatus.SUCCEEDED
