"""The contract every provider keeps: same behaviours, same assertions.

Each test builds its own app (with a unique queue prefix) and provider, drives a real Worker, and
asserts on what the history says: statuses, attempts, order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from datetime import datetime, timedelta

import pytest

from queueing_core import (
    CircuitBreakerOptions,
    DeadLetterReason,
    MessageStatus,
    NonRetryableError,
    QueueMessage,
    Retry,
    RetryPolicy,
    queue,
)
from queueing_core.clock import utcnow
from queueing_core.control.base import CircuitState
from queueing_core.decisions import Complete, DeadLetter, RetryAfter
from queueing_core.transport import Settlement
from queueing_core.worker import Settler

from .harness import all_have, find, ops_client, record, running, statuses, wait_until

FAST_RETRY = RetryPolicy(base=timedelta(milliseconds=20), factor=1.0, jitter=0)


@queue("jobs", max_attempts=3, retry=FAST_RETRY)
class Job(QueueMessage):
    key: str
    fail_times: int = 0
    fatal: bool = False
    sleep: float = 0.0


def job_app(harness, **handler_kw):
    app = harness.app()
    calls: list[tuple[str, int]] = []

    @app.handler(**handler_kw)
    async def handle(msg: Job, ctx):
        calls.append((msg.key, ctx.attempt))
        if msg.sleep:
            await asyncio.sleep(msg.sleep)
        if msg.fatal:
            raise NonRetryableError(f"{msg.key} can never work")
        if ctx.attempt <= msg.fail_times:
            raise RuntimeError(f"{msg.key} failed on attempt {ctx.attempt}")
        return {"key": msg.key}

    return app, calls


async def test_each_message_is_handled_once_and_succeeds(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    receipts = await app.enqueue_many([Job(key=str(i)) for i in range(25)])
    async with running(rt):
        ids = [r.message_id for r in receipts]
        await wait_until(lambda: all_have(rt, ids, MessageStatus.SUCCEEDED), what="25 successes")
    assert sorted(k for k, _ in calls) == sorted(str(i) for i in range(25))
    assert {a for _, a in calls} == {1}
    assert {(await record(rt, i)).attempt for i in ids} == {1}


async def test_failures_retry_with_counted_attempts_then_succeed(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="flaky", fail_times=2))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="success")
    assert calls == [("flaky", 1), ("flaky", 2), ("flaky", 3)]
    rec = await record(rt, r.message_id)
    assert rec.attempt == 3


async def test_max_attempts_dead_letters_with_reason_and_last_error(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="doomed", fail_times=99))
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dead letter"
        )
        await asyncio.sleep(0.2)  # nothing more happens to it
    assert calls == [("doomed", 1), ("doomed", 2), ("doomed", 3)]
    rec = await record(rt, r.message_id)
    assert rec.reason == DeadLetterReason.MAX_ATTEMPTS.value
    assert "doomed failed on attempt 3" in (rec.description or "")


async def test_non_retryable_error_dead_letters_at_once(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="fatal", fatal=True))
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dead letter"
        )
    assert calls == [("fatal", 1)]
    assert (await record(rt, r.message_id)).reason == DeadLetterReason.NON_RETRYABLE.value


async def test_retry_after_is_honoured(harness):
    app = harness.app()
    seen: list[float] = []

    @app.handler()
    async def h(msg: Job, ctx):
        seen.append(time.monotonic())
        if ctx.attempt == 1:
            raise Retry(after=timedelta(milliseconds=600))

    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="later"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="success")
    assert len(seen) == 2
    assert seen[1] - seen[0] >= 0.55


@queue("recurring", expiration=timedelta(seconds=5))
class Recurring(QueueMessage):
    key: str


async def test_a_run_asked_for_past_the_first_expiry_still_runs(harness):
    """A handler that returns a later time (a recurring job) runs again then, with fresh attempts,
    though that time is past the message's first expiry: the run asked for expires the type's
    expiration after its own time. (It kept the first run's expiry: the job ran once and then
    expired, on every transport.)"""
    app = harness.app()
    runs: list[int] = []
    asked: list[datetime] = []

    @app.handler()
    async def again(msg: Recurring, ctx):
        runs.append(ctx.attempt)
        if len(runs) == 1:
            asked.append(utcnow() + timedelta(seconds=6))
            return asked[0]
        return None

    rt = await harness.runtime(app)
    r = await app.enqueue(Recurring(key="monthly"))
    async with running(rt):
        await wait_until(lambda: len(runs) == 1, what="the first run")
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SLEEPING), what="asleep")
        sleeping = await record(rt, r.message_id)
        assert sleeping.expires_at is not None
        assert abs((sleeping.expires_at - (asked[0] + timedelta(seconds=5))).total_seconds()) < 0.01
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), timeout=45, what="the second run"
        )
    assert runs == [1, 1]


async def test_a_message_an_operator_retried_succeeds_with_no_reason_left(harness):
    """The reason an operator's retry gives ("retried by an operator") lasts until the copy runs: a
    success leaves none (on SQL the usual success kept it: "Succeeded, retried by an operator")."""
    from queueing_core.ops import OpsService

    app = harness.app()
    runs: list[int] = []

    @app.handler()
    async def once_void(msg: Job, ctx):
        runs.append(ctx.attempt)
        if len(runs) == 1:
            raise NonRetryableError("void until an operator looks")

    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="void"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dead")
        await OpsService(rt).retry(r.message_id)
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="its retry")
    rec = await record(rt, r.message_id)
    assert len(runs) == 2
    assert rec.reason is None, rec.reason


async def test_expired_messages_are_never_handled(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="stale"), ttl=timedelta(milliseconds=300))
    await asyncio.sleep(0.5)
    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.EXPIRED), what="expiry")
    assert calls == []


async def test_delayed_messages_sleep_until_due(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    start = time.monotonic()
    r = await app.enqueue(Job(key="delayed"), delay=timedelta(milliseconds=800))
    assert r.status == MessageStatus.SLEEPING
    handled_at: list[float] = []

    @app.hooks.on()
    def stamp(obs):
        if obs.event.value == "succeeded":
            handled_at.append(time.monotonic())

    async with running(rt):
        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="success")
    assert calls == [("delayed", 1)]
    assert handled_at[0] - start >= 0.75


async def test_missing_handler_waits_and_a_later_handler_takes_the_backlog(harness):
    app = harness.app()
    app.message(Job)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="early"))
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.WAITING_FOR_HANDLER), what="WaitingForHandler"
        )
        handled: list[int] = []

        @app.handler()
        async def late(msg: Job, ctx):
            handled.append(ctx.attempt)

        await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="late handling")
    assert handled == [1]  # waiting never burned an attempt


@pytest.mark.parametrize("kind", ["queue", "type"])
async def test_pause_holds_work_without_burning_attempts_and_resume_releases_it(harness, kind):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused(kind, "jobs" if kind == "queue" else "Job", True)
    receipts = await app.enqueue_many([Job(key=str(i)) for i in range(3)])
    ids = [r.message_id for r in receipts]
    async with running(rt):
        await asyncio.sleep(0.6)
        assert calls == []
        assert not {s for s in await statuses(rt, ids)} & {MessageStatus.SUCCEEDED, MessageStatus.FAILED}
        await rt.control.set_paused(kind, "jobs" if kind == "queue" else "Job", False)
        await wait_until(lambda: all_have(rt, ids, MessageStatus.SUCCEEDED), what="resumed work")
    assert sorted(calls) == [("0", 1), ("1", 1), ("2", 1)]


async def test_circuit_opens_holds_work_then_a_probe_closes_it(harness):
    @queue(
        "gateway",
        max_attempts=50,
        retry=FAST_RETRY,
        circuit_breaker=CircuitBreakerOptions(failure_threshold=3, cooldown=timedelta(milliseconds=700)),
    )
    class Charge(QueueMessage):
        n: int

    app = harness.app()
    state = {"down": True}
    # stamped on the clock the circuit's own opened_at / open_until are on
    calls: list[tuple[int, datetime]] = []

    @app.handler(max_concurrency=1)
    async def charge(msg: Charge):
        calls.append((msg.n, utcnow()))
        if state["down"]:
            raise ConnectionError("gateway down")

    rt = await harness.runtime(app)
    receipts = await app.enqueue_many([Charge(n=i) for i in range(4)])
    opened: list[CircuitState] = []

    async def circuit_open() -> bool:
        rt.control.invalidate()
        circuit = (await rt.control.state()).circuit("Charge")
        opened[:] = [circuit] if circuit.state == "open" else []
        return bool(opened)

    async with running(rt):
        await wait_until(lambda: len(calls) >= 3, what="three failures")
        await wait_until(circuit_open, what="open circuit")
        state["down"] = False
        await wait_until(
            lambda: all_have(rt, [r.message_id for r in receipts], MessageStatus.SUCCEEDED),
            what="work after the probe",
        )
    # the window is the circuit's own cooldown, not how soon this test saw it open (a loaded machine
    # can notice late): no handler ran from just after it opened until the cooldown ended
    [circuit] = opened
    assert circuit.opened_at is not None
    assert circuit.open_until is not None
    during = [t for _, t in calls if circuit.opened_at + timedelta(milliseconds=50) < t < circuit.open_until]
    assert during == []  # the open circuit held the work
    assert any(t >= circuit.open_until for _, t in calls)  # and a probe ran after the cooldown
    assert await _circuit(rt, "Charge", "closed")


async def _circuit(rt, type_name, name):
    rt.control.invalidate()
    return (await rt.control.state()).circuit(type_name).state == name


class _Gateway(QueueMessage):
    ok: bool


def _breaker(threshold: int) -> dict:
    # each failure is final (one message, one outcome); the breaker opens at ``threshold`` for an hour
    return dict(
        max_attempts=1,
        retry=FAST_RETRY,
        circuit_breaker=CircuitBreakerOptions(failure_threshold=threshold, cooldown=timedelta(hours=1)),
    )


@queue("gateway2", **_breaker(1))
class Charge2(_Gateway):
    pass


@queue("flaky", **_breaker(5))
class Flaky(_Gateway):
    pass


def _gateway_app(harness, message: type[_Gateway]):
    """An app whose handler fails with a transient error unless the message says ``ok``."""
    app = harness.app()

    @app.handler(message, max_concurrency=1)
    async def call(msg: _Gateway) -> None:
        if not msg.ok:
            raise ConnectionError("down")

    return app


async def test_circuit_reset_lets_work_through_before_the_cooldown(harness):
    # the failing message is dead-lettered: after the reset only the good one is left
    app = _gateway_app(harness, Charge2)
    rt = await harness.runtime(app)
    bad = await app.enqueue(Charge2(ok=False))
    async with running(rt):
        await wait_until(lambda: _circuit(rt, "Charge2", "open"), what="open circuit")
        good = await app.enqueue(Charge2(ok=True))
        await asyncio.sleep(0.3)
        assert (await record(rt, good.message_id)).status != MessageStatus.SUCCEEDED
        await rt.control.reset_circuit("Charge2")
        await wait_until(lambda: all_have(rt, [good.message_id], MessageStatus.SUCCEEDED), what="after reset")
    assert (await record(rt, bad.message_id)).attempt >= 1


async def test_circuit_counts_only_consecutive_failures(harness):
    """Four failures, a success, four failures: a breaker that opens at five stays closed, because
    the success resets the count (on every control store: memory, SQL, Azure Tables)."""
    app = _gateway_app(harness, Flaky)
    rt = await harness.runtime(app)
    async with running(rt):
        for ok in [False] * 4 + [True] + [False] * 4:
            r = await app.enqueue(Flaky(ok=ok))  # one at a time: the order is the point
            want = MessageStatus.SUCCEEDED if ok else MessageStatus.DEAD_LETTERED
            await wait_until(lambda r=r, want=want: all_have(rt, [r.message_id], want), what=str(want))
    rt.control.invalidate()
    state = (await rt.control.state()).circuit("Flaky")
    assert (state.state, state.consecutive_failures) == ("closed", 4)


@queue("flaky_overlap", **_breaker(5))
class FlakyOverlap(QueueMessage):
    ok: bool
    slow: bool = False


async def test_a_success_that_overlapped_failures_resets_their_count(harness):
    """A success resets the count even when the failures came while it ran: the state read at its
    start showed none, and nothing was recorded, so four more failures opened a breaker of five."""
    app = harness.app()
    go = asyncio.Event()
    slow_started = asyncio.Event()

    @app.handler(FlakyOverlap, max_concurrency=2)
    async def call(msg: FlakyOverlap) -> None:
        if msg.slow:
            slow_started.set()
            await go.wait()
        if not msg.ok:
            raise ConnectionError("down")

    rt = await harness.runtime(app)
    async with running(rt):
        slow = await app.enqueue(FlakyOverlap(ok=True, slow=True))
        await asyncio.wait_for(slow_started.wait(), 30)
        for ok in [False] * 4:
            r = await app.enqueue(FlakyOverlap(ok=ok))
            await wait_until(
                lambda r=r: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="a failure"
            )
        go.set()
        await wait_until(
            lambda: all_have(rt, [slow.message_id], MessageStatus.SUCCEEDED), what="the slow success"
        )
        for _ in range(4):
            r = await app.enqueue(FlakyOverlap(ok=False))
            await wait_until(
                lambda r=r: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="a failure"
            )
    rt.control.invalidate()
    state = (await rt.control.state()).circuit("FlakyOverlap")
    assert (state.state, state.consecutive_failures) == ("closed", 4)


@queue("leased", lease_duration=timedelta(seconds=1), max_attempts=5, retry=FAST_RETRY)
class Leased(QueueMessage):
    key: str


async def _claim(rt, sub, message_id):
    """Receive until this message comes (the same provider, so the same process and worker id)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for d in await rt.provider.receive(sub, 10):
            assert d.envelope is not None
            assert d.envelope.message_id == message_id
            return d
        await rt.provider.wait_for_work(sub, 0.2)
    raise AssertionError(f"message {message_id} was not delivered")


