"""A cancel of a message delayed longer than a cancellation request is kept, on a transport whose
history does not say whether a message runs (found by a review).

There the message is settled Cancelled when a host receives it, which for a delayed message is when it
comes due; a request is kept a day. The receipt said "cancelled: settled without running", and the
message ran when it came due two days later. Such a cancel now says it is not cancelled and why (the
documented limit: cancel it again within a day of its time), and the history does not say Cancelled.

Shown on the in-process provider (memory control store, which prunes old requests on the next
``set_cancel``); the Tables and SQL control stores leave them out of every read after a day."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueMessage, queue
from queueing_core.clock import utcnow
from tests.contract.harness import HARNESSES, running


@queue("cancel-long-delay")
class Later(QueueMessage):
    key: str


async def test_a_cancelled_message_delayed_past_a_day_does_not_run(monkeypatch):
    shift = [timedelta(0)]

    def clock():
        return utcnow() + shift[0]

    import queueing_core.providers.inprocess as inproc

    monkeypatch.setattr(inproc, "utcnow", clock)
    h = HARNESSES["inprocess"]()
    app = h.app()
    ran: list[str] = []

    @app.handler()
    async def handle(msg: Later, ctx):
        ran.append(msg.key)
        return "ran"

    rt = await h.runtime(app, clock=clock)
    sent = await app.enqueue(Later(key="k"), delay=timedelta(days=2), ttl=timedelta(days=5))
    other = await app.enqueue(Later(key="other"), delay=timedelta(days=3), ttl=timedelta(days=5))
    receipt = await app.cancel(sent.tracking_id)
    assert receipt.status != MessageStatus.CANCELLED, receipt
    assert receipt.detail.startswith("not cancelled"), receipt.detail
    assert (await app.status(sent.tracking_id)).status != MessageStatus.CANCELLED
    # and no request is left behind: it would cancel the message were it received within the day
    rt.control.invalidate()
    assert sent.message_id not in (await rt.control.state()).cancelled
    # a day and an hour later an operator cancels some other message (any set_cancel prunes)
    shift[0] = timedelta(hours=25)
    await app.cancel(other.tracking_id)
    # the first message comes due
    shift[0] = timedelta(days=2, minutes=1)
    async with running(rt):
        try:
            got = await app.result(sent.tracking_id, timeout=5)
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.5)
        final = await app.status(sent.tracking_id)
    # as the receipt said: it ran when it came due, and what the waiter got is its result
    assert ran == ["k"], (ran, got, final.status)
    assert got == "ran"
    assert final.status == MessageStatus.SUCCEEDED
