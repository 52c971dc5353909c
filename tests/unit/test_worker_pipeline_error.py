"""A message whose processing fails in the kit itself (not in its handler) waits before it runs again.

The worker handed such a message back at once, uncounted: one that failed the pipeline on every run
(an exception whose ``str()`` failed, found by a review; or the control store unreachable) was claimed
again at once and ran again, as fast as the worker could claim, for ever. It now waits
``PIPELINE_ERROR_WAIT`` and is kept meanwhile (a duplicate at worst, never a loss)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker


@queue("pipeline-error")
class Job(QueueMessage):
    n: int


async def test_a_message_the_pipeline_fails_on_waits_and_is_kept() -> None:
    app = QueueingApp("pipeline-error")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Job) -> None:
        runs.append(msg.n)

    rt = Runtime(app, InProcessProvider())
    failed: list[int] = []

    async def broken(delivery, **kwargs):
        # (as an exception whose text cannot be made did, in the pipeline's own handling of a failure)
        failed.append(delivery.attempt)
        raise ConnectionError("control store unreachable")

    rt.pipeline.process = broken  # type: ignore[method-assign]
    receipt = await rt.producer.enqueue(Job(n=1))
    worker = Worker(rt, poll_min=0.01, poll_max=0.01)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    try:
        for _ in range(200):  # until the pipeline has failed on it at least once
            if failed:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
    finally:
        worker.request_stop()
        await task
    assert runs == []
    # handed back at once, it came back (and failed) hundreds of times in that second
    assert len(failed) == 1, len(failed)
    # kept, due again after the wait, with no attempt used
    rec = await rt.tracker.get(receipt.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.PENDING.value
    assert rec.attempt == 0
    assert rec.not_before is not None
    assert rec.not_before - rec.updated_at >= timedelta(seconds=5)
    assert "pipeline error: ConnectionError: control store unreachable" in (rec.reason or "")
