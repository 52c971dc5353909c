"""The decision pipeline, decision by decision, with a fixed clock and in-memory control state."""

import asyncio
from datetime import UTC, datetime, timedelta
from uuid import uuid4

import pydantic
import pytest

from queueing_core import (
    CircuitBreakerOptions,
    Complete,
    DeadLetter,
    DeadLetterReason,
    Defer,
    Event,
    Expire,
    HandlerContext,
    MessageStatus,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    Release,
    Retry,
    RetryAfter,
    RetryPolicy,
    queue,
)
from queueing_core.control import MemoryControlStore
from queueing_core.decisions import dead_letter_of, due_at
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.transport import Capabilities, Delivery

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)


class Clock:
    def __init__(self):
        self.now = T0

    def __call__(self):
        return self.now


@queue(
    "work",
    max_attempts=3,
    retry=RetryPolicy(base=timedelta(seconds=2), jitter=0),
    expiration=timedelta(minutes=10),
)
class Work(QueueMessage):
    action: str = "ok"
    seconds: float = 0


class _NullProvider:
    capabilities = Capabilities()


def make(app=None, *, breaker=None):
    app = app or QueueingApp()
    clock = Clock()
    control = MemoryControlStore()
    pipe = Pipeline(app, control, clock=clock, rand=lambda: 0.5)
    prod = Producer(app, _NullProvider(), clock=clock)
    return app, pipe, control, clock, prod


def delivery(prod, msg, attempt=1, **kw):
    env = prod.envelope_for(msg, **kw)
    return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=attempt)


def with_handler(app):
    calls = []

    @app.handler()
    async def handle(msg: Work, ctx):
        calls.append((msg.action, ctx.attempt))
        if msg.action == "fail":
            raise RuntimeError("boom")
        if msg.action == "retry":
            raise Retry(after=timedelta(seconds=42), reason="not yet")
        if msg.action == "fatal":
            raise NonRetryableError("cannot ever work")
        if msg.action == "later":
            return T0 + timedelta(hours=1)
        if msg.action == "slow":
            await asyncio.sleep(msg.seconds)
        return {"done": msg.action}

    return calls


async def test_success_completes_with_the_result():
    app, pipe, *_, prod = make()
    calls = with_handler(app)
    d = await pipe.process(delivery(prod, Work()))
    assert d == Complete({"done": "ok"})
    assert d.status is MessageStatus.SUCCEEDED
    assert calls == [("ok", 1)]


async def test_failure_retries_with_backoff_then_dead_letters_at_max_attempts():
    app, pipe, *_, prod = make()
    with_handler(app)
    msg = Work(action="fail", created_at=T0)
    first = await pipe.process(delivery(prod, msg, attempt=1))
    second = await pipe.process(delivery(prod, msg, attempt=2))
    last = await pipe.process(delivery(prod, msg, attempt=3))
    assert isinstance(first, RetryAfter)
    assert first.delay == timedelta(seconds=2)
    assert "RuntimeError: boom" in first.error
    assert isinstance(second, RetryAfter)
    assert second.delay == timedelta(seconds=4)
    assert isinstance(last, DeadLetter)
    assert last.reason is DeadLetterReason.MAX_ATTEMPTS
    assert "attempt 3 of 3" in last.description
    assert "boom" in last.description


async def test_a_message_whose_attempts_were_used_by_runs_that_never_settled_is_dead_lettered_unrun():
    """Runs that end without a settlement (the worker killed, its lease lapsed) count attempts on every
    transport, yet no failure reaches the pipeline: a message that kills each worker would run for
    ever. Once its attempts are used up it is dead-lettered with a reason, the handler not called."""
    app, pipe, *_, prod = make()
    calls = with_handler(app)
    last = await pipe.process(delivery(prod, Work(), attempt=3))  # the last attempt still runs
    assert last == Complete({"done": "ok"})
    over = await pipe.process(delivery(prod, Work(), attempt=4))
    assert isinstance(over, DeadLetter)
    assert over.reason is DeadLetterReason.MAX_ATTEMPTS
    assert "delivered 3 times for 3 attempts" in over.description
    assert "without a settlement" in over.description
    assert calls == [("ok", 3)]
    # a transport that cannot tell a run from a delivery (RabbitMQ's "redelivered") runs it
    unsure = delivery(prod, Work(), attempt=4)
    unsure.runs_counted = False
    assert await pipe.process(unsure) == Complete({"done": "ok"})


