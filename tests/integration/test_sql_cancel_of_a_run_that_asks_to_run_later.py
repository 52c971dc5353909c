"""A message cancelled while it runs on SQL ends Cancelled even when its run ends by asking to run later.

A cancel of a running (leased) message only writes a request, kept a day; the worker's cancel watcher
tells the run. A run that ended before it heard, with a retry or a "run me again later" (a returned
datetime), was settled waiting as asked: a delay longer than the day outlived the request, and the
cancelled job ran again (found by a review). The settlement of a run that leaves its message waiting
(a retry, a delay, a release) now finds a standing request in the same statement and settles the
message Cancelled instead; still fenced by the run's lease, so a stale run changes nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from queueing_core import HandlerContext, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Release, RetryAfter
from queueing_core.errors import Retry
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.transport import Settlement

START = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


@queue("cancel-run-later", expiration=None)
class Poll(QueueMessage):
    key: str


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now


@pytest.mark.parametrize("ending", ["returns a later time", "raises Retry"])
async def test_a_run_cancelled_while_it_runs_does_not_run_again_days_later(sql_db, ending) -> None:
    clock = Clock()
    app = QueueingApp("cancel-run-later")
    runs: list[str] = []
    receipts = []

    @app.handler()
    async def poll(msg: Poll, ctx: HandlerContext) -> datetime:
        runs.append(msg.key)
        if len(runs) == 1:
            # a user cancels the job while this run is in flight; the run ends before it hears
            receipts.append(await app.cancel(ctx.envelope.tracking_id))
        if ending == "raises Retry":
            raise Retry(timedelta(days=2), "downstream busy")
        return clock() + timedelta(days=2)

    # (no LISTEN: on PostgreSQL the NOTIFY of the request would reach the run before it ends, and the
    # run would be told; here it ends first, as a run does that the worker's watcher has not told yet)
    rt = app.use(sql_db.provider(clock=clock, listen=False), clock=clock)
    async with rt:
        sent = await app.enqueue(Poll(key="p", created_at=clock()))
        await run_until_idle(rt, raise_errors=False)
        assert len(receipts) == 1
        assert receipts[0].status == MessageStatus.LEASED  # only requested
        after_run = (await app.status(sent.tracking_id)).status
        clock.now += timedelta(days=2, minutes=1)  # the request would have lapsed by now
        await run_until_idle(rt, raise_errors=False)
        final = await app.status(sent.tracking_id)
    assert runs == ["p"], f"the cancelled job ran again: after its run {after_run}, finally {final.status}"
    assert after_run == MessageStatus.CANCELLED
    assert final.status == MessageStatus.CANCELLED


async def _claimed(sql_db, clock: Clock, **kw) -> tuple[QueueingApp, SqlProvider, Runtime]:
    app = QueueingApp("cancel-run-later")

    @app.handler()
    async def poll(msg: Poll) -> None:
        return None

    provider = sql_db.provider(clock=clock, **kw)
    rt = Runtime(app, provider, clock=clock)
    await rt.open()
    await app.enqueue(Poll(key="p", created_at=clock()))
    return app, provider, rt


def _row(sql_db, provider: SqlProvider) -> sa.Row[tuple[str, datetime | None]]:
    m = provider.tables.messages
    engine = sql_db.sync_engine()
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(m.c.status, m.c.settled_at).order_by(m.c.id).limit(1)).one()
    finally:
        engine.dispose()


def _status(sql_db, provider: SqlProvider) -> str:
    return str(_row(sql_db, provider).status)


@pytest.mark.parametrize(
    "outcome", [RetryAfter(timedelta(days=2), "busy"), Release("host stopping")], ids=["retry", "release"]
)
async def test_a_settlement_that_leaves_the_message_waiting_settles_a_requested_cancel(
    sql_db, outcome
) -> None:
    clock = Clock()
    app, provider, rt = await _claimed(sql_db, clock)
    try:
        [run] = await provider.receive(app.subscription("Poll"), 1)
        await rt.control.set_cancel(run.envelope.message_id, True, clock())
        await provider.settle([Settlement(run, outcome)])
        row = _row(sql_db, provider)
        assert row.status == MessageStatus.CANCELLED.value
        assert row.settled_at is not None  # final: archived and pruned with the other final rows
        # and the same settlement with no request standing leaves it waiting, as asked
        await app.enqueue(Poll(key="q", created_at=clock()))
        [other] = await provider.receive(app.subscription("Poll"), 1)
        await provider.settle([Settlement(other, outcome)])
        assert (await rt.tracker.get(other.envelope.message_id)).status == outcome.status.value
    finally:
        await rt.close()


async def test_a_lapsed_request_does_not_cancel(sql_db) -> None:
    """A request older than a day is not one any host honours (the control state leaves it out)."""
    clock = Clock()
    app, provider, rt = await _claimed(sql_db, clock)
    try:
        [run] = await provider.receive(app.subscription("Poll"), 1)
        await rt.control.set_cancel(run.envelope.message_id, True, clock() - timedelta(days=1, minutes=1))
        await provider.settle([Settlement(run, RetryAfter(timedelta(seconds=5), "busy"))])
        assert _status(sql_db, provider) == MessageStatus.FAILED.value
    finally:
        await rt.close()


async def test_a_stale_run_with_a_request_standing_changes_nothing(sql_db) -> None:
    """The settlement stays fenced by the run's lease: a run whose message was taken back and claimed
    again neither settles it Cancelled nor waiting; the run that holds it now decides."""
    clock = Clock()
    app, provider, rt = await _claimed(sql_db, clock)
    try:
        sub = app.subscription("Poll")
        [stale] = await provider.receive(sub, 1)
        await provider.settle([Settlement(stale, Release("host stopping"))])
        [current] = await provider.receive(sub, 1)
        await rt.control.set_cancel(stale.envelope.message_id, True, clock())
        await provider.settle([Settlement(stale, RetryAfter(timedelta(days=2), "busy"))])
        assert _status(sql_db, provider) == MessageStatus.LEASED.value
        await provider.settle([Settlement(current, RetryAfter(timedelta(days=2), "busy"))])
        assert _status(sql_db, provider) == MessageStatus.CANCELLED.value
    finally:
        await rt.close()


async def test_sqlalchemys_path_settles_a_requested_cancel_too(tmp_path) -> None:
    """A provider on an engine of the caller's settles without the hot path: the same statements."""
    from sqlalchemy.ext.asyncio import create_async_engine

    clock = Clock()
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/q.db")
    app = QueueingApp("cancel-run-later")

    @app.handler()
    async def poll(msg: Poll) -> None:
        return None

    provider = SqlProvider(f"sqlite:///{tmp_path}/q.db", engine=engine, clock=clock)
    rt = Runtime(app, provider, clock=clock)
    await rt.open()
    try:
        assert provider._hot is None
        sent = await app.enqueue(Poll(key="p", created_at=clock()))
        [run] = await provider.receive(app.subscription("Poll"), 1)
        await rt.control.set_cancel(sent.message_id, True, clock())
        await provider.settle([Settlement(run, RetryAfter(timedelta(days=2), "busy"))])
        assert (await rt.tracker.get(sent.message_id)).status == MessageStatus.CANCELLED.value
    finally:
        await rt.close()
        await engine.dispose()
