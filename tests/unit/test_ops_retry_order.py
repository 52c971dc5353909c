"""An operator's retry records Pending before the message can run again, so a fast run's outcome is
never overwritten by the retry's own history write (for every provider with a separate history)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.envelope import Envelope
from queueing_core.ops import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MemoryTracker, MessageRecord


@queue("refunds", max_attempts=1)
class Refund(QueueMessage):
    order: int


class Recorded(InProcessProvider):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        self.events.append("send")
        await super().send(envelopes, wait=wait)


class RecordedTracker(MemoryTracker):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        self.events.extend(f"history {r.status}" for r in records)
        await super().upsert(records)

    async def reopen(self, record: MessageRecord) -> None:
        self.events.append(f"history {record.status}")
        await super().reopen(record)

    async def change_if_unchanged(self, seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        # (how a retry writes its record where the store can compare it with the one it read)
        self.events.append(f"history {changes.get('status', seen.status)}")
        return await super().change_if_unchanged(seen, changes)


async def test_the_retry_is_recorded_before_the_message_is_sent_and_not_after():
    app = QueueingApp("refunds")
    declines = [True]

    @app.handler()
    async def refund(msg: Refund) -> None:
        if declines[0]:
            raise NonRetryableError("card expired")

    events: list[str] = []
    tracker = RecordedTracker(events)

    rt = Runtime(app, Recorded(events), tracker=tracker)
    await rt.open()
    sent = await app.enqueue(Refund(order=7))
    await run_until_idle(rt, raise_errors=False)
    assert (await tracker.get(sent.message_id)).status == MessageStatus.DEAD_LETTERED

    events.clear()
    declines[0] = False
    result = await OpsService(rt).retry(sent.message_id)
    assert result.status == MessageStatus.PENDING
    assert events == ["history Pending", "send"]  # nothing written after the send

    await run_until_idle(rt)
    assert (await tracker.get(sent.message_id)).status == MessageStatus.SUCCEEDED
    await rt.close()
