"""What ``Retry(after=...)`` takes, and a retry's delay as the pipeline decides it.

Found by a review: ``after`` was kept as given. A time to run at (a ``datetime``), text or a
``Decimal`` failed the pipeline's own handling of the retry, which handed the message back uncounted,
every 10 s for ever; a delay far in the past (``Retry(after=-1e11)``, ``timedelta.min``, a policy with
a negative cap) made a due time no timestamp holds, which ended the worker's settler: nothing more was
settled on that worker. ``Retry`` now refuses what is not a delay (raised in a handler, that is a failed
attempt like any error), and a retry waits between no time and a thousand years."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from pydantic import ValidationError

from queueing_core import (
    DeadLetter,
    DeadLetterReason,
    QueueingApp,
    QueueMessage,
    Retry,
    RetryAfter,
    RetryPolicy,
    queue,
)
from queueing_core.control import MemoryControlStore
from queueing_core.decisions import Decision
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.runtime import history_record
from queueing_core.testing import in_memory_servicebus
from queueing_core.transport import Capabilities, Delivery, Settlement
from queueing_core.worker import Worker

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("after", "delay"),
    [
        (None, None),
        (timedelta(minutes=2), timedelta(minutes=2)),
        (5, timedelta(seconds=5)),
        (0.25, timedelta(seconds=0.25)),
        (-30, timedelta(seconds=-30)),  # (retries at once: see below)
        (1e300, timedelta.max),  # past what a timedelta holds: as long as one can be
        (-1e300, timedelta.min),
    ],
)
def test_retry_takes_a_timedelta_or_seconds(after: timedelta | float | None, delay: timedelta | None) -> None:
    assert Retry(after=after).after == delay


@pytest.mark.parametrize(
    ("after", "error"),
    [
        (datetime(2030, 1, 1, tzinfo=UTC), TypeError),  # a time to run at, not a delay
        ("5", TypeError),
        (Decimal("5"), TypeError),
        (True, TypeError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
    ],
)
def test_retry_refuses_what_is_not_a_delay(after: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"Retry\(after=\.\.\.\)"):
        Retry(after=after)  # type: ignore[arg-type]
    later = Retry()
    with pytest.raises(error):  # (nor set afterwards)
        later.after = after  # type: ignore[assignment]


class _NullProvider:
    capabilities = Capabilities()


@queue("retry-values", max_attempts=2, retry=RetryPolicy(base=timedelta(seconds=3), jitter=0))
class Job(QueueMessage):
    after: str


AFTER = {
    "a datetime": lambda: datetime.now(UTC) + timedelta(minutes=1),
    "text": lambda: "5",
    "a Decimal": lambda: Decimal("5"),
    "-1e11 seconds": lambda: -1e11,
    "timedelta.min": lambda: timedelta.min,
    "-30 seconds": lambda: -30,
}


def _pipeline(app: QueueingApp) -> tuple[Pipeline, Producer]:
    clock = lambda: T0  # noqa: E731
    return Pipeline(app, MemoryControlStore(), clock=clock), Producer(app, _NullProvider(), clock=clock)


async def _decide(
    pipe: Pipeline, prod: Producer, msg: QueueMessage, attempt: int
) -> tuple[Delivery, Decision]:
    env = prod.envelope_for(msg)
    d = Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=attempt)
    return d, await pipe.process(d)


@pytest.mark.parametrize("after", ["a datetime", "text", "a Decimal"])
async def test_a_retry_after_what_is_not_a_delay_is_a_failed_attempt(after: str) -> None:
    app = QueueingApp("retry-values")

    @app.handler()
    async def handle(msg: Job) -> None:
        raise Retry(after=AFTER[msg.after]())  # type: ignore[arg-type]

    pipe, prod = _pipeline(app)
    msg = Job(after=after, created_at=T0)
    _, first = await _decide(pipe, prod, msg, attempt=1)
    assert isinstance(first, RetryAfter), first  # counted, after the type's backoff
    assert first.delay == timedelta(seconds=3)
    assert first.error.startswith("TypeError: Retry(after=...) takes a timedelta or a number of seconds")
    _, last = await _decide(pipe, prod, msg, attempt=2)
    assert isinstance(last, DeadLetter)
    assert last.reason is DeadLetterReason.MAX_ATTEMPTS


@pytest.mark.parametrize("after", ["-1e11 seconds", "timedelta.min", "-30 seconds"])
async def test_a_retry_into_the_past_retries_at_once(after: str) -> None:
    app = QueueingApp("retry-values")

    @app.handler()
    async def handle(msg: Job) -> None:
        raise Retry(after=AFTER[msg.after]())  # type: ignore[arg-type]

    pipe, prod = _pipeline(app)
    d, decision = await _decide(pipe, prod, Job(after=after, created_at=T0), attempt=1)
    assert isinstance(decision, RetryAfter)
    assert decision.delay == timedelta(0)
    # its history record can be made (it could not: a due time before the year 1)
    assert history_record(Settlement(d, decision), T0).not_before == T0


@pytest.mark.parametrize(
    "fields",
    [
        {"max_delay": timedelta(days=-999_999_999)},
        {"max_delay": timedelta(seconds=-1)},
        {"base": timedelta(seconds=-1)},
    ],
)
def test_a_policy_with_a_negative_wait_is_refused_where_it_is_written(fields: dict[str, timedelta]) -> None:
    # it was taken and clamped to "retry at once" where it was used, a policy not meaning what it said
    with pytest.raises(ValidationError, match="must not be negative"):
        RetryPolicy(**fields)


@queue("retry-values-sb", max_attempts=3, lease_duration=timedelta(seconds=5))
class Sb(QueueMessage):
    n: int


async def test_a_retry_far_in_the_past_leaves_the_settler_settling_the_rest() -> None:
    """End to end on the in-memory Service Bus, as the review found it."""
    app = QueueingApp("retry-values-sb")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Sb) -> None:
        runs.append(msg.n)
        if msg.n == 1:
            raise Retry(after=-1e11)

    rt = in_memory_servicebus(app)
    await rt.open()
    bad = await app.enqueue(Sb(n=1))
    worker = Worker(rt, poll_min=0.01, poll_max=0.05)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    try:
        for _ in range(250):
            if runs:
                break
            await asyncio.sleep(0.02)
        goods = [await app.enqueue(Sb(n=i)) for i in (2, 3)]
        for _ in range(250):
            recs = [await rt.tracker.get(g.message_id) for g in goods]
            if all(r is not None and r.status == "Succeeded" for r in recs):
                break
            await asyncio.sleep(0.02)
        settler = worker.settler._task
        assert settler is not None
        alive = not settler.done()
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)  # (the settler's OverflowError was raised here)
    assert alive
    assert [(await rt.tracker.get(g.message_id)).status for g in goods] == ["Succeeded"] * 2  # type: ignore[union-attr]
    rec = await rt.tracker.get(bad.message_id)
    assert rec is not None
    # retried at once until its attempts were used up
    assert (rec.status, rec.attempt, runs.count(1)) == ("DeadLettered", 3, 3)


@pytest.mark.parametrize("after", [timedelta(seconds=60), 60, None])
def test_a_retry_pickles_and_copies_as_it_stands(after: timedelta | float | None) -> None:
    # (a handler's process pool pickles what its function raises: rebuilt as ``Retry(*args)``, its
    # reason was taken for ``after`` and refused, and the pool broke for every later message)
    import copy
    import pickle

    raised = Retry(after=after, reason="rate limited")
    for again in (pickle.loads(pickle.dumps(raised)), copy.copy(raised), copy.deepcopy(raised)):
        assert type(again) is Retry
        assert (again.after, again.reason, again.args) == (raised.after, "rate limited", ("rate limited",))
