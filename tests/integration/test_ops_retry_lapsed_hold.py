"""An operator's retry of a dead letter whose hold lapses while the copy is sent.

The retry locates the message's letters and holds them (a peek-lock on Service Bus, a visibility
timeout on Storage Queues), sends the copy, then removes the letters it holds. A hold can lapse in
between (a lock duration shorter than the scan's last wait and the send; a visibility timeout that
ran out and another reader that took the letter). Then the letter is found again by its transport key
(a sequence number, a queue message id) and removed; the copy's own new letter, dead-lettered in the
meantime, has a key of its own and stays. Both races are driven deterministically: the copy step waits
until the copy is dead-lettered again and the original's hold is gone before the retry goes on.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from azure.servicebus import ServiceBusSubQueue
from azure.storage.queue.aio import QueueClient

from queueing_core import NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.ops import OpsService
from queueing_core.providers import storage_queue
from queueing_core.runtime import Runtime
from queueing_core.testing import in_memory_servicebus
from tests.contract.harness import record, running, wait_until
from tests.contract.harness import storage_queue as storage_harness

LOCK = timedelta(seconds=10)


@queue("lapse-dead", max_attempts=3, lease_duration=LOCK)
class Void(QueueMessage):
    n: int


def _app(runs: list[int]) -> QueueingApp:
    app = QueueingApp("lapse", naming=QueueNaming(prefix=f"l{uuid.uuid4().hex[:8]}-"))

    @app.handler()
    async def handle(msg: Void) -> None:
        runs.append(msg.n)
        raise NonRetryableError("the invoice is void")

    return app


async def _dead_lettered_twice(rt: Runtime, mid: uuid.UUID, runs: list[int]) -> bool:
    rec = await rt.tracker.get(mid)
    return len(runs) == 2 and rec is not None and rec.status == "DeadLettered"


async def _sb_letters(rt: Runtime) -> list[Any]:
    prov: Any = rt.provider
    async with prov.client.get_queue_receiver(
        prov.physical("lapse-dead"), sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as r:
        return list(await r.peek_messages(max_message_count=50))


async def test_servicebus_retry_whose_lock_lapsed_removes_only_the_original_by_sequence_number() -> None:
    clock = FakeClock()
    runs: list[int] = []
    app = _app(runs)
    rt = in_memory_servicebus(
        app, FakeServiceBusNamespace(clock=clock), provider_options={"receive_wait": 0.1}
    )
    await rt.open()
    prov: Any = rt.provider
    try:
        mid = (await app.enqueue(Void(n=1))).message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "DeadLettered"), what="dead-lettered")
            [original] = await _sb_letters(rt)
            real_send = prov.send_copy

            async def send_then_lock_lapses(*args: Any, **kwargs: Any) -> None:
                await real_send(*args, **kwargs)
                await wait_until(lambda: _dead_lettered_twice(rt, mid, runs), what="the copy dead-lettered")
                clock.advance(LOCK + timedelta(seconds=1))  # the retry's lock on the original is gone

            prov.send_copy = send_then_lock_lapses
            await OpsService(rt).retry(mid)  # the original's lock lapsed: it is found again and removed

        letters = await _sb_letters(rt)
        assert [m.sequence_number for m in letters] != [original.sequence_number]
        assert len(letters) == 1, "exactly the copy's own new letter stays"
        assert (await record(rt, mid)).status == "DeadLettered"
    finally:
        await rt.close()


async def test_storage_retry_whose_hold_was_taken_removes_only_the_original_by_message_id(
    azurite, monkeypatch
) -> None:
    monkeypatch.setattr(storage_queue, "HOLD_SECONDS", 1)  # the scan hides the letters it holds 1 s
    harness = storage_harness(azurite)
    runs: list[int] = []
    app = _app(runs)
    rt = await harness.runtime(app)
    prov: Any = rt.provider
    # a reader of the poison queue of its own, as another operator's scan would be
    poison = QueueClient.from_connection_string(azurite.connection_string, prov.poison_name("lapse-dead"))
    try:
        mid = (await app.enqueue(Void(n=1))).message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "DeadLettered"), what="dead-lettered")
            [original] = await poison.peek_messages(max_messages=32)
            real_put = prov.put

            async def put_then_hold_is_taken(*args: Any, **kwargs: Any) -> None:
                await real_put(*args, **kwargs)
                await wait_until(lambda: _dead_lettered_twice(rt, mid, runs), what="the copy dead-lettered")
                # another reader takes the original once the retry's hold ran out and hands it back:
                # the retry's pop receipt no longer holds it
                await wait_until(lambda: _take_and_hand_back(poison, original.id), what="the hold taken")

            prov.put = put_then_hold_is_taken
            await OpsService(rt).retry(mid)

        await wait_until(lambda: _poison_ids_visible(poison, 1), what="one poison letter", timeout=15)
        ids = [m.id async for m in poison.receive_messages(max_messages=32, visibility_timeout=1)]
        assert original.id not in ids, "the original letter stays: its hold lapsed and it was not found again"
        assert len(ids) == 1, "exactly the copy's own new letter stays"
        assert (await record(rt, mid)).status == "DeadLettered"
    finally:
        await poison.close()
        await rt.close()
        if harness.cleanup is not None:
            await harness.cleanup()


async def _take_and_hand_back(poison: QueueClient, wanted: str) -> bool:
    taken = False
    async for m in poison.receive_messages(max_messages=32, visibility_timeout=5):
        await poison.update_message(m.id, m.pop_receipt, visibility_timeout=0)
        taken = taken or m.id == wanted
    return taken


async def _poison_ids_visible(poison: QueueClient, n: int) -> bool:
    return len(await poison.peek_messages(max_messages=32)) == n


async def _status(rt: Runtime, mid: uuid.UUID, status: str) -> bool:
    rec = await rt.tracker.get(mid)
    return rec is not None and rec.status == status
