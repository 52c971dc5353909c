"""Service Bus: one slow lock renewal does not hold back the others. The worker waits for its whole
round of renewals before it sleeps for the next; a renewal the SDK kept trying (a throttled or
re-attaching link) with no bound held every other message's next renewal, and their locks lapsed under
running handlers: they ran twice and the first runs' successes were refused (found in review)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.fakes.servicebus import FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus


@queue("renewals", lease_duration=timedelta(seconds=3))
class Task(QueueMessage):
    n: int


async def _two_held() -> tuple[Any, Any, list[Any]]:
    app = QueueingApp("sbrenew")

    @app.handler()
    async def handle(msg: Task) -> None:
        return None

    rt = in_memory_servicebus(app, FakeServiceBusNamespace(), provider_options={"receive_wait": 0.1})
    await rt.open()
    await app.enqueue(Task(n=0))
    await app.enqueue(Task(n=1))
    sub = app.subscription("Task")
    assert sub is not None
    got = await rt.provider.receive(sub, 2)
    assert len(got) == 2
    return (
        rt,
        rt.provider._link("renewals").receiver,
        sorted(got, key=lambda d: d.handle.message.sequence_number),
    )


async def test_a_renewal_that_does_not_answer_leaves_the_round_and_the_others_renewed() -> None:
    rt, receiver, (first, second) = await _two_held()
    real = receiver.renew_message_lock
    never = asyncio.Event()
    renewed: list[int] = []

    async def renew(message: Any, *, timeout: float | None = None) -> Any:
        if message.sequence_number == first.handle.message.sequence_number:
            await never.wait()  # this one's answer never comes
        until = await real(message, timeout=timeout)
        renewed.append(message.sequence_number)
        return until

    receiver.renew_message_lock = renew
    try:
        before = first.lease_until
        # (a guard against hanging, not a timing: each try is given up after a sixth of the lock)
        lost = await asyncio.wait_for(rt.provider.renew([first, second]), timeout=30)
        assert lost == [], "a renewal that was only slow is tried again, its lock not given up"
        assert renewed == [second.handle.message.sequence_number]
        assert first.lease_until == before
    finally:
        await rt.close()


async def test_a_renewal_whose_first_try_hangs_is_tried_again_in_time() -> None:
    rt, receiver, (first, second) = await _two_held()
    real = receiver.renew_message_lock
    never = asyncio.Event()
    renewed: list[int] = []
    hung: list[int] = []

    async def renew(message: Any, *, timeout: float | None = None) -> Any:
        if not hung:
            hung.append(message.sequence_number)
            await never.wait()  # one answer lost (the link re-attached): the try hangs
        until = await real(message, timeout=timeout)
        renewed.append(message.sequence_number)
        return until

    receiver.renew_message_lock = renew
    try:
        lost = await asyncio.wait_for(rt.provider.renew([first, second]), timeout=30)
        assert hung
        assert lost == []
        # both renewed: the one whose first try hung by a second try within the round
        assert sorted(renewed) == sorted(d.handle.message.sequence_number for d in (first, second))
    finally:
        await rt.close()
