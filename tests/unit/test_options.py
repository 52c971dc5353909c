"""Queue options: defaults, merging, validation, and the retry policy's arithmetic."""

from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, QueueOptions, RetryPolicy, queue


def test_backoff_is_exponential_and_capped_without_jitter():
    p = RetryPolicy(base=timedelta(seconds=1), factor=2, max_delay=timedelta(seconds=10), jitter=0)
    assert [p.delay(a).total_seconds() for a in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 8, 10, 10]


@given(attempt=st.integers(min_value=1, max_value=10_000), r=st.floats(min_value=0, max_value=1))
def test_jitter_stays_within_its_band_and_the_cap(attempt, r):
    p = RetryPolicy(base=timedelta(seconds=2), factor=3, max_delay=timedelta(minutes=5), jitter=0.25)
    raw = min(2 * 3 ** min(attempt - 1, 64), 300)
    got = p.delay(attempt, lambda: r).total_seconds()
    assert raw * 0.75 - 1e-9 <= got <= min(300, raw * 1.25) + 1e-9


def test_type_options_override_app_defaults_field_by_field():
    @queue("q1", max_attempts=2)
    class M(QueueMessage):
        x: int

    app = QueueingApp(defaults=QueueOptions(max_attempts=9, lease_duration=timedelta(minutes=2)))
    app.message(M)
    opts = app.options_for(M)
    assert opts.max_attempts == 2  # set on the type
    assert opts.lease_duration == timedelta(minutes=2)  # inherited from the app
    assert opts.expiration == timedelta(hours=4)  # the kit default (FastEndpoints' 4 hours)


def test_ordered_forces_one_at_a_time():
    @queue(ordered=True)
    class Ordered(QueueMessage):
        pass

    assert QueueingApp(defaults=QueueOptions(max_concurrency=8)).options_for(Ordered).max_concurrency == 1


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_attempts=0),
        dict(lease_duration=timedelta(0)),
        dict(time_limit=timedelta(seconds=-1)),
        dict(expiration=timedelta(0)),
        dict(ordered=True, max_concurrency=4),
        dict(nonsense=1),
    ],
)
def test_invalid_options_fail_at_declaration(bad):
    with pytest.raises(ValidationError):
        QueueOptions(**bad)


def test_subclass_does_not_inherit_its_parents_queue():
    @queue("parent-q")
    class Parent(QueueMessage):
        pass

    class Child(Parent):
        pass

    assert Child.queue_options().name is None
    assert Child.type_name() == "Child"


def test_a_probe_timeout_under_five_seconds_is_refused():
    """A probe is named by the time it was acquired until, told apart within a second: a probe timeout
    that short would let a replaced probe's late success close the circuit over its successor."""
    from queueing_core import CircuitBreakerOptions

    with pytest.raises(ValidationError, match="probe_timeout"):
        CircuitBreakerOptions(probe_timeout=timedelta(seconds=1))
    assert CircuitBreakerOptions(probe_timeout=timedelta(seconds=5)).probe_timeout == timedelta(seconds=5)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: CircuitBreakerOptions(cooldown=timedelta(seconds=-1)), "cooldown must not be negative"),
        (
            lambda: QueueOptions(keep_processed_for=timedelta(hours=-1)),
            "keep_processed_for must not be negative",
        ),
    ],
)
def test_negative_durations_are_refused(make, words):
    with pytest.raises(ValidationError, match=words):
        make()