async def test_retry_after_and_non_retryable_and_run_again_later():
    app, pipe, *_, prod = make()
    with_handler(app)
    r = await pipe.process(delivery(prod, Work(action="retry")))
    assert isinstance(r, RetryAfter)
    assert r.delay == timedelta(seconds=42)
    f = await pipe.process(delivery(prod, Work(action="fatal")))
    assert isinstance(f, DeadLetter)
    assert f.reason is DeadLetterReason.NON_RETRYABLE
    assert "cannot ever" in f.description
    later = await pipe.process(delivery(prod, Work(action="later")))
    assert later == Defer(
        T0 + timedelta(hours=1),
        MessageStatus.SLEEPING,
        "handler asked to run again later",
        reset_attempts=True,
        expires_at=T0 + timedelta(hours=1, minutes=10),  # the type's 10 minutes from then
    )


async def test_expired_message_never_reaches_the_handler():
    app, pipe, _, clock, prod = make()
    calls = with_handler(app)
    d = delivery(prod, Work(created_at=T0))
    clock.now = T0 + timedelta(minutes=10)
    decision = await pipe.process(d)
    assert decision == Expire(T0 + timedelta(minutes=10))
    assert calls == []


async def test_early_delivery_sleeps_until_due():
    app, pipe, *_, prod = make()
    calls = with_handler(app)
    decision = await pipe.process(delivery(prod, Work(), delay=timedelta(minutes=3)))
    assert decision == Defer(T0 + timedelta(minutes=3), MessageStatus.SLEEPING, "not due yet")
    assert calls == []


async def test_missing_handler_and_unknown_type_wait_without_counting_an_attempt():
    app, pipe, *_, prod = make()
    app.message(Work)  # known type, no handler
    d = await pipe.process(delivery(prod, Work()))
    assert isinstance(d, Defer)
    assert d.status is MessageStatus.WAITING_FOR_HANDLER
    assert not d.counts_attempt
    env = prod.envelope_for(Work()).model_copy(update={"type": "Renamed"})
    d2 = await pipe.process(Delivery(queue="work", raw=env.encode(), envelope=env, malformed=None, attempt=1))
    assert d2.status is MessageStatus.WAITING_FOR_HANDLER
    assert "no message type 'Renamed'" in d2.reason
    # a handler registered later is used at once
    calls = with_handler(app)
    assert isinstance(await pipe.process(delivery(prod, Work())), Complete)
    assert calls


async def test_malformed_envelope_and_invalid_body_are_dead_lettered_with_reasons():
    app, pipe, *_, prod = make()
    calls = with_handler(app)
    bad = Delivery.of(b"{not json", queue="work")
    d = await pipe.process(bad)
    assert isinstance(d, DeadLetter)
    assert d.reason is DeadLetterReason.MALFORMED_ENVELOPE
    assert bad.raw == b"{not json"
    env = prod.envelope_for(Work()).model_copy(update={"body": {"action": 17}})
    d2 = await pipe.process(Delivery(queue="work", raw=env.encode(), envelope=env, malformed=None, attempt=1))
    assert isinstance(d2, DeadLetter)
    assert d2.reason is DeadLetterReason.INVALID_BODY
    assert "action" in d2.description
    assert calls == []


@queue("tagged", max_attempts=3)
class Tagged(QueueMessage):
    tags: list[str]

    # a "before" validator that expects text; the producer's validation made a list of it, which is
    # what the envelope carries: pydantic lets the AttributeError through, not as a ValidationError
    @pydantic.field_validator("tags", mode="before")
    @classmethod
    def split(cls, v):
        return [t.strip() for t in v.split(",")]


@queue("keyed", idempotent=True, identity=lambda m: m.key[0])
class Keyed(QueueMessage):
    key: str


