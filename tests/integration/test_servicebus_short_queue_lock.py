"""Service Bus: renewals follow the lock the queue grants, not only the type's lease. The kit leaves an
existing queue as it is (created before the lease was raised, by hand, or in the emulator's config):
where its lock duration is shorter than the type's lease, renewals timed by the lease came after the
lock had lapsed, and every run longer than the lock ran again beside itself, its success refused, until
the message was dead-lettered (found in review)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.fakes.servicebus import FakeServiceBusAdministrationClient, FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus
from tests.contract.harness import record, running, wait_until


@queue("long-work", lease_duration=timedelta(seconds=30), max_attempts=3)
class Work(QueueMessage):
    pass


async def _runtime_on_a_queue_locking(lock: timedelta, handler: Any) -> Any:
    app = QueueingApp("sblock")
    app.handler()(handler)
    ns = FakeServiceBusNamespace()
    rt = in_memory_servicebus(app, ns, provider_options={"receive_wait": 0.1})
    async with FakeServiceBusAdministrationClient(ns) as admin:
        await admin.create_queue(rt.provider.physical("long-work"), lock_duration=lock, max_delivery_count=4)
    await rt.open()
    return rt


async def test_the_provider_holds_a_message_for_the_queue_s_shorter_lock(caplog) -> None:
    async def handle(msg: Work) -> None:
        return None

    rt = await _runtime_on_a_queue_locking(timedelta(seconds=4), handle)
    try:
        sub = rt.app.subscription("Work")
        assert rt.provider.held_lease(sub) == timedelta(seconds=4)
        assert any("lock duration of 0:00:04" in r.getMessage() for r in caplog.records)
    finally:
        await rt.close()


async def test_a_run_longer_than_the_queue_s_lock_keeps_it() -> None:
    runs: list[int] = []

    async def handle(msg: Work, ctx: Any) -> None:
        runs.append(ctx.attempt)
        await asyncio.sleep(3.5)  # the work: longer than the queue's lock, well within the type's lease

    rt = await _runtime_on_a_queue_locking(timedelta(seconds=1.5), handle)
    try:
        receipt = await rt.app.enqueue(Work())
        async with running(rt):

            async def settled() -> bool:
                return (await record(rt, receipt.message_id)).status == MessageStatus.SUCCEEDED

            await wait_until(settled, timeout=30)
        props = await rt.provider.admin.get_queue_runtime_properties(rt.provider.physical("long-work"))
        # renewed by the type's lease (every 10 s), the lock lapsed at 1.5 s and the message ran again
        assert runs == [1]
        assert props.active_message_count == 0
        assert props.dead_letter_message_count == 0
    finally:
        await rt.close()
