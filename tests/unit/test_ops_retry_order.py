"""An operator's retry records Pending before the message can run again, so a fast run's outcome is
never overwritten by the retry's own history write (for every provider with a separate history)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import Envelope
from queueing_core.errors import InvalidOperation
from queueing_core.ops import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MemoryTracker, MessageRecord
from queueing_core.tracking.base import RETRIED_BY_OPERATOR


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
    events: list[str] = []
    declines = [True]
    rt, tracker, mid = await _dead_lettered(events, declines)

    events.clear()
    declines[0] = False
    result = await OpsService(rt).retry(mid)
    assert result.status == MessageStatus.PENDING
    assert events == ["history Pending", "send"]  # nothing written after the send

    await run_until_idle(rt)
    assert (await tracker.get(mid)).status == MessageStatus.SUCCEEDED
    await rt.close()


async def _dead_lettered(
    events: list[str], declines: list[bool] | None = None
) -> tuple[Runtime, RecordedTracker, Any]:
    """A runtime (the caller closes it) and a message its handler dead-lettered (while ``declines``)."""
    app = QueueingApp("refunds")
    declining = declines if declines is not None else [True]

    @app.handler()
    async def refund(msg: Refund) -> None:
        if declining[0]:
            raise NonRetryableError("card expired")

    tracker = RecordedTracker(events)
    rt = Runtime(app, Recorded(events), tracker=tracker)
    await rt.open()
    sent = await app.enqueue(Refund(order=7))
    await run_until_idle(rt, raise_errors=False)
    assert (await tracker.get(sent.message_id)).status == MessageStatus.DEAD_LETTERED
    return rt, tracker, sent.message_id


async def test_a_retry_on_a_clock_no_later_than_the_record_writes_a_later_one():
    """A coarse or stopped clock: the retry's record must still be told apart from the one it read and
    from one written after it at the same instant (found in review)."""
    rt, tracker, mid = await _dead_lettered([])
    before = await tracker.get(mid)
    await OpsService(rt, clock=lambda: before.updated_at).retry(mid)
    after = await tracker.get(mid)
    assert after.status == MessageStatus.PENDING
    assert after.updated_at > before.updated_at
    await rt.close()


async def test_a_cancel_made_while_a_retry_writes_its_record_stands_and_no_copy_is_sent():
    """A cancel request stood from before (the retry withdraws it first), and the operator cancels
    again just as the retry has written its record: the retry must not withdraw the new request and
    send its copy, which would then run although the cancel answered Cancelled (found in review)."""
    events: list[str] = []
    rt, tracker, mid = await _dead_lettered(events)
    await rt.control.set_cancel(mid, True, utcnow())  # a request from before the retry
    written = tracker.change_if_unchanged

    async def then_cancelled(seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        done = await written(seen, changes)
        if changes.get("reason") == RETRIED_BY_OPERATOR:
            await OpsService(rt).cancel(mid)  # the other operator's click, just after the retry's write
        return done

    tracker.change_if_unchanged = then_cancelled  # type: ignore[method-assign]
    events.clear()
    with pytest.raises(InvalidOperation, match="changed while retrying"):
        await OpsService(rt).retry(mid)
    assert "send" not in events
    rt.control.invalidate()
    assert mid in (await rt.control.state()).cancelled
    assert (await tracker.get(mid)).status == MessageStatus.CANCELLED
    await rt.close()