async def _settle(rt, settlement):
    """Settle and record as a worker does, through its settler."""
    settler = Settler(rt)
    settler.start()
    settler.add(settlement)
    await settler.close()


STALE_VERDICTS = {
    "dead-letter": DeadLetter(DeadLetterReason.NON_RETRYABLE, "the stale run's verdict"),
    # a retry is a copy on most transports: the fence must hold before the copy is written
    "retry": RetryAfter(timedelta(milliseconds=10), "the stale run failed"),
}


@pytest.mark.parametrize(
    ("order", "verdict"),
    [("stale-first", "dead-letter"), ("live-first", "dead-letter"), ("stale-first", "retry")],
)
async def test_a_run_that_lost_its_lease_cannot_settle_over_the_live_run(harness, order, verdict):
    """The lease is lost (released by an operator, timed out, or its channel closed), the same
    process receives the message again, and the first run then settles: its outcome is refused,
    before or after the live run's success, which is what the transport and the history hold."""
    if harness.lose_lease is None:
        pytest.skip(f"no leases on {harness.name}: {harness.no_lease_reason}")
    app = harness.app()
    app.handler(Leased)(lambda msg: None)
    rt = await harness.runtime(app)
    sub = app.subscription("Leased")
    r = await app.enqueue(Leased(key="fenced"))
    stale = await _claim(rt, sub, r.message_id)
    await harness.lose_lease(rt, stale)
    live = await _claim(rt, sub, r.message_id)
    verdicts = [(stale, STALE_VERDICTS[verdict]), (live, Complete({"by": "the live run"}))]
    for d, decision in verdicts if order == "stale-first" else verdicts[::-1]:
        await _settle(rt, Settlement(d, decision))
    rec = await record(rt, r.message_id)
    assert (rec.status, rec.reason, rec.last_error) == (MessageStatus.SUCCEEDED, None, None)
    assert await harness.dead_letters(rt, sub.queue) == 0  # no dead-letter copy either
    await asyncio.sleep(sub.options.lease_duration.total_seconds() + 0.5)
    assert await rt.provider.receive(sub, 10) == []  # and no copy comes back to run again
    assert (stale.refused, live.refused) == (True, False)  # what the worker's log line says
    await rt.close()


