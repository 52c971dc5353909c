"""A retry policy with no cap (``max_delay=timedelta.max``), or a handler's ``Retry(after=timedelta.max)``.

The delay grew past what a timestamp holds: first an OverflowError in the pipeline on every run of the
message (found by a review), then, once the policy stopped raising, in the worker's settler, which
died and settled nothing more (found by a review of that fix). A retry now waits a thousand years at
most: the message is kept, Failed, and the worker goes on settling everything else."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, Retry, RetryPolicy, queue
from queueing_core.pipeline import LONGEST_RETRY
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker


@queue("no-cap", retry=RetryPolicy(base=timedelta.max, max_delay=timedelta.max, jitter=0), max_attempts=3)
class NoCap(QueueMessage):
    n: int = 0


@queue("no-cap-other")
class Other(QueueMessage):
    n: int = 0


@pytest.mark.parametrize("failing", ["a policy with no cap", "Retry(after=timedelta.max)"])
async def test_a_retry_past_any_timestamp_is_kept_and_the_worker_settles_the_rest(failing) -> None:
    app = QueueingApp("no-cap")
    runs: list[int] = []

    @app.handler()
    async def fails(msg: NoCap) -> None:
        runs.append(msg.n)
        if failing == "a policy with no cap":
            raise RuntimeError("downstream gone")
        raise Retry(after=timedelta.max)

    @app.handler()
    async def fine(msg: Other) -> None:
        return None

    rt = Runtime(app, InProcessProvider())
    failed = await rt.producer.enqueue(NoCap())
    worker = Worker(rt, poll_min=0.01, poll_max=0.01)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    try:
        for _ in range(500):
            if runs:
                break
            await asyncio.sleep(0.01)
        others = [await rt.producer.enqueue(Other(n=i)) for i in range(3)]
        for _ in range(500):
            recs = [await rt.tracker.get(o.message_id) for o in others]
            if all(r is not None and r.status == MessageStatus.SUCCEEDED.value for r in recs):
                break
            await asyncio.sleep(0.01)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)  # (the settler died with an OverflowError: raised here)
    assert [(await rt.tracker.get(o.message_id)).status for o in others] == ["Succeeded"] * 3
    rec = await rt.tracker.get(failed.message_id)
    assert rec is not None
    assert (rec.status, rec.attempt, runs) == (MessageStatus.FAILED.value, 1, [0])
    assert rec.not_before is not None
    assert rec.not_before - rec.updated_at == LONGEST_RETRY
