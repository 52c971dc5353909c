"""On SQL an identical enqueue of an idempotent type is not discarded against a version being cancelled.

An enqueue whose identity and JSON equal the waiting version's is discarded: the waiting version runs
for it. A version with a standing cancellation request will not run: the next claim settles it
Cancelled unrun. A cancel that read the version waiting, while a host claimed it and its run ended with
a retry before the request was written, leaves just that (the row waiting for its retry, and the
request). The enqueue was discarded against it anyway, told "discarded", and nothing ran for it (found
by a review): a requested run was lost. Such an enqueue is now a version of its own, and the cancelled
one is settled Cancelled as asked.

(A run's settlement that leaves its message waiting now honours a standing request itself, and a cancel
that read the message running looks again once its request stands; the row and the request still meet
where a cancel stopped between its two steps, which is how the test below makes them.)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from queueing_core import HandlerContext, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.errors import Retry
from queueing_core.testing import run_until_idle

START = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


@queue("sync-discard-cancel", idempotent=True, identity="sku")
class SyncProduct(QueueMessage):
    sku: str
    price: int


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


def _app(runs: list[int]) -> QueueingApp:
    app = QueueingApp("sync-discard-cancel")

    @app.handler()
    async def sync(msg: SyncProduct, ctx: HandlerContext) -> None:
        runs.append(msg.price)
        if len(runs) == 1:
            raise Retry(timedelta(seconds=10), "downstream busy")

    return app


async def test_an_identical_enqueue_is_not_discarded_against_a_version_being_cancelled(sql_db) -> None:
    clock = Clock()
    runs: list[int] = []
    app = _app(runs)
    rt = app.use(sql_db.provider(clock=clock), clock=clock)
    async with rt:
        first = await app.enqueue(SyncProduct(sku="A", price=5, created_at=clock()))
        await run_until_idle(rt, raise_errors=False)  # its run ends with a retry
        assert (await app.status(first.tracking_id)).status == MessageStatus.FAILED
        # a cancel's request stands for it, the row still waiting for its retry: what a cancel leaves
        # that stopped (its process gone) between writing the request and taking the row out of the
        # queue, or whose request a run's retry settled just before (``app.cancel`` now looks again)
        await rt.control.set_cancel(first.message_id, True, clock())
        # a producer asks for the same sync again: a new request, which must run
        again = await app.enqueue(SyncProduct(sku="A", price=5, created_at=clock()))
        clock.now += timedelta(seconds=30)
        await run_until_idle(rt, raise_errors=False)
        first_status = (await app.status(first.message_id)).status
        again_status = (await app.status(again.message_id)).status
    assert again.outcome != "discarded", (
        f"discarded against {again.message_id}, which then ended {first_status} without running: runs={runs}"
    )
    assert again.outcome == "enqueued"
    assert again.message_id != first.message_id
    assert runs == [5, 5]
    assert first_status == MessageStatus.CANCELLED  # the cancel holds for the version it named
    assert again_status == MessageStatus.SUCCEEDED


async def test_a_changed_version_still_replaces_a_version_being_cancelled(sql_db) -> None:
    """A changed body takes the waiting row and withdraws its request, as the docs say: it runs."""
    clock = Clock()
    runs: list[int] = []
    app = _app(runs)
    rt = app.use(sql_db.provider(clock=clock), clock=clock)
    async with rt:
        first = await app.enqueue(SyncProduct(sku="C", price=5, created_at=clock()))
        await run_until_idle(rt, raise_errors=False)
        await rt.control.set_cancel(first.message_id, True, clock())
        changed = await app.enqueue(SyncProduct(sku="C", price=6, created_at=clock()))
        clock.now += timedelta(seconds=30)
        await run_until_idle(rt, raise_errors=False)
        status = (await app.status(first.message_id)).status
    assert changed.outcome == "replaced"
    assert changed.message_id == first.message_id
    assert runs == [5, 6]
    assert status == MessageStatus.SUCCEEDED


async def test_an_identical_enqueue_is_discarded_against_a_version_whose_request_lapsed(sql_db) -> None:
    """A request older than a day is honoured by no host: the version it named runs, so an identical
    enqueue is discarded against it as against any waiting version."""
    clock = Clock()
    runs: list[int] = []
    app = _app(runs)
    rt = app.use(sql_db.provider(clock=clock), clock=clock)
    async with rt:
        first = await app.enqueue(SyncProduct(sku="B", price=7, created_at=clock()))
        await run_until_idle(rt, raise_errors=False)  # its run ends with a retry
        await rt.control.set_cancel(first.message_id, True, clock() - timedelta(days=1, minutes=1))
        again = await app.enqueue(SyncProduct(sku="B", price=7, created_at=clock()))
        clock.now += timedelta(seconds=30)
        await run_until_idle(rt, raise_errors=False)
        first_status = (await app.status(first.message_id)).status
    assert again.outcome == "discarded"
    assert again.message_id == first.message_id
    assert runs == [7, 7]
    assert first_status == MessageStatus.SUCCEEDED