async def test_max_concurrency_per_type(harness):
    app = harness.app()
    running_now, peak = 0, 0
    three_ran_together = asyncio.Event()

    @app.handler(max_concurrency=3)
    async def h(msg: Job):
        nonlocal running_now, peak
        running_now += 1
        peak = max(peak, running_now)
        if running_now >= 3:
            three_ran_together.set()
        # the first ones wait for the third (a stalled machine may start them far apart), so reaching
        # the limit does not depend on speed; a limit below three leaves the peak short after the wait
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(three_ran_together.wait(), 10)
        await asyncio.sleep(0.05)
        running_now -= 1

    rt = await harness.runtime(app)
    receipts = await app.enqueue_many([Job(key=str(i)) for i in range(15)])
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id for r in receipts], MessageStatus.SUCCEEDED),
            what="15 successes",
        )
    assert peak == 3


async def test_execution_time_limit_counts_failed_attempts(harness):
    app, calls = job_app(harness, time_limit=timedelta(milliseconds=100))
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="slow", sleep=5))
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED),
            timeout=60,
            what="dead letter after time limits",
        )
    assert [a for _, a in calls] == [1, 2, 3]
    assert "execution time limit of 0.1s exceeded" in ((await record(rt, r.message_id)).description or "")


async def test_graceful_shutdown_lets_in_flight_work_finish(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Job(key="finishing", sleep=0.4))
    async with running(rt, shutdown_timeout=30):
        await wait_until(lambda: len(calls) == 1, what="handler start")
    # leaving the block shut the worker down; the in-flight handler was allowed to finish
    assert (await record(rt, r.message_id)).status == MessageStatus.SUCCEEDED


