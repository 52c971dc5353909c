"""A purge by status takes the delayed store's copy of a message waiting for its recheck: a message
whose type has no handler (or a paused type's, received as the pause began) waits there as a row
between rechecks (on RabbitMQ and SQS). The purge took only the rows of failed and sleeping messages:
it answered ``left_waiting 1``, and the message kept coming back (found in review)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from queueing_core import MessageStatus, QueueMessage, queue
from queueing_core.ops.service import OpsService
from queueing_core.providers.side_stores import SideStoreOps
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until

#: no recheck forwards the row while the test looks at it, and beyond SQS's own 15 minutes of delay
LONG = timedelta(hours=1)


@queue("purge_recheck")
class Orphan(QueueMessage):
    n: int


async def test_a_purge_by_status_takes_the_row_a_recheck_waits_in(harness):
    app = harness.app()
    app.message(Orphan)  # registered, no handler: its messages wait for one
    state = MessageStatus.WAITING_FOR_HANDLER
    rt = await harness.runtime(app, waiting_recheck=LONG)
    try:
        prov = rt.provider
        if not isinstance(prov, SideStoreOps):
            pytest.skip("no delayed store: the transport holds a recheck's wait itself")
        sent = await app.enqueue(Orphan(n=1))

        async def stored() -> bool:
            rec = await rt.tracker.get(sent.message_id)
            return rec is not None and rec.status == state and await prov.delayed.holds(sent.message_id)

        async with running(rt):
            await wait_until(stored, what=f"{state.value} in the delayed store")
        done = await OpsService(rt).purge(MessageQuery(queue="purge_recheck", status=(state.value,)))
        assert (done.deleted, done.left_waiting) == (1, 0), done
        assert not await prov.delayed.holds(sent.message_id)
        assert await rt.tracker.get(sent.message_id) is None
    finally:
        await rt.close()
