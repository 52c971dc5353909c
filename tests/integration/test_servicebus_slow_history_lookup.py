"""Service Bus: the history lookups ``receive`` makes for messages that came back (is it an original
whose copy was already sent?) must not use up the locks of the batch. A slow history store (Tables
throttled, its SDK trying again) once made every message of a batch lose its lock before the worker held
it: each ran, its success was refused, and it came back until it was dead-lettered (found in review)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking import MemoryTracker


@queue("lookups", lease_duration=timedelta(seconds=4), max_attempts=3)
class Item(QueueMessage):
    n: int


class _History(MemoryTracker):
    """Writes land; reads do what ``read`` says."""

    def __init__(self, read: Any) -> None:
        super().__init__()
        self.read = read

    def __bool__(self) -> bool:  # (an empty MemoryTracker is falsy, and the testing helper would drop it)
        return True

    async def get(self, message_id: Any) -> Any:
        return await self.read()


async def _came_back(history: _History, ns: FakeServiceBusNamespace, count: int) -> tuple[Any, Any]:
    """A runtime whose queue holds ``count`` messages delivered once already (a worker that died holding
    them): each comes back with delivery count 1, and ``receive`` asks the history about it."""
    app = QueueingApp("sblookups")

    @app.handler()
    async def handle(msg: Item, ctx: Any) -> None:
        pass

    rt = in_memory_servicebus(app, ns, tracker=history, provider_options={"receive_wait": 0.1})
    await rt.open()
    for i in range(count):
        await app.enqueue(Item(n=i))
    async with rt.provider.client.get_queue_receiver(rt.provider.physical("lookups")) as r:
        for m in await r.receive_messages(max_message_count=count, max_wait_time=1):
            await r.abandon_message(m)
    sub = app.subscription("Item")
    assert sub is not None
    return rt, sub


async def test_lookups_that_do_not_answer_leave_the_messages_to_run_while_they_hold_their_locks():
    never = asyncio.Event()

    async def hangs() -> None:
        await never.wait()  # a history store that does not answer at all

    rt, sub = await _came_back(_History(hangs), FakeServiceBusNamespace(), 6)
    try:
        # (a guard against hanging, not a timing: each lookup is given up after a quarter of the lock)
        got = await asyncio.wait_for(rt.provider.receive(sub, 8), timeout=30)
        assert len(got) == 6, "a message whose lookup did not answer is run (not known, not skipped)"
        now = utcnow()
        assert all(d.lease_until is not None and d.lease_until > now for d in got)
        assert all(d.attempt == 2 and not d.duplicate for d in got)
    finally:
        await rt.close()


async def test_a_message_whose_lock_lapsed_during_the_lookups_is_not_run():
    clock = FakeClock(start=utcnow())
    ns = FakeServiceBusNamespace(clock=clock)

    async def slow_then_fails() -> None:
        clock.advance(2)  # each lookup takes 2 s of the broker's time, then gives up
        raise ConnectionError("history store unreachable")

    rt, sub = await _came_back(_History(slow_then_fails), ns, 4)
    try:
        got = await rt.provider.receive(sub, 8)
        # all four locks (4 s) lapsed while the history was asked: their runs' settlements would be
        # refused; Service Bus delivers them again, and none stays counted as held by this receiver
        assert got == []
        assert rt.provider._link("lookups").unsettled == 0
        props = await rt.provider.admin.get_queue_runtime_properties(rt.provider.physical("lookups"))
        assert props.active_message_count == 4
        assert props.dead_letter_message_count == 0
    finally:
        await rt.close()
