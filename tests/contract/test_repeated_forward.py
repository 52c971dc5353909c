"""A delayed message forwarded again after its dispatcher died (marked ``queueing-repeated-forward``)
is completed without running when the message's outcome is already recorded, and counted in its
history; one whose outcome is not recorded yet runs, since its first forward may never have arrived."""

from __future__ import annotations

import pytest

from queueing_core import MessageStatus, QueueMessage, queue
from queueing_core.envelope import REPEATED_FORWARD

from .harness import record, running, wait_until


@queue("forwards")
class Job(QueueMessage):
    n: int


async def test_a_forward_repeated_after_its_outcome_was_recorded_is_completed_without_running(harness):
    if harness.name in ("sqlite", "postgres"):
        pytest.skip("SQL rows are keyed by message id and hold their own delays: no second forward exists")
    app = harness.app()
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Job) -> None:
        runs.append(msg.n)

    rt = await harness.runtime(app)
    try:
        first = rt.producer.envelope_for(Job(n=1))
        await rt.producer.send_prepared(await rt.producer.prepare([first]))
        async with running(rt):

            async def succeeded() -> bool:
                rec = await rt.tracker.get(first.message_id)
                return rec is not None and rec.status == MessageStatus.SUCCEEDED

            await wait_until(succeeded, timeout=30, what="the first forward run")
            # what a dispatcher that died before removing the row sends again: the same envelope, marked
            again = first.model_copy(update={"headers": {**first.headers, REPEATED_FORWARD: "1"}})
            # and one whose first forward never arrived: nothing recorded, so it must run
            unseen = rt.producer.envelope_for(Job(n=2))
            unseen = unseen.model_copy(update={"headers": {**unseen.headers, REPEATED_FORWARD: "1"}})
            await rt.provider.send([again, unseen])

            async def counted() -> bool:
                rec = await rt.tracker.get(first.message_id)
                return rec is not None and rec.duplicates == 1 and 2 in runs

            await wait_until(counted, timeout=30, what="the duplicate counted and the unseen one run")
        assert sorted(runs) == [1, 2]  # the repeated forward of message 1 did not run its handler
        rec = await record(rt, first.message_id)
        assert rec.status == MessageStatus.SUCCEEDED
        assert rec.attempt == 1
    finally:
        await rt.close()
