"""A circuit probe handed back at a graceful stop held its type for ``probe_timeout``.

When the cooldown ends one message probes (half-open, ``probe_until = now + probe_timeout``, 5 min by
default). If the worker stops while the probe runs, the handler is cancelled and the message released,
and nothing was recorded for a released run, so the circuit stayed half-open with a probe that would
never report: SQL's claim left every row of the type alone until ``probe_timeout`` (meant for a probe
whose host died), and a rolling restart during a probe stalled the type for 5 minutes. The pipeline
now hands the probe back (``release_probe``)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from queueing_core import CircuitBreakerOptions, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from tests.contract.harness import fast_worker, running, wait_until

CB = CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(milliseconds=200))


@queue("review_probe_release", circuit_breaker=CB, max_attempts=5)
class Charge(QueueMessage):
    n: int


async def test_a_probe_released_at_a_stop_does_not_hold_its_type_for_the_probe_timeout(sql_db):
    app = QueueingApp("review-probe-release")
    healthy = False
    started = asyncio.Event()
    ran: list[int] = []

    @app.handler()
    async def charge(msg: Charge) -> None:
        if not healthy:
            started.set()
            await asyncio.Event().wait()  # the probe is still running when the host stops
        ran.append(msg.n)

    rt = Runtime(app, sql_db.provider(), control_ttl=0.05, pause_recheck=timedelta(milliseconds=200))
    await rt.open()
    try:
        # the circuit opened a while ago: its cooldown is over, the next message probes
        await rt.control.record_failure("Charge", CB, datetime.now(UTC) - timedelta(seconds=5))
        r = await app.enqueue(Charge(n=1))

        worker = fast_worker(rt, shutdown_timeout=0.2)
        await worker.start()
        await asyncio.wait_for(started.wait(), 30)
        rt.control.invalidate()
        assert (await rt.control.state()).circuit("Charge").state == "half_open"
        await worker.shutdown()  # the probe is cancelled and its message given back, unrun
        rec = await rt.tracker.get(r.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.PENDING

        healthy = True  # the downstream is back; a new worker starts (a rolling restart)
        async with running(rt):
            # the released probe frees the circuit for another probe at once (it held the type until
            # probe_timeout, 5 min)
            try:
                await wait_until(lambda: ran == [1], timeout=10, what="the released message to probe again")
            except AssertionError:
                rt.control.invalidate()
                held = (await rt.control.state()).circuit("Charge")
                raise AssertionError(f"still held: {held.state}, probe_until={held.probe_until}") from None
    finally:
        await rt.close()
