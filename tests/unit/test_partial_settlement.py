"""A batch settled message by message where only some fail: the batch is not retried as a whole, and
the ones that failed are treated as not applied (they come back when their lease lapses), so their
outcome is never recorded as if it had been."""

from __future__ import annotations

import pytest

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.testing import in_memory_servicebus
from queueing_core.transport import Delivery, Settlement, settled_each


@queue("partial/jobs", max_attempts=1)
class Job(QueueMessage):
    n: int


def _settlement(n: int) -> Settlement:
    return Settlement(Delivery.of(b"{}", queue="q"), Complete(result=n))


def test_all_failed_raises_for_a_retry_and_some_failed_marks_only_those():
    both = [_settlement(1), _settlement(2)]
    with pytest.raises(ConnectionError):
        settled_each(both, [ConnectionError("down"), ConnectionError("down")], "test")
    assert not any(s.delivery.refused for s in both)  # the caller retries them all
    settled_each(both, [None, ConnectionError("down")], "test")
    assert [s.delivery.refused for s in both] == [False, True]


async def test_a_dead_letter_that_failed_in_a_batch_is_not_recorded_as_dead_lettered():
    app = QueueingApp("partial")

    @app.handler()
    async def handle(msg: Job) -> None:
        raise NonRetryableError(f"job {msg.n} refused")

    rt = in_memory_servicebus(app, provider_options={"receive_wait": 0.1})
    await rt.open()
    try:
        receipts = await app.enqueue_many([Job(n=1), Job(n=2)])
        sub = app.subscription(receipts[0].type)
        deliveries = await rt.provider.receive(sub, 10)
        assert len(deliveries) == 2
        settlements = [await rt.process(d) for d in deliveries]
        real = rt.provider._settle_one
        failing = deliveries[1].envelope.message_id

        async def second_fails(s: Settlement) -> None:
            if s.delivery.envelope.message_id == failing:
                raise ConnectionError("the dead-letter call timed out")
            await real(s)

        rt.provider._settle_one = second_fails
        ahead = rt.history_ahead(settlements)
        await rt.provider.settle(settlements)  # one applied, one not: no exception
        rt.history_applied(settlements, ahead)
        await rt.record(settlements, ahead)
        by_id = {r.message_id: (await rt.tracker.get(r.message_id)).status for r in receipts}
        applied = deliveries[0].envelope.message_id
        assert by_id[applied] == MessageStatus.DEAD_LETTERED
        assert by_id[failing] != MessageStatus.DEAD_LETTERED  # still on its queue: not claimed otherwise
    finally:
        await rt.close()