async def test_a_body_whose_validator_raises_any_error_is_dead_lettered_not_handed_back():
    """Anything a validator of the model raises is the body's fault (another run could only raise it
    again); raised on, it crash-looped (found in review: a worker handed it back unrun for ever)."""
    app, pipe, *_, prod = make()
    calls = []

    @app.handler()
    async def handle(msg: Tagged):
        calls.append(msg)

    with pytest.raises(AttributeError):  # (what pydantic does with it, held against pydantic itself)
        Tagged.model_validate({"tags": ["a", "b"]})
    d = await pipe.process(delivery(prod, Tagged(tags="a, b")))
    assert isinstance(d, DeadLetter)
    assert d.reason is DeadLetterReason.INVALID_BODY
    assert "AttributeError" in d.description
    assert "Tagged" in d.description
    assert calls == []


async def test_an_idempotent_body_its_identity_cannot_be_read_from_is_dead_lettered():
    app, pipe, *_, prod = make()
    calls = []

    @app.handler()
    async def handle(msg: Keyed):
        calls.append(msg)

    env = prod.envelope_for(Keyed(key="k")).model_copy(update={"body": {"key": ""}})  # (another producer's)
    d = await pipe.process(Delivery(queue="keyed", raw=env.encode(), envelope=env, malformed=None, attempt=1))
    assert isinstance(d, DeadLetter)
    assert d.reason is DeadLetterReason.INVALID_BODY
    assert "IndexError" in d.description
    assert calls == []


async def test_pause_by_queue_and_by_type_defers_without_an_attempt():
    app, pipe, control, _, prod = make()
    calls = with_handler(app)
    await control.set_paused("queue", "work", True)
    d = await pipe.process(delivery(prod, Work()))
    assert d.status is MessageStatus.PAUSED
    assert not d.counts_attempt
    assert "queue 'work'" in d.reason
    await control.set_paused("queue", "work", False)
    await control.set_paused("type", "Work", True)
    d = await pipe.process(delivery(prod, Work()))
    assert d.status is MessageStatus.PAUSED
    assert "type 'Work'" in d.reason
    await control.set_paused("type", "Work", False)
    assert isinstance(await pipe.process(delivery(prod, Work())), Complete)
    assert len(calls) == 1


async def test_circuit_opens_holds_probes_once_and_closes():
    @queue(
        "fragile",
        max_attempts=100,
        circuit_breaker=CircuitBreakerOptions(failure_threshold=2, cooldown=timedelta(seconds=30)),
    )
    class Fragile(QueueMessage):
        ok: bool

    app, pipe, control, clock, prod = make()
    calls = []

    @app.handler()
    async def h(msg: Fragile):
        calls.append(msg.ok)
        if not msg.ok:
            raise RuntimeError("down")

    for _ in range(2):
        assert isinstance(await pipe.process(delivery(prod, Fragile(ok=False))), RetryAfter)
    assert (await control.state()).circuit("Fragile").state == "open"
    held = await pipe.process(delivery(prod, Fragile(ok=True)))
    assert held.status is MessageStatus.PAUSED
    # held until the next look (the recheck), not the cooldown end, so a reset takes effect quickly
    assert held.until == T0 + timedelta(seconds=5)
    assert len(calls) == 2
    clock.now = T0 + timedelta(seconds=31)
    # the first message after the cooldown is the probe; a second one meanwhile is held
    assert await control.acquire_probe("Fragile", Fragile.queue_options().circuit_breaker, clock.now)
    assert (await pipe.process(delivery(prod, Fragile(ok=True)))).status is MessageStatus.PAUSED
    await control.reset_circuit("Fragile")
    assert isinstance(await pipe.process(delivery(prod, Fragile(ok=True))), Complete)
    # a failing probe re-opens at once
    for _ in range(2):
        await pipe.process(delivery(prod, Fragile(ok=False)))
    clock.now += timedelta(seconds=31)
    assert isinstance(await pipe.process(delivery(prod, Fragile(ok=False))), RetryAfter)
    st = (await control.state()).circuit("Fragile")
    assert st.state == "open"
    assert st.open_until == clock.now + timedelta(seconds=30)
    clock.now += timedelta(seconds=31)
    assert isinstance(await pipe.process(delivery(prod, Fragile(ok=True))), Complete)
    assert (await control.state()).circuit("Fragile").state == "closed"


