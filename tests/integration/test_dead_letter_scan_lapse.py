"""An operator's retry of a dead letter whose scan takes longer than the locks it holds.

The scan locks each letter it passes over so the next receive returns the letters after it. Once
those locks lapse, Service Bus hands the letters out again in sequence order, ahead of the letters not
read yet. Such a page of letters already met was taken for the end of the queue: a retry of a letter
further on sent its copy, removed nothing and reported success, and the letter stayed in the
dead-letter queue where no listing shows it, to run the message again at a later retry (found in
review). The kit's in-memory Service Bus with a fake clock models the slow scan.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from azure.servicebus import ServiceBusMessage, ServiceBusSubQueue

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.errors import InvalidOperation
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.providers import servicebus
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking.base import record_from_envelope
from tests.envelopes import an_envelope

AHEAD = 250  # letters ahead of the one retried: three pages of 100


@queue("scan-lapse")
class Job(QueueMessage):
    n: int


async def _dead_letters(prov: Any, phys: str) -> set[str]:
    async with prov.client.get_queue_receiver(phys, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as r:
        peeked = await r.peek_messages(max_message_count=AHEAD + 10)
    return {servicebus.id_in_text(servicebus._text(m)) for m in peeked}


async def test_a_retry_whose_scan_outlasts_its_locks_sends_nothing_and_leaves_the_letter(monkeypatch):
    clock = FakeClock()
    app = QueueingApp("scan", naming=QueueNaming(prefix=f"s{uuid.uuid4().hex[:8]}-"))

    @app.handler()
    async def handle(msg: Job) -> None: ...

    rt = in_memory_servicebus(app, FakeServiceBusNamespace(clock=clock))
    await rt.open()
    prov: Any = rt.provider
    try:
        phys = prov.physical("scan-lapse")
        envs = [an_envelope(queue="scan-lapse", body={"n": i}) for i in range(AHEAD + 1)]
        async with prov.client.get_queue_sender(phys) as s:
            await s.send_messages([ServiceBusMessage(e.encode_text()) for e in envs])
        async with prov.client.get_queue_receiver(phys) as r:
            left = len(envs)
            while left:
                for m in await r.receive_messages(max_message_count=100, max_wait_time=1):
                    await r.dead_letter_message(m, reason="x", error_description="y")
                    left -= 1
        target = envs[-1]  # the newest letter: behind the first pages
        record = record_from_envelope(target, "DeadLettered", utcnow())

        # a slow scan: by its second page the locks of the first page's letters have lapsed
        real_next_page = servicebus._DeadLetterPages.next_page
        reads: list[int] = []

        async def slow_next_page(self: Any) -> list[Any]:
            reads.append(1)
            if len(reads) == 2:
                clock.advance(timedelta(minutes=6))  # longer than any lock duration (5 min at most)
            return await real_next_page(self)

        monkeypatch.setattr(servicebus._DeadLetterPages, "next_page", slow_next_page)
        with pytest.raises(InvalidOperation, match="nothing was sent"):
            await prov.ops_retry(record, target.model_copy(update={"attempt": 0}), utcnow())
        props = await prov.admin.get_queue_runtime_properties(phys)
        assert props.active_message_count == 0  # no copy
        assert props.dead_letter_message_count == AHEAD + 1
        assert str(target.message_id) in await _dead_letters(prov, phys)

        # retried again by a scan within its locks: the copy is sent and the letter goes
        monkeypatch.setattr(servicebus._DeadLetterPages, "next_page", real_next_page)
        clock.advance(timedelta(minutes=6))  # the locks of the refused scan's last page lapse too
        assert await prov.ops_retry(record, target.model_copy(update={"attempt": 0}), utcnow()) is True
        props = await prov.admin.get_queue_runtime_properties(phys)
        assert props.active_message_count == 1
        assert props.dead_letter_message_count == AHEAD
        assert str(target.message_id) not in await _dead_letters(prov, phys)
    finally:
        await rt.close()
