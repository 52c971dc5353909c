"""One settlement whose history record cannot be made does not end the worker's settler.

Found by a review: a retry's due time before the year 1 (the pipeline bounds a retry's delay now, but a
decision can still hold a value no record holds) made the settler's journal of a batch raise, which
ended the settler's task: nothing more was settled on that worker, every lease was renewed until the
stop, and the stop raised the error. The settlements whose records can be made are settled; the one
that cannot is left to its lease, which lapses, and the message is delivered again (never lost)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from queueing_core import Complete, MessageStatus, QueueingApp, QueueMessage, RetryAfter, queue
from queueing_core.testing import in_memory_servicebus
from queueing_core.transport import Settlement
from queueing_core.worker import Settler


@queue("settler-bad", lease_duration=timedelta(seconds=1), max_attempts=5)
class Job(QueueMessage):
    n: int


async def _setup(n: int) -> tuple[Any, Any, list[Any]]:
    app = QueueingApp("settler-bad")

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    rt = in_memory_servicebus(app)
    await rt.open()
    for i in range(n):
        await app.enqueue(Job(n=i))
    sub = app.subscription("Job")
    got = await rt.provider.receive(sub, n)
    assert len(got) == n
    return rt, sub, got


#: a decision no history record holds: due before the year 1
UNRECORDABLE = RetryAfter(timedelta.min, "a delay no timestamp holds")


async def test_the_settler_settles_the_rest_and_leaves_the_bad_one_to_its_lease() -> None:
    rt, sub, (bad, good1, good2) = await _setup(3)
    released: list[Any] = []  # what the worker stops renewing
    settler = Settler(rt, on_settled=released.extend)
    settler.start()
    try:
        # (one batch: the linger lets all three share one flush)
        for s in (
            Settlement(good1, Complete()),
            Settlement(bad, UNRECORDABLE),
            Settlement(good2, Complete()),
        ):
            settler.add(s)
        for _ in range(200):
            if len(released) == 3:
                break
            await asyncio.sleep(0.01)
        assert settler._task is not None
        alive = not settler._task.done()
        settler.add(Settlement(bad, UNRECORDABLE))  # and again, alone in its batch
        await asyncio.sleep(0.1)
        alive_after = not settler._task.done()
    finally:
        await settler.close()  # (raised the settler's OverflowError)
    assert alive
    assert alive_after
    # the bad one too is no longer renewed: its lease lapses
    assert {id(s.delivery) for s in released} == {id(bad), id(good1), id(good2)}
    for d in (good1, good2):
        rec = await rt.tracker.get(d.envelope.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.SUCCEEDED.value
    # never lost: not settled, it is delivered again once its lock lapses
    await asyncio.sleep(1.2)
    again = await rt.provider.receive(sub, 3)
    assert [d.envelope.message_id for d in again] == [bad.envelope.message_id]
    assert again[0].attempt == 2


async def test_a_failed_history_write_does_not_end_the_recorder(monkeypatch) -> None:
    rt, _, (first, second) = await _setup(2)
    real = rt.record
    failures: list[int] = []

    async def fails_once(chunk: Any, ahead: Any = None) -> None:
        if not failures:
            failures.append(len(chunk))
            raise RuntimeError("history store refused the write")
        await real(chunk, ahead)

    monkeypatch.setattr(rt, "record", fails_once)
    settler = Settler(rt)
    settler.start()
    try:
        settler.add(Settlement(first, Complete()))
        await asyncio.sleep(0.1)
        settler.add(Settlement(second, Complete()))
        await asyncio.sleep(0.1)
    finally:
        await settler.close()  # (raised the recorder's error)
    assert failures == [1]
    rec = await rt.tracker.get(second.envelope.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED.value  # the recorder went on


async def test_a_fault_after_the_store_settled_does_not_end_the_settler(monkeypatch) -> None:
    """Whatever else fails in the settler's own handling of a batch (here its journal's update once the
    store has settled it): the batch is no longer renewed, and the settler goes on."""
    rt, _, (first, second) = await _setup(2)
    real = rt.history_applied
    failures: list[int] = []

    def fails_once(chunk: Any, ahead: Any) -> None:
        if not failures:
            failures.append(len(chunk))
            raise RuntimeError("journal update failed")
        real(chunk, ahead)

    monkeypatch.setattr(rt, "history_applied", fails_once)
    released: list[Any] = []
    settler = Settler(rt, on_settled=released.extend)
    settler.start()
    try:
        settler.add(Settlement(first, Complete()))
        await asyncio.sleep(0.1)
        settler.add(Settlement(second, Complete()))
        await asyncio.sleep(0.1)
        assert settler._task is not None
        alive = not settler._task.done()
    finally:
        await settler.close()  # (raised the error)
    assert failures == [1]
    assert alive
    assert [id(s.delivery) for s in released] == [id(first), id(second)]
    # both outcomes recorded: the first's too, which the store applied before the fault (it is not
    # delivered again, so a history left without it waited for ever)
    for settled in (first, second):
        rec = await rt.tracker.get(settled.envelope.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.SUCCEEDED.value
