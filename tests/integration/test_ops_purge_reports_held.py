"""A purge on a transport whose history is kept beside it says how many messages it left to the
workers holding them.

The SQL purge leaves a message a worker holds and counts it (``skipped_leased``). The other transports
left such messages too (a held message cannot be taken from its holder) but answered
``skipped_leased: 0``, so the dashboard said only "Deleted N" (a review found it)."""

from __future__ import annotations

import asyncio

from queueing_core import HandlerContext, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.ops.service import OpsService
from queueing_core.testing import in_process
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until


@queue("review.purge-held", max_concurrency=1)
class Crunch(QueueMessage):
    n: int


async def test_a_purge_counts_the_messages_a_worker_holds_that_it_left():
    app = QueueingApp("review-purge-held")
    started, release = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def crunch(msg: Crunch, ctx: HandlerContext) -> None:
        # its progress report is the record that says a worker holds it (these transports' history
        # does not hear of a receive)
        await ctx.report_progress(1, 2, "crunching")
        started.set()
        await release.wait()

    rt = in_process(app)
    await rt.open()
    try:
        held = await app.enqueue(Crunch(n=1))
        async with running(rt):
            await asyncio.wait_for(started.wait(), 30)

            async def leased() -> bool:
                rec = await rt.tracker.get(held.message_id)
                return rec is not None and rec.status == MessageStatus.LEASED

            await wait_until(leased, what="the running message's record")
            waiting = [await app.enqueue(Crunch(n=n)) for n in (2, 3)]  # behind the one slot
            done = await OpsService(rt).purge(MessageQuery(queue="review.purge-held"))
            assert (done.deleted, done.skipped_leased) == (2, 1)
            assert all([await rt.tracker.get(r.message_id) is None for r in waiting])
            release.set()
            await wait_until(
                lambda: _status_is(rt, held.message_id, MessageStatus.SUCCEEDED), what="the held one"
            )
    finally:
        await rt.close()


async def _status_is(rt, message_id, status) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == status
