"""The worker's side of ``receives_in_flight="auto"``: when it asks whether another worker holds leases,
what it makes of an answer that is out of date, of a question left unanswered, and of a failing one;
and where a second claim can start at all."""

from __future__ import annotations

import asyncio
import logging

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker


@queue("alone")
class Job(QueueMessage):
    n: int


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class Answers(InProcessProvider):
    """An in-process provider that can tell whether it claims alone: ``answers`` in turn (an exception
    is raised; ``None`` never answers)."""

    def __init__(self, *answers: bool | Exception | None) -> None:
        super().__init__()
        self.answers = list(answers)
        self.asked = 0

    async def sole_claimer(self) -> bool:
        self.asked += 1
        answer = self.answers.pop(0)
        if answer is None:
            await asyncio.Event().wait()
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)


def worker(provider: InProcessProvider, monkeypatch: pytest.MonkeyPatch) -> tuple[Worker, Clock, object]:
    app = QueueingApp("alone")

    @app.handler(max_concurrency=10)
    async def handle(msg: Job) -> None:
        return None

    w = Worker(Runtime(app, provider), prefetch=2, batch_size=10)
    clock = Clock()
    monkeypatch.setattr("queueing_core.worker.time", clock)
    sub = app.subscription("Job")
    w._backlogged.add(sub.type_name)
    return w, clock, sub


async def answered(w: Worker) -> None:
    assert w._asking is not None
    await w._asking


async def test_an_answer_out_of_date_is_not_a_no(monkeypatch):
    """After a quiet spell the last answer is old: the worker asks again and does not know meanwhile
    (None: the queue's decision stays), rather than taking it for "not alone", which would drop a
    choice of two claims at the start of every burst."""
    w, clock, sub = worker(Answers(True, True), monkeypatch)
    assert w._alone(sub) is None  # never asked: asks now
    await answered(w)
    assert w._alone(sub) is True
    clock.now += 10  # a quiet spell: nothing asked meanwhile
    assert w._alone(sub) is None  # asked again; not a "no"
    await answered(w)
    assert w._alone(sub) is True
    assert w.runtime.provider.asked == 2


async def test_a_question_unanswered_for_long_is_a_no(monkeypatch):
    w, clock, sub = worker(Answers(True, None), monkeypatch)
    w._alone(sub)
    await answered(w)
    clock.now += 1.5
    assert w._alone(sub) is True  # (the answer, 1.5 s old, still stands; a new question is on its way)
    await asyncio.sleep(0)  # (it starts, and never answers)
    clock.now += 3
    assert w._alone(sub) is False
    assert w.runtime.provider.asked == 2  # (no second question beside the one unanswered)
    w._asking.cancel()


async def test_another_backlogged_queue_is_a_no_whatever_the_database_says(monkeypatch):
    w, _, sub = worker(Answers(True), monkeypatch)
    w._alone(sub)
    await answered(w)
    w._backlogged.add("Other")
    assert w._alone(sub) is False
    w._backlogged.discard("Other")
    assert w._alone(sub) is True


async def test_a_failing_question_is_a_no_and_is_logged_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="queueing.worker")
    w, clock, sub = worker(Answers(OSError("down"), OSError("down"), True), monkeypatch)
    for _ in range(2):
        w._alone(sub)
        await answered(w)
        assert w._alone(sub) is False
        clock.now += 1.5
    assert len([r for r in caplog.records if "could not tell" in r.getMessage()]) == 1
    w._alone(sub)
    await answered(w)
    assert w._alone(sub) is True


def test_a_second_claim_can_start_wherever_the_capacity_holds_two_refills():
    """The consumer claims again once its free slots reach the refill threshold, so a second claim can
    start while the first is out exactly when the capacity holds two thresholds: one slot never does;
    the defaults' claims of 100 on a few slots do (claims of half the slots each)."""
    for concurrency, prefetch, batch, fits in [
        (1, 1, 100, False),  # one slot: the first claim takes it
        (2, 1, 100, True),  # claims of one, two of them
        (4, 1, 100, True),  # the defaults' batch on a few slots: claims of half the slots
        (10, 2, 10, True),  # the benchmarks' shape: claims of 10 for 20 slots
        (3, 1, 2, True),
        (1, 1, 1, False),
        (15, 1, 10, True),  # refills at 7 free slots: 15 hold two
    ]:
        app = QueueingApp("fit")

        @queue("fit")
        class Fit(QueueMessage):
            n: int

        app.handler(Fit, max_concurrency=concurrency)(lambda msg: None)
        w = Worker(Runtime(app, InProcessProvider()), prefetch=prefetch, batch_size=batch)
        assert w._two_fit(app.subscription("Fit")) is fits, (concurrency, prefetch, batch)
