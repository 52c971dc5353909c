"""Two operator retries of one cancelled message at once: the one that loses must not cancel the run
the winner started.

``OpsService.retry`` withdraws a standing cancel request before its copy and puts it back when the
retry does not go ahead. A first version put it back whatever stopped the retry (a review found it):
two retries (a double click, the dashboard's bulk retry beside an API call) both found the request and
withdrew it; the one whose change of the message lost put the request back, and the winner's run was
settled Cancelled without running, while its operator had been told "retry scheduled".
"""

from __future__ import annotations

import asyncio

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidOperation
from queueing_core.ops.service import OpsService
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until


@queue("review_retry_race_cancel", max_attempts=1)
class Export(QueueMessage):
    key: str


async def test_the_retry_that_loses_a_race_leaves_the_winners_run_uncancelled(sql_db):
    app = QueueingApp("review-retry-race-cancel")
    runs: list[str] = []

    @app.handler()
    async def export(msg: Export) -> None:
        runs.append(msg.key)

    rt = Runtime(app, sql_db.provider(), control_ttl=0.05)
    await rt.open()
    try:
        r = await app.enqueue(Export(key="e1"))
        await app.cancel(r.tracking_id)  # no worker yet: settled Cancelled, the request stands
        assert (await rt.tracker.get(r.message_id)).status == MessageStatus.CANCELLED

        # both retries have read the request before either withdraws it
        control = rt.control
        real_set_cancel = control.set_cancel
        withdrawing: list[bool] = []
        both = asyncio.Event()

        async def set_cancel(message_id, requested, now):
            if not requested:
                withdrawing.append(requested)
                if len(withdrawing) == 2:
                    both.set()
                await asyncio.wait_for(both.wait(), 10)
            await real_set_cancel(message_id, requested, now)

        control.set_cancel = set_cancel  # type: ignore[method-assign]
        ops = OpsService(rt)
        try:
            results = await asyncio.gather(
                ops.retry(r.message_id), ops.retry(r.message_id), return_exceptions=True
            )
        finally:
            control.set_cancel = real_set_cancel  # type: ignore[method-assign]
        assert len(withdrawing) == 2  # the race was made, not missed
        won = [x for x in results if not isinstance(x, BaseException)]
        lost = [x for x in results if isinstance(x, BaseException)]
        assert [x.status for x in won] == [MessageStatus.PENDING]
        assert [type(x) for x in lost] == [InvalidOperation], lost

        control.invalidate()
        assert r.message_id not in (await control.state()).cancelled, (
            "the losing retry put the cancel request back: the winner's run will be cancelled"
        )

        async def settled() -> bool:
            rec = await rt.tracker.get(r.message_id)
            return rec.status not in (MessageStatus.PENDING, MessageStatus.LEASED)

        async with running(rt):
            await wait_until(settled, what="the retried message to settle")
        assert (await rt.tracker.get(r.message_id)).status == MessageStatus.SUCCEEDED
        assert runs == ["e1"]
    finally:
        await rt.close()


async def test_a_host_whose_cached_state_still_shows_the_withdrawn_request_runs_the_retry(sql_db):
    """The retry withdraws the request on the operator's host; another host's cached control state
    (``control_ttl``) still showed it, and that host settled the retried message Cancelled unrun. A
    request in the cached state is read again from the store before a message is settled unrun."""
    app = QueueingApp("review-retry-cached-cancel")
    runs: list[str] = []

    @app.handler()
    async def export(msg: Export) -> None:
        runs.append(msg.key)

    operator = Runtime(app, sql_db.provider(), control_ttl=0.05)
    worker_host = Runtime(app, sql_db.provider(), control_ttl=60)
    await operator.open()
    await worker_host.open()
    try:
        r = await app.enqueue(Export(key="e2"))
        await app.cancel(r.tracking_id)
        assert (await operator.tracker.get(r.message_id)).status == MessageStatus.CANCELLED
        assert r.message_id in (await worker_host.control.state()).cancelled  # cached for a minute
        await OpsService(operator).retry(r.message_id)

        async def settled() -> bool:
            rec = await operator.tracker.get(r.message_id)
            return rec.status not in (MessageStatus.PENDING, MessageStatus.LEASED)

        async with running(worker_host):
            await wait_until(settled, what="the retried message to settle")
        assert (await operator.tracker.get(r.message_id)).status == MessageStatus.SUCCEEDED
        assert runs == ["e2"]
    finally:
        await operator.close()
        await worker_host.close()
