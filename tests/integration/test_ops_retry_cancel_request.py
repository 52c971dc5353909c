"""A cancellation request that never reached its run outlived the run, and an operator's retry of the
message (dead-lettered by that run) was then settled Cancelled without running.

``jobs.cancel`` reads the message Leased, then writes the request (kept a day). A run that ends in
between, or within the worker's ``cancel_poll`` after it (1 s; no NOTIFY on SQLite and the brokers),
never sees it: on its last attempt the message is dead-lettered and the request stays. The retry
withdrew a request only when the message it retried was ``Cancelled``; it now withdraws it always
(as ``update status where ... Pending`` does, where.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.ops.service import OpsService
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until


@queue("review_cancel_retry", max_attempts=1, cancel_grace=timedelta(milliseconds=200))
class Report(QueueMessage):
    key: str


async def _status(rt: Runtime, message_id) -> str | None:
    rec = await rt.tracker.get(message_id)
    return None if rec is None else rec.status


async def test_an_operator_retry_after_a_cancel_that_missed_its_run_runs_the_message(sql_db):
    app = QueueingApp("review-cancel-retry")
    runs: list[int] = []
    started, go = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def build(msg: Report) -> None:
        runs.append(len(runs) + 1)
        if len(runs) == 1:  # the first run fails on its only attempt, the operator's retry succeeds
            started.set()
            await go.wait()
            raise ConnectionError("report store down")

    rt = Runtime(app, sql_db.provider(), control_ttl=0.05)
    await rt.open()
    try:
        r = await app.enqueue(Report(key="q3"))
        control = rt.control
        real_set_cancel = control.set_cancel

        async def set_cancel_after_the_run_ended(message_id, requested, now):
            # the race, made deterministic: jobs.cancel has read the message Leased; the run ends
            # (dead-lettered, its last attempt) before the request is written
            go.set()
            await wait_until(
                lambda: _is(rt, r.message_id, MessageStatus.DEAD_LETTERED), what="the run to end"
            )
            await real_set_cancel(message_id, requested, now)

        async with running(rt, cancel_poll=0.05):
            await asyncio.wait_for(started.wait(), 30)
            control.set_cancel = set_cancel_after_the_run_ended  # type: ignore[method-assign]
            try:
                receipt = await app.cancel(r.tracking_id)
            finally:
                control.set_cancel = real_set_cancel  # type: ignore[method-assign]
            assert receipt.status == MessageStatus.LEASED  # "cancellation requested"
            assert await _status(rt, r.message_id) == MessageStatus.DEAD_LETTERED

            # the operator sees a dead letter and retries it
            result = await OpsService(rt).retry(r.message_id)
            assert result.status == MessageStatus.PENDING
            await wait_until(lambda: _settled(rt, r.message_id), what="the retried message to be settled")
        # the retry must run the message; it was settled Cancelled by the stale request instead
        assert runs == [1, 2], (runs, await _status(rt, r.message_id))
        assert await _status(rt, r.message_id) == MessageStatus.SUCCEEDED
    finally:
        await rt.close()


async def _is(rt: Runtime, message_id, status: str) -> bool:
    return await _status(rt, message_id) == status


async def _settled(rt: Runtime, message_id) -> bool:
    return await _status(rt, message_id) in (
        MessageStatus.SUCCEEDED,
        MessageStatus.CANCELLED,
        MessageStatus.DEAD_LETTERED,
    )
