"""A refused operator retry keeps the cancel request it found.

``OpsService.retry`` withdraws a cancel request before the copy (it would cancel the new run). A first
version withdrew it for good even when the retry did not go ahead (a review found it): Service Bus
refuses to retry a ``Failed``/``Sleeping`` message (its scheduled copy "cannot be brought forward"), so
a cancel that reached the control store after its run had failed no longer stopped the scheduled copy,
which ran when it came due although the operator's cancel stood.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, Retry, queue
from queueing_core.clock import utcnow
from queueing_core.control import MemoryControlStore
from queueing_core.errors import InvalidOperation, ProviderUnavailable
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


async def _failed_once(name: str) -> tuple[Runtime, ServiceBusProvider, Any]:
    """A runtime on the Service Bus stand-in (the caller closes it) and a message whose first run
    failed, its copy scheduled an hour out."""
    app = QueueingApp(name)

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
    r = await app.enqueue(Refund(key="r1"))

    async def failed() -> bool:
        rec = await rt.tracker.get(r.message_id)
        return rec is not None and rec.status == MessageStatus.FAILED

    try:
        async with running(rt):
            await wait_until(failed, what="the first attempt to fail (copy scheduled an hour out)")
    except BaseException:
        await rt.close()
        raise
    return rt, provider, r


async def test_a_refused_retry_leaves_the_cancel_request_standing():
    rt, _, r = await _failed_once("review-r2-retry-cancel")
    try:
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


async def test_a_retry_of_a_cancelled_message_whose_copy_was_not_sent_leaves_the_cancel_standing():
    """The message waits as a scheduled copy and the operator cancelled it (the request stands for
    that copy's run), then retried it, and the copy of the retry could not be sent: the history is put
    back (Cancelled), and so is the request it withdrew, or the scheduled copy would run an hour later
    while the history says it never will (found in review)."""
    rt, provider, r = await _failed_once("review-retry-cancel-not-sent")
    try:
        ops = OpsService(rt)
        await ops.cancel(r.message_id)
        cancelled = await rt.tracker.get(r.message_id)
        assert cancelled is not None
        assert cancelled.status == MessageStatus.CANCELLED

        async def refused(*args: object, **kwargs: object) -> None:
            raise ProviderUnavailable("injected: Service Bus unreachable")

        provider.send_copy = refused  # type: ignore[method-assign]
        with pytest.raises(ProviderUnavailable):
            await ops.retry(r.message_id)

        rt.control.invalidate()
        assert r.message_id in (await rt.control.state()).cancelled, (
            "the failed retry withdrew the cancel request: the scheduled copy will run"
        )
        assert await rt.tracker.get(r.message_id) == cancelled
    finally:
        await rt.close()


async def test_a_store_that_fails_as_a_retry_puts_its_cancel_back_does_not_hide_the_retrys_error():
    """The copy could not be sent, and then the history store failed too: the operator must see why
    the retry failed (the transport), not the store's error raised while putting the request back
    (found in review: a cancelled task's CancelledError was replaced the same way)."""
    rt, provider, r = await _failed_once("review-retry-error-kept")
    try:
        ops = OpsService(rt)
        await ops.cancel(r.message_id)
        tracker = rt.tracker
        reads = tracker.get

        async def refused(*args: object, **kwargs: object) -> None:
            async def store_down(message_id: object) -> None:
                raise ConnectionError("injected: the history store is unreachable")

            tracker.get = store_down  # type: ignore[method-assign]  # (from the failed send on)
            raise ProviderUnavailable("injected: Service Bus unreachable")

        provider.send_copy = refused  # type: ignore[method-assign]
        with pytest.raises(ProviderUnavailable):
            await ops.retry(r.message_id)
        tracker.get = reads  # type: ignore[method-assign]
    finally:
        await rt.close()
