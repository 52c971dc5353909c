"""A deliberate refusal (NonRetryableError) is neither a failure nor a success for the circuit breaker:
the count of failures stays as it was, and a probe refused hands its probe back (the circuit stays
half-open, and the next message probes at once)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from queueing_core import (
    CircuitBreakerOptions,
    Complete,
    DeadLetter,
    DeadLetterReason,
    Defer,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    RetryAfter,
    queue,
)
from queueing_core.control import MemoryControlStore
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.transport import Delivery
from tests.clocks import ManualClock, NullProvider

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)
BREAKER = CircuitBreakerOptions(failure_threshold=3, cooldown=timedelta(seconds=30))


@queue("payments", max_attempts=100, circuit_breaker=BREAKER)
class Pay(QueueMessage):
    #: "down": the gateway fails (transient); "declined": refused before the call; "later": succeeds
    #: and asks to run again later; anything else succeeds
    kind: str


def make():
    app, clock, control = QueueingApp(), ManualClock(T0), MemoryControlStore()
    ran: list[str] = []

    @app.handler()
    async def pay(msg: Pay):
        ran.append(msg.kind)
        if msg.kind == "down":
            raise ConnectionError("gateway down")
        if msg.kind == "declined":
            raise NonRetryableError("card declined")
        if msg.kind == "later":
            return clock.now + timedelta(hours=1)
        return None

    pipe = Pipeline(app, control, clock=clock, rand=lambda: 0.5)
    prod = Producer(app, NullProvider(), clock=clock)

    async def process(kind: str):
        env = prod.envelope_for(Pay(kind=kind))
        return await pipe.process(
            Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)
        )

    return process, control, clock, ran


async def _opened(process, control, clock) -> None:
    for _ in range(3):
        assert isinstance(await process("down"), RetryAfter)
    assert (await control.state()).circuit("Pay").state == "open"
    clock.now = T0 + BREAKER.cooldown + timedelta(seconds=1)


async def test_a_refused_probe_leaves_the_circuit_half_open_and_the_next_message_probes():
    process, control, clock, ran = make()
    await _opened(process, control, clock)
    refused = await process("declined")  # the probe
    assert isinstance(refused, DeadLetter)
    assert refused.reason is DeadLetterReason.NON_RETRYABLE
    state = (await control.state()).circuit("Pay")
    # not closed (before the fix the refusal went down the success path and closed it), and the probe
    # handed back: the next message may probe now, not after probe_timeout
    assert state.state == "half_open"
    assert state.probe_until == clock.now
    clock.now += timedelta(seconds=1)
    assert isinstance(await process("ok"), Complete)  # the next message probes, and closes it
    assert ran[-1] == "ok"
    assert (await control.state()).circuit("Pay").state == "closed"


async def test_a_refused_probe_then_a_failing_probe_opens_the_circuit_again():
    process, control, clock, _ = make()
    await _opened(process, control, clock)
    await process("declined")
    clock.now += timedelta(seconds=1)
    assert isinstance(await process("down"), RetryAfter)  # the next probe, failing
    state = (await control.state()).circuit("Pay")
    assert state.state == "open"
    assert state.open_until == clock.now + BREAKER.cooldown


async def test_a_refusal_between_failures_does_not_reset_their_count():
    """Threshold 3: a failure, a refusal, two failures open the breaker (before the fix the refusal
    reset the count, and the breaker stayed closed)."""
    process, control, _, _ = make()
    assert isinstance(await process("down"), RetryAfter)
    await process("declined")
    assert (await control.state()).circuit("Pay").consecutive_failures == 1
    assert isinstance(await process("down"), RetryAfter)
    assert isinstance(await process("down"), RetryAfter)
    assert (await control.state()).circuit("Pay").state == "open"


async def test_a_success_still_resets_the_count_and_a_probe_that_runs_again_later_closes_it():
    """The successes are as before: one that completes resets the count, and a probe whose handler
    succeeded and asked to run again later closes the circuit."""
    process, control, clock, _ = make()
    for kind in ("down", "down", "ok", "down", "down"):
        await process(kind)
    assert (await control.state()).circuit("Pay").consecutive_failures == 2
    await process("down")
    await _opened_from_now(control, clock)
    later = await process("later")  # the probe
    assert isinstance(later, Defer)
    assert later.reset_attempts
    assert (await control.state()).circuit("Pay").state == "closed"


async def _opened_from_now(control, clock) -> None:
    state = (await control.state()).circuit("Pay")
    assert state.state == "open"
    assert state.open_until is not None
    clock.now = state.open_until + timedelta(seconds=1)
