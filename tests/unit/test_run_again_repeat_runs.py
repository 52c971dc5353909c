"""A repeated forward of a message that asks to run again runs when its history says Sleeping from a
record written ahead of a settlement that never happened: a worker ran the copy, asked to run again,
journaled that record, and died before the next copy was stored; the journal's heir wrote the record.
The returned copy is then the message's only copy. Skipping repeats on a run's Sleeping record (tried,
for chains that forked after a lost confirm) completed it unrun, and the message was lost (review)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import REPEATED_FORWARD
from queueing_core.pipeline import run_again
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime, history_record
from queueing_core.tracking import MemoryTracker
from queueing_core.tracking.backlog import Journal
from queueing_core.transport import Delivery, Settlement


@queue("run-again-ticks")
class RunAgainTick(QueueMessage):
    n: int


async def test_a_marked_copy_whose_run_never_settled_runs(tmp_path: Path) -> None:
    app = QueueingApp("run-again-repeat")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: RunAgainTick):
        runs.append(msg.n)
        return utcnow() + timedelta(hours=1)

    tracker = MemoryTracker()
    rt = Runtime(app, InProcessProvider(), tracker=tracker)
    async with rt:
        [sub] = app.subscriptions()
        now = utcnow()
        # a copy an earlier run made, marked (every later copy of a chain forwarded twice keeps the mark)
        env = rt.producer.envelope_for(RunAgainTick(n=1))
        env = env.model_copy(
            update={
                "attempt": 0,
                "expires_at": now + sub.options.expiration,
                "headers": {**env.headers, REPEATED_FORWARD: "1"},
            }
        )
        earlier = Delivery.of(env.encode(), queue=env.queue)
        made = history_record(
            Settlement(earlier, run_again(sub, now, now - timedelta(seconds=5))), now - timedelta(seconds=5)
        )
        await tracker.upsert([made.model_copy(update={"expires_at": env.expires_at})])
        # a worker runs it, asks to run again, journals that ahead of the settlement and dies
        ran = Delivery.of(env.encode(), queue=env.queue)
        ahead = history_record(
            Settlement(ran, run_again(sub, now + timedelta(hours=1), now + timedelta(seconds=1))),
            now + timedelta(seconds=1),
        )
        dying = Journal(tmp_path / "journal.sqlite3")
        dying.add([ahead], settled=False)
        dying.close()
        heir = Journal(tmp_path / "journal.sqlite3")
        await tracker.upsert_newer([r for _, r in heir.take_over(unsettled_after=0.0)])
        heir.close()
        record = await tracker.get(env.message_id)
        assert record is not None
        assert record.expires_at > env.expires_at  # what a run that asked to run again records
        # the copy comes back (never settled): the message's only copy
        back = Delivery.of(env.encode(), queue=env.queue)
        await rt.process(back)
    assert runs == [1]
    assert not back.duplicate