async def test_shutdown_deadline_releases_work_for_the_next_worker_without_an_attempt(harness):
    app, calls = job_app(harness)
    provider = await harness.make_provider()
    rt = await harness.runtime(app, provider)
    r = await app.enqueue(Job(key="long", sleep=60))
    async with running(rt, shutdown_timeout=0.3):
        await wait_until(lambda: len(calls) == 1, what="handler start")
        t0 = time.monotonic()  # the shutdown starts as the block ends
    assert time.monotonic() - t0 < 30  # did not wait for the 60 s handler (a stalled machine is slow)
    rec = await record(rt, r.message_id)
    assert rec.status == MessageStatus.PENDING
    assert rec.attempt == 0
    # the next worker (same durable transport) takes it at once; the first attempt did not count
    app2, calls2 = job_app(harness)
    app2.naming = app.naming
    rt2 = await harness.runtime(app2, provider if harness.name == "inprocess" else None)
    await rt2.control.set_paused("queue", "nothing", False)
    async with running(rt2):
        await wait_until(lambda: len(calls2) == 1, what="second worker start")
    assert calls2 == [("long", 1)]


async def test_malformed_bytes_on_the_wire_are_dead_lettered_with_the_raw_kept(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    await harness.inject_raw(rt, "jobs", b"this is not an envelope")
    good = await app.enqueue(Job(key="fine"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [good.message_id], MessageStatus.SUCCEEDED), what="good one")

        async def poisoned():
            return [
                r
                for r in await find(rt, status=(MessageStatus.DEAD_LETTERED,))
                if r.reason == DeadLetterReason.MALFORMED_ENVELOPE.value
            ]

        await wait_until(poisoned, what="malformed dead letter")
    [rec] = await poisoned()
    assert "this is not an envelope" in (rec.raw or "")
    assert calls == [("fine", 1)]


async def test_a_malformed_message_is_listed_under_the_id_its_json_carried(harness):
    app, calls = job_app(harness)
    rt = await harness.runtime(app)
    if rt.provider.capabilities.durable_history:
        pytest.skip("SQL rows keep the id they were stored under; nothing arrives without one")
    carried = uuid.uuid4()
    # valid JSON, not a valid envelope (the body is not an object, fields are missing)
    bad = {"v": 1, "type": "Job", "queue": "jobs", "message_id": str(carried), "body": "not an object"}
    await harness.inject_raw(rt, "jobs", json.dumps(bad).encode())
    async with running(rt):
        await wait_until(lambda: all_have(rt, [carried], MessageStatus.DEAD_LETTERED), what="dead letter")
    rec = await record(rt, carried)
    assert rec.reason == DeadLetterReason.MALFORMED_ENVELOPE.value
    assert rec.type == "Job"
    assert json.loads(rec.raw or "") == bad
    async with ops_client(rt) as client:
        shown = (await client.get(f"/messages/{carried}")).json()
    assert (shown["message_id"], shown["type"], shown["status"]) == (str(carried), "Job", "DeadLettered")
    assert calls == []


async def test_one_consumer_at_a_time_keeps_enqueue_order(harness):
    if not harness.ordered:
        pytest.skip(f"{harness.name} does not promise order")

    @queue("ordered-q", ordered=True, max_attempts=5, retry=FAST_RETRY)
    class Step(QueueMessage):
        n: int

    app = harness.app()
    seen: list[int] = []
    failed_once = set()

    @app.handler()
    async def h(msg: Step):
        if msg.n == 3 and 3 not in failed_once:
            failed_once.add(3)
            raise RuntimeError("3 fails once; 4 must still wait for it")
        seen.append(msg.n)

    rt = await harness.runtime(app)
    receipts = await app.enqueue_many([Step(n=i) for i in range(8)])
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id for r in receipts], MessageStatus.SUCCEEDED), what="all steps"
        )
    assert seen == list(range(8))
