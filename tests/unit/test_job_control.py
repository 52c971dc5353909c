"""Job control pieces that need no transport: the per-message cancellation watch a Functions trigger
uses, the result size rule, and progress throttling."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import HandlerContext, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.pipeline import MAX_RESULT_CHARS, RESULT_PREVIEW_CHARS, fit_result
from queueing_core.testing import in_process


@queue("watch", cancel_grace=timedelta(seconds=5))
class Work(QueueMessage):
    n: int


async def test_a_host_running_one_message_hears_its_cancellation():
    app = QueueingApp("watch")
    reports: list[int] = []

    @app.handler()
    async def handle(msg: Work, ctx: HandlerContext) -> str:
        for i in range(10_000):  # still running when the cancellation comes, however slow the machine
            reports.append(i)
            await ctx.report_progress(i, 10_000)
            if ctx.cancelled.is_set():
                return "stopped"
            await asyncio.sleep(0.01)
        return "finished"

    rt = in_process(app)
    await rt.open()
    r = await app.enqueue(Work(n=1))
    sub = app.subscription("Work")
    assert sub is not None
    (delivery,) = await rt.provider.receive(sub, 1)
    running = asyncio.create_task(rt.process(delivery, cancel_poll=0.02))
    while not reports:
        await asyncio.sleep(0.01)
    await app.cancel(r.tracking_id)
    settlement = await asyncio.wait_for(running, 30)
    assert settlement.decision == Complete("stopped", cancelled=True)
    assert settlement.decision.status == MessageStatus.CANCELLED
    assert len(reports) < 10_000
    await rt.record([settlement])
    assert (await app.status(r.tracking_id)).status == MessageStatus.CANCELLED


def test_results_over_the_limit_become_a_marker_with_a_preview():
    assert fit_result({"a": 1}) == {"a": 1}
    assert fit_result(None) is None
    big = fit_result({"text": "y" * MAX_RESULT_CHARS})
    assert big["_truncated"] is True
    assert big["_original_chars"] > MAX_RESULT_CHARS
    assert len(big["_preview"]) == RESULT_PREVIEW_CHARS
    assert fit_result(object()).startswith("<object")  # not JSON: kept as its repr


async def test_progress_is_stored_at_most_once_a_second_and_at_the_end(monkeypatch):
    import types

    from queueing_core import context
    from queueing_core.context import HandlerContext as Ctx

    # the clock stands still: "within the second" holds however long a loaded machine takes
    monkeypatch.setattr(context, "time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    stored: list[dict] = []

    async def store(p: dict) -> None:
        stored.append(p)

    ctx = Ctx(envelope=None, attempt=1, subscription=None, message=None, store_progress=store)  # type: ignore[arg-type]
    for step in range(1, 50):
        await ctx.report_progress(step, 100, "working")
    assert len(stored) == 1  # the first report; the others within the second are held
    await ctx.report_progress(100, 100, "done")  # reaching the total is always stored
    assert stored[-1] == {"step": 100, "total": 100, "text": "done"}
    await ctx.flush_progress()
    assert len(stored) == 2  # nothing new to store


async def test_result_of_a_dead_lettered_message_raises_job_failed_with_the_reason():
    import pytest

    from queueing_core import NonRetryableError
    from queueing_core.errors import JobFailed
    from queueing_core.testing import run_until_idle

    app = QueueingApp("failing")

    @app.handler()
    async def handle(msg: Work) -> None:
        raise NonRetryableError("card declined")

    rt = in_process(app)
    r = await app.enqueue(Work(n=1))
    await run_until_idle(rt, raise_errors=False)
    with pytest.raises(JobFailed, match="non-retryable") as caught:
        await app.result(r.tracking_id, timeout=1)
    assert caught.value.status == MessageStatus.DEAD_LETTERED
    assert "card declined" in (caught.value.description or "")