async def test_time_limit_cancels_the_handler_and_counts_a_failed_attempt():
    @queue("limited", time_limit=timedelta(milliseconds=50), max_attempts=2)
    class Limited(QueueMessage):
        pass

    app, pipe, *_, prod = make()
    finished = []

    @app.handler()
    async def slow(msg: Limited):
        await asyncio.sleep(5)
        finished.append(True)

    d = await pipe.process(delivery(prod, Limited()))
    assert isinstance(d, RetryAfter)
    assert "execution time limit of 0.05s exceeded" in d.error
    assert not finished


async def test_a_time_limit_tells_a_plain_def_handler_to_stop():
    """asyncio cannot stop a thread: a plain def handler past its time limit ran on, never told (a
    review found it), beside its own retry. It now sees ``ctx.cancelled``, as for a cancel."""
    import threading

    @queue("limited-thread", time_limit=timedelta(milliseconds=50), max_attempts=2)
    class LimitedThread(QueueMessage):
        pass

    app, pipe, *_, prod = make()
    told = threading.Event()

    @app.handler()
    def slow(msg: LimitedThread, ctx: HandlerContext) -> None:
        import time

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # what the docs tell a def handler to do
            if ctx.cancelled.is_set():
                told.set()
                return
            time.sleep(0.01)

    d = await pipe.process(delivery(prod, LimitedThread()))
    assert isinstance(d, RetryAfter)
    assert "execution time limit of 0.05s exceeded" in d.error
    assert await asyncio.to_thread(told.wait, 5), "the handler's thread was never told to stop"


async def test_a_cancelled_error_the_handler_raises_itself_is_a_failed_attempt():
    """A handler that awaits a task another one cancelled raises CancelledError while its own run is
    not being cancelled. It was handed back unrun, as at a shutdown, and delivered again for ever
    without using an attempt (a review found it); it now fails the attempt, and the last one
    dead-letters it."""

    @queue("stray-cancel", max_attempts=2)
    class StrayCancel(QueueMessage):
        pass

    app, pipe, *_, prod = make()

    @app.handler()
    async def h(msg: StrayCancel) -> None:
        other = asyncio.ensure_future(asyncio.sleep(5))
        other.cancel()
        await other  # raises CancelledError here, in a run nobody cancelled

    d = await pipe.process(delivery(prod, StrayCancel()))
    assert isinstance(d, RetryAfter), d
    assert "CancelledError" in d.error
    last = await pipe.process(delivery(prod, StrayCancel(), attempt=2))
    assert isinstance(last, DeadLetter), last
    assert last.reason is DeadLetterReason.MAX_ATTEMPTS


async def test_max_concurrency_is_never_exceeded():
    @queue("narrow", max_concurrency=3)
    class Narrow(QueueMessage):
        pass

    app, pipe, *_, prod = make()
    running, peak = 0, 0

    @app.handler()
    async def h(msg: Narrow):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    results = await asyncio.gather(*(pipe.process(delivery(prod, Narrow())) for _ in range(20)))
    assert all(isinstance(r, Complete) for r in results)
    assert peak == 3


