"""Link credit on Service Bus: a receive that asks for n and gets fewer leaves the rest of its credit on
the link (azure-servicebus, prefetch 0), and the broker locks messages into it that nobody asked for.
The in-memory Service Bus keeps that (see its docstring); the provider must not let it cost a message
an attempt, nor run a copy whose lock lapsed while it waited in the receiver."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.fakes.servicebus import (
    FakeClock,
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
)
from queueing_core.testing import in_memory_servicebus
from tests.contract.harness import all_have, running, wait_until


@queue("credit-jobs", lease_duration=timedelta(seconds=20), max_attempts=1, max_concurrency=4)
class CreditJob(QueueMessage):
    n: int


def make(ns: FakeServiceBusNamespace):
    app = QueueingApp("sb-credit")
    runs: list[tuple[int, int]] = []

    @app.handler()
    async def handle(msg: CreditJob, ctx) -> None:
        runs.append((msg.n, ctx.attempt))

    rt = in_memory_servicebus(app, ns, provider_options={"receive_wait": 0.1}, control_ttl=0.01)
    return app, rt, runs


async def dead_letters(rt) -> list:
    async with rt.provider.client.get_queue_receiver(
        rt.provider.physical("credit-jobs"), sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as r:
        return await r.peek_messages(max_message_count=50)


async def test_messages_sent_during_a_pause_keep_their_attempts_and_run_once():
    """A worker that stops receiving (here: a pause) must not leave credit on its link: messages sent
    meanwhile would be locked into it, their locks would lapse unseen (a delivery counted each: with
    one attempt, dead-lettered unrun), and the stale copies would run beside the live ones."""
    clock = FakeClock()
    ns = FakeServiceBusNamespace(clock=clock)
    app, rt, runs = make(ns)
    await rt.open()
    async with running(rt, pause_poll=0.05):
        first = await app.enqueue(CreditJob(n=0))
        await wait_until(lambda: all_have(rt, [first.message_id], MessageStatus.SUCCEEDED), what="first")
        await rt.control.set_paused("queue", "credit-jobs", True)
        await asyncio.sleep(1.6)  # the worker sees the pause and stops receiving (idle_close is 1 s)
        sent = [await app.enqueue(CreditJob(n=n)) for n in (1, 2, 3)]
        await asyncio.sleep(0.3)
        # past the lock before the SDK's keep-alive would read the link (a client that stalls meanwhile)
        clock.advance(timedelta(seconds=21))
        await rt.control.set_paused("queue", "credit-jobs", False)
        ids = [r.message_id for r in sent]
        ended = {MessageStatus.SUCCEEDED.value, MessageStatus.DEAD_LETTERED.value}

        async def all_ended() -> bool:
            records = [await rt.tracker.get(i) for i in ids]
            return all(rec is not None and rec.status in ended for rec in records)

        await wait_until(all_ended, what="the three sent during the pause")
        await asyncio.sleep(0.3)  # (a stale copy would run by now)
    assert await all_have(rt, ids, MessageStatus.SUCCEEDED)
    assert sorted(runs) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert await dead_letters(rt) == []
    await rt.close()


async def test_a_message_whose_lock_lapsed_in_the_receivers_buffer_is_not_run():
    """Credit the provider still holds (a receiver kept between receives): a message the broker locked
    into it and whose lock lapsed there is not handed out; the copy Service Bus delivers again is."""
    clock = FakeClock()
    ns = FakeServiceBusNamespace(clock=clock, keep_alive_seconds=None)
    app, rt, _ = make(ns)
    await rt.open()
    sub = app.subscription("CreditJob")
    assert await rt.provider.receive(sub, 4) == []  # leaves 4 credits on the link
    await app.enqueue(CreditJob(n=1))  # locked into that credit
    clock.advance(timedelta(seconds=21))  # lapses there: a delivery counted, and pushed in again
    deliveries = await rt.provider.receive(sub, 4)
    assert [d.attempt for d in deliveries] == [2]  # the lapse counted a delivery; only one copy is run
    assert deliveries[0].lease_until is not None
    assert deliveries[0].lease_until > clock()
    await rt.close()


async def test_the_stand_in_keeps_the_sdks_link_credit():
    """What the in-memory Service Bus does with credit, as azure-servicebus 7.15 with prefetch 0 does."""
    clock = FakeClock()
    ns = FakeServiceBusNamespace(clock=clock, keep_alive_seconds=0.2)
    async with FakeServiceBusAdministrationClient(ns) as admin:
        await admin.create_queue("q", lock_duration=timedelta(seconds=30), max_delivery_count=5)
    async with FakeServiceBusClient(ns) as client:
        sender = client.get_queue_sender("q")
        other = client.get_queue_receiver("q")
        async with client.get_queue_receiver("q") as r:
            assert await r.receive_messages(max_message_count=3, max_wait_time=0.05) == []
            await sender.send_messages(ServiceBusMessage("a"))
            # locked into r's leftover credit: no other receiver gets it
            assert await other.receive_messages(max_message_count=1, max_wait_time=0.05) == []
            clock.advance(timedelta(seconds=31))  # its lock lapses in r's buffer: a delivery counted
            stale, fresh = await r.receive_messages(max_message_count=3, max_wait_time=0.05)
            assert stale._lock_expired  # returned first, lapsed, as it was pushed
            assert stale.delivery_count == 0
            assert not fresh._lock_expired  # the copy pushed in again, its lapse counted
            assert fresh.delivery_count == 1
            await r.complete_message(fresh)
            # idle with credit left: the keep-alive releases what it pushes meanwhile, uncounted
            await sender.send_messages(ServiceBusMessage("b"))
            await asyncio.sleep(0.4)
            [b] = await other.receive_messages(max_message_count=1, max_wait_time=0.05)
            assert b.delivery_count == 0
            await other.abandon_message(b)  # counted (1), and pushed into r's credit again
        # closing r released it without counting a delivery
        [b] = await other.receive_messages(max_message_count=1, max_wait_time=0.05)
        assert str(b) == "b"
        assert b.delivery_count == 1
        await other.complete_message(b)
