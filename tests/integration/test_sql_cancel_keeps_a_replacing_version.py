"""A cancel that read the message running leaves a request; a changed-body enqueue that replaces the
waiting row withdraws it ("the new run is not cancelled"), and the new version runs. A cancel that read
the row again after writing its request (tried in review, taken back) cancelled the replacing version
instead: its requested run was lost (found in review of that change)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import RetryAfter
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.transport import Settlement

START = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


@queue("cancel-reread-replace", expiration=None, idempotent=True, identity="sku")
class Sync(QueueMessage):
    sku: str
    price: int


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


async def test_a_version_that_replaced_the_cancelled_one_runs(sql_db) -> None:
    clock = Clock()
    app = QueueingApp("cancel-reread-replace")
    runs: list[int] = []

    @app.handler()
    async def sync(msg: Sync) -> None:
        runs.append(msg.price)

    provider = sql_db.provider(clock=clock, listen=False)
    rt = Runtime(app, provider, clock=clock)
    await rt.open()
    try:
        first = await app.enqueue(Sync(sku="A", price=1, created_at=clock()))
        [run] = await provider.receive(app.subscription("Sync"), 1)  # version 1 runs
        real_set_cancel = rt.control.set_cancel
        replaced = []

        async def interleaved(message_id, requested, now):
            # the cancel has read version 1 running. Its run ends with a retry just before the request
            # (the race the commit addresses), the request is written, and a producer's new version
            # replaces the waiting row (withdrawing the request) before the cancel reads it again
            await provider.settle([Settlement(run, RetryAfter(timedelta(seconds=10), "busy"))])
            await real_set_cancel(message_id, requested, now)
            replaced.append(await app.enqueue(Sync(sku="A", price=2, created_at=clock())))

        rt.control.set_cancel = interleaved  # type: ignore[method-assign]
        try:
            receipt = await app.cancel(first.message_id)
        finally:
            rt.control.set_cancel = real_set_cancel  # type: ignore[method-assign]
        assert replaced[0].outcome == "replaced"  # the producer is told its version will run
        clock.now += timedelta(minutes=1)
        await run_until_idle(rt, raise_errors=False)
        status = (await rt.tracker.get(first.message_id)).status
    finally:
        await rt.close()
    assert runs == [2], (
        f"the replacing version (enqueue told 'replaced') never ran: cancel said {receipt.status} "
        f"({receipt.detail}); the row ended {status}; runs={runs}"
    )
    assert status == MessageStatus.SUCCEEDED