async def test_a_message_that_finds_no_free_slot_within_the_wait_is_deferred_unrun_and_uncounted():
    """A host that pushes messages in (Functions) bounds the wait for a slot: the message is deferred,
    no attempt counted and nothing said to the circuit; the slot it did not get stays whole."""

    @queue("one-at-a-time", max_concurrency=1, circuit_breaker=CircuitBreakerOptions(failure_threshold=3))
    class Single(QueueMessage):
        fail: bool = False

    app, pipe, control, clock, prod = make()
    release = asyncio.Event()
    ran = []

    @app.handler()
    async def h(msg: Single):
        ran.append(msg.message_id)
        if msg.fail:
            raise RuntimeError("downstream down")
        await release.wait()

    assert isinstance(await pipe.process(delivery(prod, Single(fail=True))), RetryAfter)
    assert (await control.state()).circuit("Single").consecutive_failures == 1
    first = asyncio.create_task(pipe.process(delivery(prod, Single())))
    async with asyncio.timeout(30):
        while len(ran) < 2:
            await asyncio.sleep(0.01)
    decision = await pipe.process(delivery(prod, Single(), attempt=2), slot_wait=0.05)
    assert isinstance(decision, Defer)
    assert decision.status is MessageStatus.PENDING
    assert decision.until == clock.now + timedelta(seconds=30)
    assert decision.reason == "no free slot of 'Single' (max_concurrency 1) within 0.05 s"
    assert not decision.counts_attempt
    assert len(ran) == 2  # not run
    # not a success of the downstream's either (that would reset the failure before it)
    assert (await control.state()).circuit("Single").consecutive_failures == 1
    release.set()
    assert isinstance(await first, Complete)
    assert isinstance(await pipe.process(delivery(prod, Single()), slot_wait=0.05), Complete)  # a slot again
    assert pipe.limiter(app.subscription("Single")).locked() is False


async def test_host_cancellation_releases_without_counting():
    app, pipe, *_, prod = make()
    calls = with_handler(app)
    task = asyncio.create_task(pipe.process(delivery(prod, Work(action="slow", seconds=60))))
    async with asyncio.timeout(30):  # the handler is running (not a fixed sleep a loaded machine outlasts)
        while not calls:
            await asyncio.sleep(0.01)
    task.cancel()
    decision = await task
    assert isinstance(decision, Release)
    assert not task.cancelled()


async def test_middleware_is_an_onion_and_hooks_observe_without_breaking():
    app, pipe, *_, prod = make()
    with_handler(app)
    trail = []

    @app.use_handle_middleware
    async def outer(ctx, call_next):
        trail.append("outer-in")
        result = await call_next()
        trail.append("outer-out")
        return {**result, "wrapped": True}

    @app.use_handle_middleware
    async def inner(ctx, call_next):
        trail.append(f"inner-in:{ctx.message.action}")
        return await call_next()

    seen = []

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def observe(obs):
        seen.append(obs.event)
        raise ValueError("a broken hook must not fail the message")

    d = await pipe.process(delivery(prod, Work()))
    assert d == Complete({"done": "ok", "wrapped": True})
    assert trail == ["outer-in", "inner-in:ok", "outer-out"]
    assert seen == [Event.BEGAN, Event.SUCCEEDED]


async def test_plain_def_handlers_run_off_the_event_loop():
    import threading

    app, pipe, *_, prod = make()
    threads = []

    @app.handler()
    def sync_handler(msg: Work):
        threads.append(threading.current_thread())
        return "sync"

    assert await pipe.process(delivery(prod, Work())) == Complete("sync")
    assert threads
    assert threads[0] is not threading.main_thread()


async def test_a_deliberate_refusal_does_not_trip_the_breaker():
    @queue("refusals", circuit_breaker=CircuitBreakerOptions(failure_threshold=1))
    class Refusal(QueueMessage):
        pass

    app, pipe, control, _, prod = make()

    @app.handler()
    async def h(msg: Refusal):
        raise NonRetryableError("card declined")

    d = await pipe.process(delivery(prod, Refusal()))
    assert isinstance(d, DeadLetter)
    assert (await control.state()).circuit("Refusal").state == "closed"


def test_what_a_transport_needs_to_settle_a_decision_by_sending_a_copy():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    later = now + timedelta(hours=2)
    assert due_at(RetryAfter(timedelta(seconds=30), "boom"), now) == now + timedelta(seconds=30)
    assert due_at(Defer(later, MessageStatus.PAUSED, "paused"), now) == later
    assert due_at(Release("shutdown"), now) is None
    assert dead_letter_of(Expire(now)) == (DeadLetterReason.EXPIRED, f"expired at {now.isoformat()}")
    assert dead_letter_of(DeadLetter(DeadLetterReason.NON_RETRYABLE, "declined")) == (
        DeadLetterReason.NON_RETRYABLE,
        "declined",
    )


