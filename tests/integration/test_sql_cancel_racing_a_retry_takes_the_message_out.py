"""On SQL a cancel whose request lands just after a run's retry still cancels the message.

A cancel writes its request first, then takes a waiting message out of the queue, guarded by the status
it read; a message it read running was only told. A run that ended with a retry between the cancel's
read and its request was settled waiting (the request did not stand yet, so its settlement could not
honour it) and the cancel answered "cancellation requested": the request lapsed after a day, and a retry
due later than that ran the cancelled message again. The cancel now reads the message again once its
request stands and takes it out if it is waiting.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.errors import Retry
from queueing_core.testing import run_until_idle

START = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


@queue("cancel-race-retry", expiration=None)
class Poll(QueueMessage):
    key: str


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


@pytest.mark.parametrize("read", ["running", "waiting"])
async def test_a_cancel_racing_a_long_retry_takes_the_message_out(sql_db, read: str) -> None:
    clock = Clock()
    app = QueueingApp("cancel-race-retry")
    runs: list[str] = []
    started, finish = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def poll(msg: Poll) -> None:
        runs.append(msg.key)
        started.set()
        await finish.wait()
        raise Retry(timedelta(days=2), "downstream busy")

    rt = app.use(sql_db.provider(clock=clock), clock=clock)
    async with rt:
        sent = await app.enqueue(Poll(key="p", created_at=clock()))
        worker: asyncio.Task[int] | None = None
        if read == "running":
            worker = asyncio.create_task(run_until_idle(rt, raise_errors=False))
            await asyncio.wait_for(started.wait(), 10)
        real_set_cancel = rt.control.set_cancel

        async def the_run_ends_first(message_id, requested, now):
            # the cancel has read the message (running, or waiting); its run ends with a retry, two days
            # out, before the request is written
            finish.set()
            if worker is not None:
                await worker
            else:
                await run_until_idle(rt, raise_errors=False)
            await real_set_cancel(message_id, requested, now)

        rt.control.set_cancel = the_run_ends_first  # type: ignore[method-assign]
        try:
            receipt = await app.cancel(sent.tracking_id)
        finally:
            rt.control.set_cancel = real_set_cancel  # type: ignore[method-assign]
        status_now = (await app.status(sent.tracking_id)).status
        clock.now += timedelta(days=2, minutes=1)  # the request has lapsed by now
        await run_until_idle(rt, raise_errors=False)
        final = (await app.status(sent.tracking_id)).status
    assert runs == ["p"], f"ran again: the cancel said {receipt.status} ({receipt.detail}), then {status_now}"
    assert receipt.status == MessageStatus.CANCELLED, receipt
    assert status_now == MessageStatus.CANCELLED
    assert final == MessageStatus.CANCELLED
