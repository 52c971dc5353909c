"""A refused operator retry keeps the cancel request it found.

``OpsService.retry`` withdraws a cancel request before the copy (it would cancel the new run). A first
version withdrew it for good even when the retry did not go ahead (a review found it): Service Bus
refuses to retry a ``Failed``/``Sleeping`` message (its scheduled copy "cannot be brought forward"), so
a cancel that reached the control store after its run had failed no longer stopped the scheduled copy,
which ran when it came due although the operator's cancel stood.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, Retry, queue
from queueing_core.clock import utcnow
from queueing_core.control import MemoryControlStore
from queueing_core.errors import InvalidOperation
from queueing_core.fakes.servicebus import (
    FakeServiceBusAdministrationClient,
    FakeServiceBusClient,
    FakeServiceBusNamespace,
)
from queueing_core.ops.service import OpsService
from queueing_core.providers.servicebus import ServiceBusProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking.memory import MemoryTracker
from tests.contract.harness import running, wait_until


@queue("review_r2_retry_cancel", max_attempts=5)
class Refund(QueueMessage):
    key: str


async def test_a_refused_retry_leaves_the_cancel_request_standing():
    app = QueueingApp("review-r2-retry-cancel")

    @app.handler()
    async def refund(msg: Refund) -> None:
        raise Retry(after=timedelta(hours=1), reason="payments down")

    ns = FakeServiceBusNamespace()
    provider = ServiceBusProvider(
        client=FakeServiceBusClient(ns),
        admin=FakeServiceBusAdministrationClient(ns),
        control=MemoryControlStore(),
        tracker=MemoryTracker(),
        receive_wait=0.1,
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    try:
        r = await app.enqueue(Refund(key="r1"))

        async def failed() -> bool:
            rec = await rt.tracker.get(r.message_id)
            return rec is not None and rec.status == MessageStatus.FAILED

        async with running(rt):
            await wait_until(failed, what="the first attempt to fail (copy scheduled an hour out)")

        # the operator's cancel request, written after the run had ended (the race 00d324b describes):
        # it stands, so the scheduled copy is settled Cancelled when it comes due
        await rt.control.set_cancel(r.message_id, True, utcnow())
        rt.control.invalidate()
        assert r.message_id in (await rt.control.state()).cancelled

        # the operator also clicks retry; Service Bus refuses it (a scheduled copy cannot be brought
        # forward)
        with pytest.raises(InvalidOperation):
            await OpsService(rt).retry(r.message_id)

        rt.control.invalidate()
        assert r.message_id in (await rt.control.state()).cancelled, (
            "the refused retry withdrew the cancel request: the scheduled copy will run"
        )
    finally:
        await rt.close()