async def test_a_superseded_message_settled_without_running_does_not_hold_the_circuit_probe():
    @queue(
        "fragile-versions",
        idempotent=True,
        identity="sku",
        max_attempts=100,
        circuit_breaker=CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(seconds=30)),
    )
    class Version(QueueMessage):
        sku: str

    app, pipe, control, clock, prod = make()

    @app.handler()
    async def h(msg: Version):
        raise RuntimeError("down")

    newer = uuid4()

    async def superseded(sub, message):
        return None if message.sku == "live" else newer

    pipe.supersede_check = superseded
    assert isinstance(await pipe.process(delivery(prod, Version(sku="live"))), RetryAfter)
    assert (await control.state()).circuit("Version").state == "open"
    clock.now = T0 + timedelta(seconds=31)  # the cooldown is over: the next message would be the probe
    d = await pipe.process(delivery(prod, Version(sku="old")))
    assert isinstance(d, Complete)
    assert d.cancelled
    assert d.reason == f"superseded by {newer}"
    # the probe is still there for a message that runs
    opts = Version.queue_options().circuit_breaker
    assert await control.acquire_probe("Version", opts, clock.now)


class _TextlessError(Exception):
    """An exception whose ``str()`` fails (its ``__str__`` returns an int)."""

    def __str__(self):
        return self.args[0]


async def test_an_error_whose_text_cannot_be_made_still_counts_its_attempts():
    # the pipeline's own description of the failure raised: the worker handed the message back
    # uncounted and it ran again at once, for ever (never retried with backoff, never dead-lettered)
    app, pipe, *_, prod = make()

    @app.handler()
    async def handle(msg: Work):
        raise _TextlessError(404)

    first = await pipe.process(delivery(prod, Work(), attempt=1))
    assert isinstance(first, RetryAfter)
    assert first.error.startswith("_TextlessError: <str() of the _TextlessError failed: TypeError>")
    last = await pipe.process(delivery(prod, Work(), attempt=3))
    assert isinstance(last, DeadLetter)
    assert last.reason is DeadLetterReason.MAX_ATTEMPTS


async def test_a_run_asked_for_later_expires_from_its_own_time():
    app, pipe, _, clock, prod = make()
    with_handler(app)  # "later": run again in an hour, past the type's 10 minutes
    d = delivery(prod, Work(action="later", created_at=T0))
    later = await pipe.process(d)
    assert isinstance(later, Defer)
    assert later.expires_at == T0 + timedelta(hours=1, minutes=10)
    # the copy every transport sends runs then, with fresh attempts (it expired, the first run's expiry)
    copy = d.copy_after(later)
    assert (copy.attempt, copy.expires_at) == (0, later.expires_at)
    clock.now = later.until
    again = Delivery(queue=copy.queue, raw=copy.encode(), envelope=copy, malformed=None, attempt=1)
    assert isinstance(await pipe.process(again), Defer)  # "later" again: it ran, not Expire


async def test_a_run_asked_for_later_of_a_type_that_never_expires_never_expires():
    app = QueueingApp()

    @queue("forever", expiration=None)
    class Forever(QueueMessage):
        n: int = 0

    app, pipe, *_, prod = make(app)

    @app.handler()
    async def handle(msg: Forever):
        return T0 + timedelta(days=400)

    later = await pipe.process(delivery(prod, Forever()))
    assert isinstance(later, Defer)
    assert later.reset_attempts
    assert later.expires_at is None


async def test_a_run_asked_for_a_time_already_past_expires_from_now():
    # a naive local time on a host behind UTC, a catch-up schedule's missed slot: counted from the
    # time asked, its expiry had passed too, and the job expired instead of running again
    app, pipe, *_, prod = make()

    @app.handler()
    async def handle(msg: Work):
        return T0 - timedelta(hours=1)

    d = delivery(prod, Work(created_at=T0))
    later = await pipe.process(d)
    assert isinstance(later, Defer)
    assert later.expires_at == T0 + timedelta(minutes=10)  # the type's 10 minutes from now
    copy = d.copy_after(later)
    again = Delivery(queue=copy.queue, raw=copy.encode(), envelope=copy, malformed=None, attempt=1)
    assert isinstance(await pipe.process(again), Defer)  # it ran again, and asked again
