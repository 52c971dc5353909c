"""The times a handler or a producer hands the pipeline, as the decisions keep them: a deferral's time
is aware UTC whatever it was given (a naive one taken as UTC, as everywhere in the kit), and an
envelope whose created_at is too late to add its queue's expiration to is dead-lettered as malformed,
not an OverflowError on every delivery. (Both crashed the settlement or the pipeline: a review.)"""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta, timezone

from queueing_core import DeadLetter, DeadLetterReason, Defer, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.control import MemoryControlStore
from queueing_core.decisions import LATEST
from queueing_core.envelope import Envelope
from queueing_core.pipeline import Pipeline
from queueing_core.transport import Delivery

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)


@queue("times", max_attempts=3)  # the default expiration: 4 hours
class Timed(QueueMessage):
    n: int = 0


def defer(until: datetime) -> Defer:
    return Defer(until, MessageStatus.SLEEPING, "later")


def test_a_deferral_keeps_its_time_in_utc() -> None:
    naive = datetime(2026, 5, 1, 10, 0)
    assert defer(naive).until == datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    assert defer(naive).until.tzinfo is UTC
    plus_two = datetime(2026, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=2)))
    assert defer(plus_two).until == datetime(2026, 5, 1, 10, 0, tzinfo=UTC)
    assert defer(plus_two).until.tzinfo is UTC
    assert defer(T0).until is T0  # (already UTC: kept as it is)


def test_a_deferral_past_the_years_1_to_9999_in_utc_is_the_nearest_time_any_reader_takes() -> None:
    latest = datetime(9999, 12, 31, 23, 0, tzinfo=timezone(timedelta(hours=-5)))  # 04:00 in year 10000
    assert defer(latest).until == LATEST
    assert defer(datetime.max).until == LATEST  # "never", naive: a day short of the year 10000
    assert defer(datetime.max.replace(tzinfo=UTC)).until == LATEST
    earliest = datetime(1, 1, 1, 1, 0, tzinfo=timezone(timedelta(hours=5)))  # 20:00 in year 0
    assert defer(earliest).until == datetime.min.replace(tzinfo=UTC)


def delivery_of(env: Envelope) -> Delivery:
    return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)


def test_the_pipeline_defers_a_naive_run_again_time_as_utc_and_dead_letters_a_far_created_at() -> None:
    app = QueueingApp()
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Timed) -> datetime:
        runs.append(msg.n)
        return datetime(2026, 5, 1, 10, 0)

    pipe = Pipeline(app, MemoryControlStore(), clock=lambda: T0)

    def env(created_at: datetime) -> Envelope:
        mid = uuid.uuid4()
        return Envelope(
            type="Timed", queue="times", message_id=mid, tracking_id=mid, created_at=created_at, body={"n": 1}
        )

    decision = asyncio.run(pipe.process(delivery_of(env(T0))))
    assert isinstance(decision, Defer)
    assert (decision.until, decision.status) == (
        datetime(2026, 5, 1, 10, 0, tzinfo=UTC),
        MessageStatus.SLEEPING,
    )
    assert decision.until > T0  # comparable with the kit's aware times (a naive one raised TypeError)

    far = asyncio.run(pipe.process(delivery_of(env(datetime(9999, 12, 31, 23, 0, tzinfo=UTC)))))
    assert isinstance(far, DeadLetter)
    assert far.reason is DeadLetterReason.MALFORMED_ENVELOPE
    assert far.description == (
        "created_at 9999-12-31T23:00:00+00:00 is too late to add the queue's expiration (4:00:00) to"
    )
    assert runs == [1]  # the far one never ran
