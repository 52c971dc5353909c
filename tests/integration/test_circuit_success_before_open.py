"""A success whose run began before the breaker opened must not close the open breaker.

The pipeline reads the state at the end of a success whose start-of-run state was clean, to reset the
failures counted while it ran. A first version reset an open circuit too (a review found it): a slow
run that started while the circuit was closed, and finished after concurrent failures opened it, closed
it at once, bypassing the cooldown and the single probe. With ``max_concurrency`` > 1 that is the common
case when a downstream goes down. (Polly and the like ignore a success placed before the break.)

A later review found the same for a run whose start already showed a failure counted: the pipeline sent
such a success straight to the store, which closed whatever it found. Both starts are tested.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from queueing_core import CircuitBreakerOptions, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, running, wait_until

CB = CircuitBreakerOptions(failure_threshold=3, cooldown=timedelta(minutes=10))


@queue("review_r2_stale_success", circuit_breaker=CB, max_attempts=1)
class Call(QueueMessage):
    ok: bool
    slow: bool = False


async def _fail_once(rt: Runtime) -> None:
    r = await rt.app.enqueue(Call(ok=False))
    await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="a failure")


@pytest.mark.parametrize("counted_at_start", [0, 1])
async def test_a_success_begun_before_the_breaker_opened_does_not_close_it(counted_at_start: int):
    app = QueueingApp("review-r2-stale-success")
    go = asyncio.Event()
    slow_started = asyncio.Event()

    @app.handler(Call, max_concurrency=3)
    async def call(msg: Call) -> None:
        if msg.slow:
            slow_started.set()
            await go.wait()
        if not msg.ok:
            raise ConnectionError("downstream down")

    rt = Runtime(app, InProcessProvider(), control_ttl=0.05, pause_recheck=timedelta(milliseconds=200))
    await rt.open()
    try:
        async with running(rt):
            for _ in range(counted_at_start):
                await _fail_once(rt)
            rt.control.invalidate()
            assert (await rt.control.state()).circuit("Call").consecutive_failures == counted_at_start
            slow = await app.enqueue(Call(ok=True, slow=True))  # its run starts seeing that count
            await asyncio.wait_for(slow_started.wait(), 30)
            for _ in range(CB.failure_threshold - counted_at_start):
                await _fail_once(rt)
            rt.control.invalidate()
            assert (await rt.control.state()).circuit("Call").state == "open"
            go.set()
            await wait_until(
                lambda: all_have(rt, [slow.message_id], MessageStatus.SUCCEEDED), what="the slow success"
            )
        rt.control.invalidate()
        state = (await rt.control.state()).circuit("Call")
        # the breaker opened by the failures stays open for its cooldown
        assert state.state == "open", f"a stale success closed the open breaker: {state}"
    finally:
        await rt.close()
