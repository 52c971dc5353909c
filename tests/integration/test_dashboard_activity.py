"""What the dashboard's charts draw, from the SQL store (SQLite and PostgreSQL): messages settled per
slot, succeeded apart from the rest, the time from enqueue to settlement, the oldest due message."""

from __future__ import annotations

from datetime import timedelta

from queueing_core import NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.runtime import Runtime
from queueing_core.tracking import ActivitySource
from tests.contract.harness import running, wait_until


@queue("act-work")
class Work(QueueMessage):
    n: int


@queue("act-held")
class Held(QueueMessage):
    n: int


def build() -> QueueingApp:
    app = QueueingApp("activity-tests")

    @app.handler()
    async def work(msg: Work) -> None:
        if msg.n % 4 == 0:
            raise NonRetryableError("every fourth fails")

    app.message(Held)  # no handler here: its messages wait
    return app


async def test_activity_counts_settled_messages_per_slot_and_the_oldest_due(sql_db):
    rt = Runtime(build(), sql_db.provider())
    await rt.open()
    try:
        tracker = rt.tracker
        assert isinstance(tracker, ActivitySource)
        before = utcnow()
        await rt.producer.enqueue_many([Held(n=i) for i in range(2)])
        await rt.producer.enqueue_many([Work(n=i) for i in range(12)])
        async with running(rt):

            async def all_settled() -> bool:
                counts = await tracker.counts()
                done = counts.get(("act-work", "Succeeded"), 0) + counts.get(("act-work", "DeadLettered"), 0)
                return done == 12

            await wait_until(all_settled, timeout=60, what="12 settled")
        now = utcnow()
        since = now - timedelta(hours=1)
        activity = await tracker.activity(["act-work", "act-held"], since, 300, 12, now)
        assert sum(activity.succeeded["act-work"]) == 9
        assert sum(activity.failed["act-work"]) == 3
        assert activity.succeeded["act-work"][-1] == 9  # all within the last five minutes
        latency = activity.latency["act-work"][-1]
        assert latency is not None
        assert 0 <= latency < (now - before).total_seconds() + 1
        assert activity.latency["act-work"][:-1] == [None] * 11
        assert "act-held" not in activity.succeeded
        assert before - timedelta(seconds=1) <= activity.oldest_due["act-held"] <= now
        assert "act-work" not in activity.oldest_due
        # a window that ended before anything settled sees nothing
        empty = await tracker.activity(["act-work"], since - timedelta(hours=1), 300, 12, since)
        assert empty.succeeded == {}
        assert empty.failed == {}
    finally:
        await rt.close()
