"""A cancel that races a host's outcome does not write its request over that outcome.

On the transports whose history does not say whether a host runs a message (all but SQL), a cancel of
a waiting message writes ``Cancelled`` ("cancellation requested") into the history at once. A first
version wrote it over whatever the history held by then (a review found it): a host that ran the
message between the cancel's read and its write had recorded ``Succeeded``; the request replaced it,
the handler's result was gone, and ``result()`` waited for ever for a settlement that had happened.
The request's record is now written only over the record the cancel read (its status and time).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.errors import InvalidOperation
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import in_process, run_until_idle
from queueing_core.tracking import MessageRecord


@queue("review.cancel-race")
class Quote(QueueMessage):
    n: int


def _app() -> QueueingApp:
    app = QueueingApp("review-cancel-race", naming=QueueNaming(prefix=f"t{uuid.uuid4().hex[:8]}-"))

    @app.handler()
    async def quote(msg: Quote) -> dict[str, int]:
        return {"price": msg.n * 10}

    return app


@pytest.fixture(params=["in-process", "storage-queues"])
async def runtime(request: pytest.FixtureRequest):
    app = _app()
    if request.param == "in-process":
        rt = in_process(app)
        await rt.open()
        yield rt
        await rt.close()
        return
    azurite = request.getfixturevalue("azurite")
    tag = uuid.uuid4().hex[:8]
    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"ctl{tag}", tracker_table=f"hist{tag}"
    )
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    yield rt
    for q in (provider.physical("review.cancel-race"), provider.poison_name("review.cancel-race")):
        await provider.client(q).delete_queue()
    await rt.close()


async def test_a_cancel_that_races_a_success_leaves_the_success_and_its_result(runtime: Runtime):
    app = runtime.app
    r = await app.enqueue(Quote(n=4))
    real_set_cancel = runtime.control.set_cancel
    ran: list[int] = []

    async def a_host_runs_it_meanwhile(message_id, requested, now):
        if requested:  # the cancel has read the message waiting; a host runs it before the write
            ran.append(await run_until_idle(runtime))
        await real_set_cancel(message_id, requested, now)

    runtime.control.set_cancel = a_host_runs_it_meanwhile  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidOperation, match="already succeeded"):
            await app.cancel(r.tracking_id)
    finally:
        runtime.control.set_cancel = real_set_cancel  # type: ignore[method-assign]
    assert ran == [1]  # the race was made
    rec = await runtime.tracker.get(r.message_id)
    assert rec.status == MessageStatus.SUCCEEDED, rec.description
    assert await app.result(r.tracking_id, timeout=5) == {"price": 40}
    runtime.control.invalidate()
    assert r.message_id not in (await runtime.control.state()).cancelled  # the request went


async def test_two_cancels_at_once_both_leave_the_request_standing(runtime: Runtime):
    """Both cancels read the message waiting; the second's write finds the first's record. A first
    version took that record for a finished message and withdrew the request both share (a review of
    the change found it): the first was told "cancelled" and the message ran."""
    import asyncio

    app = runtime.app
    r = await app.enqueue(Quote(n=6))
    real_set_cancel = runtime.control.set_cancel
    requested: list[bool] = []
    both = asyncio.Event()

    async def both_have_read(message_id, requested_now, now):
        if requested_now:
            requested.append(True)
            if len(requested) == 2:
                both.set()
            await asyncio.wait_for(both.wait(), 10)
        await real_set_cancel(message_id, requested_now, now)

    runtime.control.set_cancel = both_have_read  # type: ignore[method-assign]
    try:
        receipts = await asyncio.gather(app.cancel(r.tracking_id), app.cancel(r.tracking_id))
    finally:
        runtime.control.set_cancel = real_set_cancel  # type: ignore[method-assign]
    assert [x.status for x in receipts] == [MessageStatus.CANCELLED] * 2
    runtime.control.invalidate()
    assert r.message_id in (await runtime.control.state()).cancelled
    ran = await run_until_idle(runtime)  # the host that receives it settles it unrun
    assert ran == 1
    rec = await runtime.tracker.get(r.message_id)
    assert rec.status == MessageStatus.CANCELLED
    assert rec.result is None


async def test_a_cancel_with_nothing_in_between_is_recorded_as_requested(runtime: Runtime):
    """The control: the same cancel, no host in between, marks the history as requested."""
    app = runtime.app
    r = await app.enqueue(Quote(n=5))
    receipt = await app.cancel(r.tracking_id)
    assert receipt.status == MessageStatus.CANCELLED
    rec = await runtime.tracker.get(r.message_id)
    assert rec.status == MessageStatus.CANCELLED
    await run_until_idle(runtime)  # the host that receives it settles it without running it
    assert (await runtime.tracker.get(r.message_id)).status == MessageStatus.CANCELLED


T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _record(status: str, at: datetime, message_id: uuid.UUID) -> MessageRecord:
    return MessageRecord(
        message_id=message_id,
        tracking_id=message_id,
        type="Quote",
        queue="review.cancel-race",
        status=status,
        attempt=0,
        created_at=T0,
        updated_at=at,
        headers={},
        body={"n": 1},
    )


async def test_the_side_history_writes_a_change_only_over_the_record_it_read(sql_db):
    """``change_if_unchanged`` of the history SQL keeps beside RabbitMQ and SQS (the in-process and
    Tables histories are held to it above), on SQLite and PostgreSQL (times read back to the
    microsecond compare equal)."""
    stores = SideStores(sql_db.url, schema=sql_db.schema)
    tracker = stores.history
    try:
        mid = uuid.uuid4()
        await tracker.upsert([_record("Pending", T0 + timedelta(microseconds=123457), mid)])
        seen = await tracker.get(mid)
        await tracker.upsert([_record("Succeeded", T0 + timedelta(seconds=1), mid)])  # a host's outcome
        change = {"status": "Cancelled", "updated_at": T0 + timedelta(seconds=2)}
        assert not await tracker.change_if_unchanged(seen, change)
        assert (await tracker.get(mid)).status == "Succeeded"
        now = await tracker.get(mid)
        assert await tracker.change_if_unchanged(now, change)
        assert (await tracker.get(mid)).status == "Cancelled"
    finally:
        await stores.close()


def _outcome(status: str, at: datetime, message_id: uuid.UUID) -> MessageRecord:
    """A run's record of an outcome (a reason, an error, or a result: not a producer's record)."""
    if status == "Succeeded":
        return _record(status, at, message_id).model_copy(update={"attempt": 1, "result": {"price": 10}})
    return _record(status, at, message_id).model_copy(
        update={"attempt": 1, "reason": "NonRetryable", "last_error": "refused", "description": "refused"}
    )


async def _late_outcome_after_a_request(tracker, status: str) -> tuple[MessageRecord, MessageRecord]:
    """A host settles the message at T+5 and its record waits (a store outage, a journal taken over
    after a crash); the operator, reading the producer's record, cancels at T+10; then the host's
    record lands, by the late write's rule. Returns the record after the late write, and after a
    progress report of T+3 (a run's, which says nothing final) that lands later still."""
    from queueing_core.tracking.base import CANCEL_REQUESTED

    mid = uuid.uuid4()
    await tracker.upsert([_record("Pending", T0, mid)])
    seen = await tracker.get(mid)
    request = {
        "status": "Cancelled",
        "description": CANCEL_REQUESTED,
        "updated_at": T0 + timedelta(seconds=10),
    }
    assert await tracker.change_if_unchanged(seen, request)
    await tracker.upsert_newer([_outcome(status, T0 + timedelta(seconds=5), mid)])
    after = await tracker.get(mid)
    progress = _record("Leased", T0 + timedelta(seconds=3), mid)
    await tracker.upsert_newer([progress])
    return after, await tracker.get(mid)


@pytest.mark.parametrize("status", ["Succeeded", "DeadLettered"])
async def test_an_outcome_that_lands_after_a_cancel_request_replaces_the_request(runtime: Runtime, status):
    """A review found the request kept over an outcome settled before it and written late (older by
    the hosts' clocks): ``result()`` waited for ever for a settlement that had happened, and a dead
    letter's history, Cancelled, was pruned while the letter stayed (retention keeps dead letters'
    history only). The request reached no host: the outcome stands. A progress report that lands
    later still does not replace it."""
    after, later = await _late_outcome_after_a_request(runtime.tracker, status)
    assert after.status == status, after.description
    assert later.status == status


@pytest.mark.parametrize("status", ["Succeeded", "DeadLettered"])
async def test_the_side_history_lets_a_late_outcome_replace_a_cancel_request(sql_db, status):
    """The same on the history SQL keeps beside RabbitMQ and SQS (SQLite and PostgreSQL)."""
    stores = SideStores(sql_db.url, schema=sql_db.schema)
    try:
        after, later = await _late_outcome_after_a_request(stores.history, status)
        assert after.status == status, after.description
        assert later.status == status
    finally:
        await stores.close()
