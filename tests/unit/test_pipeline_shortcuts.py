"""What the per-message shortcuts of the worker's path must not change: each one skips work the
pipeline used to do for every message, and each test here pins down the case where that work matters
(a middleware or hook added while messages run, a time limit or none, a log line, a progress report,
a pause, a provider that settles with its claims only sometimes, an outcome line at a level)."""

import asyncio
import json
import logging
from datetime import UTC, datetime, timedelta

from queueing_core import (
    Complete,
    Defer,
    Event,
    MessageStatus,
    QueueingApp,
    QueueMessage,
    Release,
    RetryAfter,
    queue,
)
from queueing_core.control import CachedControlStore, MemoryControlStore
from queueing_core.decisions import DeadLetter, DeadLetterReason
from queueing_core.pipeline import Pipeline, decode_message, fit_result
from queueing_core.producer import Producer
from queueing_core.runtime import log_outcome
from queueing_core.transport import Capabilities, Delivery, Settlement
from queueing_core.worker import _combined

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)


@queue("shortcut-jobs", max_attempts=3)
class Job(QueueMessage):
    n: int = 0


class _NullProvider:
    capabilities = Capabilities()


def make(app: QueueingApp, control=None) -> tuple[Pipeline, Producer]:
    pipe = Pipeline(app, control or MemoryControlStore(), clock=lambda: T0, rand=lambda: 0.5)
    return pipe, Producer(app, _NullProvider(), clock=lambda: T0)


def delivery(prod: Producer, msg: QueueMessage, attempt: int = 1) -> Delivery:
    env = prod.envelope_for(msg)
    return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=attempt)


async def test_a_middleware_added_after_messages_ran_wraps_the_next_ones_and_one_removed_stops():
    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Job) -> dict[str, int]:
        return {"n": msg.n}

    assert await pipe.process(delivery(prod, Job(n=1))) == Complete({"n": 1})  # the chain is built now
    trail: list[int] = []

    async def late(ctx, call_next):
        trail.append(ctx.message.n)
        return {**(await call_next()), "wrapped": True}

    app.use_handle_middleware(late)
    assert await pipe.process(delivery(prod, Job(n=2))) == Complete({"n": 2, "wrapped": True})
    assert trail == [2]
    app.handle_middleware.remove(late)
    assert await pipe.process(delivery(prod, Job(n=3))) == Complete({"n": 3})
    assert trail == [2]


async def test_a_hook_registered_after_messages_ran_observes_the_next_ones_and_async_ones_are_awaited():
    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    await pipe.process(delivery(prod, Job()))
    seen: list[tuple[Event, bool]] = []

    async def record(obs) -> None:
        await asyncio.sleep(0)
        seen.append((obs.event, obs.duration is not None))

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def plain(obs):
        return record(obs)  # a plain function handing back an awaitable: awaited like an async hook

    await pipe.process(delivery(prod, Job()))
    # the run's duration goes with its outcome, not with its start
    assert seen == [(Event.BEGAN, False), (Event.SUCCEEDED, True)]
    app.hooks.off(plain)
    await pipe.process(delivery(prod, Job()))
    assert len(seen) == 2


async def test_an_outcome_decided_before_the_handler_has_no_duration():
    @queue("shortcut-expiring", expiration=timedelta(seconds=1))
    class Expiring(QueueMessage):
        pass

    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Expiring) -> None:
        raise AssertionError("an expired message never runs")

    seen = []
    app.hooks.on(Event.EXPIRED)(seen.append)
    env = prod.envelope_for(Expiring()).model_copy(update={"expires_at": T0 - timedelta(seconds=1)})
    await pipe.process(Delivery(env.queue, env.encode(), env, None, 1))
    assert [(o.event, o.duration) for o in seen] == [(Event.EXPIRED, None)]


async def test_without_a_time_limit_a_timeout_the_handler_raises_is_its_own_failure():
    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Job) -> None:
        raise TimeoutError("the payment service did not answer")

    d = await pipe.process(delivery(prod, Job()))
    assert isinstance(d, RetryAfter)
    assert d.error.startswith("TimeoutError: the payment service did not answer")
    assert "execution time limit" not in d.error


async def test_with_a_time_limit_an_early_timeout_of_the_handler_is_not_the_limit():
    @queue("shortcut-limited", time_limit=timedelta(seconds=60), max_attempts=2)
    class Limited(QueueMessage):
        pass

    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Limited) -> None:
        raise TimeoutError("upstream")

    d = await pipe.process(delivery(prod, Limited()))
    assert isinstance(d, RetryAfter)
    assert d.error.startswith("TimeoutError: upstream")


async def test_ctx_log_carries_the_message_ids_and_its_fields_can_be_replaced(caplog):
    app = QueueingApp()
    pipe, prod = make(app)
    logs = []

    @app.handler()
    async def handle(msg: Job, ctx) -> None:
        logs.append(dict(ctx.log.extra))
        ctx.log.info("working on %s", msg.n)
        ctx.log.extra = {"queue": "mine"}
        ctx.log.info("again")

    msg = Job(n=5, correlation_id="corr-9")
    with caplog.at_level(logging.INFO, logger="queueing.handler"):
        assert isinstance(await pipe.process(delivery(prod, msg)), Complete)
    first, second = (r for r in caplog.records if r.name == "queueing.handler")
    assert first.getMessage() == "working on 5"
    assert (first.message_id, first.correlation_id, first.queue) == (
        str(msg.message_id),
        "corr-9",
        "shortcut-jobs",
    )
    assert logs == [{"message_id": str(msg.message_id), "correlation_id": "corr-9", "queue": "shortcut-jobs"}]
    assert second.queue == "mine"
    assert not hasattr(second, "message_id")


async def test_the_last_progress_report_is_stored_when_the_run_ends_and_none_without_a_report(monkeypatch):
    # an interval a loaded machine cannot outlast between two reports, so the second is always the one
    # left for the end (not longer: the first report is stored once the monotonic clock is past it)
    monkeypatch.setattr("queueing_core.context.PROGRESS_INTERVAL", 60.0)
    app = QueueingApp()
    pipe, prod = make(app)
    stored: list[dict] = []

    async def sink(delivery, progress) -> None:
        stored.append(progress)

    pipe.progress_sink = sink

    @app.handler()
    async def handle(msg: Job, ctx) -> None:
        if msg.n:
            await ctx.report_progress(1, 3)  # stored at once (the first report)
            await ctx.report_progress(2, 3)  # within the interval: kept for the end of the run

    await pipe.process(delivery(prod, Job(n=0)))
    assert stored == []
    await pipe.process(delivery(prod, Job(n=1)))
    assert [p["step"] for p in stored] == [1, 2]


async def test_a_pause_through_the_cached_store_reaches_the_next_message_and_a_lapsed_cache_is_read():
    app = QueueingApp()
    inner = MemoryControlStore()
    cached = CachedControlStore(inner, ttl=3600)
    pipe, prod = make(app, cached)

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    assert isinstance(await pipe.process(delivery(prod, Job())), Complete)  # the state is cached now
    await cached.set_paused("queue", "shortcut-jobs", True)
    d = await pipe.process(delivery(prod, Job()))
    assert isinstance(d, Defer)
    assert d.status is MessageStatus.PAUSED
    await inner.set_paused("queue", "shortcut-jobs", False)  # behind the cache's back: not seen yet
    assert isinstance(await pipe.process(delivery(prod, Job())), Defer)
    cached.ttl = 0  # the cache lapses: the next message reads the store again
    assert isinstance(await pipe.process(delivery(prod, Job())), Complete)


async def test_a_free_slot_is_not_taken_once_the_host_is_closing():
    app = QueueingApp()
    pipe, prod = make(app)
    ran = []

    @app.handler()
    async def handle(msg: Job) -> None:
        ran.append(msg.n)

    closing = asyncio.Event()
    assert isinstance(await pipe.process(delivery(prod, Job(n=1)), closing=closing), Complete)
    closing.set()  # every slot is free, and still nothing starts
    d = await pipe.process(delivery(prod, Job(n=2)), closing=closing)
    assert isinstance(d, Release)
    assert d.reason == "host shutting down before the handler started"
    assert ran == [1]
    assert not pipe.limiter(app.subscription(Job.type_name())).locked()  # no slot kept


def test_fit_result_keeps_none_and_dumps_everything_else():
    assert fit_result(None) is None
    assert fit_result(0) == 0
    assert fit_result(Job(n=2))["n"] == 2


class _Combining:
    """A provider that offers settling with its claims only while ``on`` is set."""

    def __init__(self) -> None:
        self.on = False

    def settles_with_claims(self) -> bool:
        return self.on

    async def settle_and_receive(self, settlements, sub, max_messages):
        return []


def test_a_provider_is_asked_each_time_whether_it_settles_with_its_claims_now():
    provider = _Combining()
    assert not _combined(provider)
    provider.on = True
    assert _combined(provider)
    provider.on = False
    assert not _combined(provider)
    assert not _combined(_NullProvider())  # no combined call at all


class _HandsOn:
    """A provider that hands its attributes on to another (its class has no combined call)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_provider_that_hands_on_its_attributes_is_asked_itself():
    inner = _Combining()
    inner.on = True
    assert _combined(_HandsOn(inner))
    inner.on = False
    assert not _combined(_HandsOn(inner))
    assert not _combined(_HandsOn(_NullProvider()))


def _settlement(prod: Producer, decision, *, refused: bool = False) -> Settlement:
    d = delivery(prod, Job())
    d.refused = refused
    return Settlement(d, decision)


def test_outcome_lines_keep_their_levels_and_skip_only_what_nobody_logs(caplog):
    app = QueueingApp()
    app.handler()(_noop)
    _, prod = make(app)
    dead = DeadLetter(DeadLetterReason.NON_RETRYABLE, "no way\nsecond line")
    with caplog.at_level(logging.WARNING, logger="queueing.outcome"):
        log_outcome(_settlement(prod, Complete()))  # INFO: not logged at WARNING
        log_outcome(_settlement(prod, RetryAfter(timedelta(seconds=3), "boom\nframes")))
        log_outcome(_settlement(prod, dead))
        log_outcome(_settlement(prod, dead, refused=True))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "queueing.outcome"]
    assert lines == [
        (logging.WARNING, f"Failed {Job.type_name()} retry in 3.0s: boom"),
        (logging.ERROR, f"DeadLettered {Job.type_name()} non-retryable: no way"),
        (logging.WARNING, f"DeadLettered {Job.type_name()} not applied: the lease had passed to another run"),
    ]


async def _noop(msg: Job) -> None:
    return None


@queue("shortcut-identities", idempotent=True, identity="key", max_concurrency=1)
class Keyed(QueueMessage):
    key: str = "k"


async def test_a_handler_cancelled_while_its_previous_version_is_read_gives_its_slot_back():
    app = QueueingApp()
    pipe, prod = make(app)
    entered, never = asyncio.Event(), asyncio.Event()

    async def slow_lookup(sub, message):
        entered.set()
        await never.wait()  # a database that does not answer; the run is cancelled meanwhile

    pipe.previous_lookup = slow_lookup

    @app.handler()
    async def handle(msg: Keyed) -> None:
        return None

    run = asyncio.create_task(pipe.process(delivery(prod, Keyed())))
    await asyncio.wait_for(entered.wait(), 30)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    # the one slot of this type is free again: with it kept, every later message would wait for ever
    assert not pipe.limiter(app.subscription(Keyed.type_name())).locked()


async def test_a_middleware_swapped_for_an_equal_but_different_one_is_the_one_that_runs():
    app = QueueingApp()
    pipe, prod = make(app)

    class Tag:
        """Equal to every other Tag (as a dataclass with compare=False state would be)."""

        def __init__(self) -> None:
            self.seen: list[int] = []

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Tag)

        __hash__ = object.__hash__

        async def __call__(self, ctx, call_next):
            self.seen.append(ctx.message.n)
            return await call_next()

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    first, second = Tag(), Tag()
    app.use_handle_middleware(first)
    await pipe.process(delivery(prod, Job(n=1)))
    app.handle_middleware[0] = second
    await pipe.process(delivery(prod, Job(n=2)))
    assert (first.seen, second.seen) == ([1], [2])


async def test_a_worker_whose_slots_are_all_taken_stops_at_its_deadline():
    # the consumer of a full worker waits on its slot event alone (no task to watch for the stop):
    # the shutdown has to wake it, or it would wait for a handler that never ends
    from queueing_core.providers.inprocess import InProcessProvider
    from queueing_core.runtime import Runtime
    from queueing_core.worker import Worker

    app = QueueingApp()
    started, never = asyncio.Event(), asyncio.Event()

    @app.handler(max_concurrency=1)
    async def handle(msg: Job) -> None:
        started.set()
        await never.wait()

    rt = Runtime(app, InProcessProvider())
    await rt.open()
    try:
        await app.enqueue(Job(n=1))
        worker = Worker(rt, shutdown_timeout=0.1, prefetch=1, schedules=False)
        await worker.start()
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.sleep(0.05)  # the consumer is in its wait for a slot now
        # (a bound so a broken wake-up fails the test instead of hanging it)
        await asyncio.wait_for(worker.shutdown(), 10)
        assert worker.in_flight == 0
    finally:
        await rt.close()


async def test_hooks_run_in_order_and_the_pipeline_waits_for_one_that_returns_an_awaitable():
    # the pipeline only awaits when a hook returned something to await (``Hooks.notify``)
    app = QueueingApp()
    pipe, prod = make(app)
    trail: list[str] = []

    @app.handler()
    async def handle(msg: Job) -> None:
        trail.append("handler")

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def first(obs):
        trail.append(f"first {obs.event.value}")

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def slow(obs):
        async def later() -> None:
            await asyncio.sleep(0.01)
            trail.append(f"slow {obs.event.value}")

        return later()

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def broken(obs):
        raise RuntimeError("a hook that fails is logged and ignored")

    @app.hooks.on(Event.BEGAN, Event.SUCCEEDED)
    def last(obs):
        trail.append(f"last {obs.event.value}")

    assert await pipe.process(delivery(prod, Job(n=1))) == Complete(None)
    assert trail == [
        "first began",
        "slow began",
        "last began",
        "handler",
        "first succeeded",
        "slow succeeded",
        "last succeeded",
    ]


async def test_many_hooks_that_return_awaitables_run_one_after_another_without_nesting():
    # each awaitable hook is awaited in one loop: a chain of them does not grow the stack (a thousand
    # once raised RecursionError out of the pipeline, and the message never ran)
    app = QueueingApp()
    pipe, prod = make(app)
    ran: list[int] = []

    @app.handler()
    async def handle(msg: Job) -> None:
        ran.append(-1)

    def awaitable_hook(n: int):
        def hook(obs):
            async def later() -> None:
                ran.append(n)

            return later()

        return hook

    for n in range(3000):
        app.hooks.on(Event.BEGAN)(awaitable_hook(n))
    assert await pipe.process(delivery(prod, Job(n=1))) == Complete(None)
    assert ran == [*range(3000), -1]


def test_a_body_that_carries_base_fields_gets_the_envelopes_instead():
    # a body the kit writes has none (copied whole); one that has them (written by hand, or by an older
    # sender) has them replaced by the envelope's own values
    app = QueueingApp()

    @app.handler()
    async def handle(msg: Job) -> None: ...

    _, prod = make(app)
    env = prod.envelope_for(Job(n=7))
    forged = env.model_copy(
        update={
            "body": {**env.body, "message_id": "not-an-id", "properties": {"x": "y"}, "correlation_id": "z"}
        }
    )
    msg = decode_message(app.subscription("Job"), forged)
    assert (msg.n, msg.message_id, msg.properties, msg.correlation_id) == (
        7,
        env.message_id,
        env.headers,
        env.correlation_id,
    )


def test_a_time_out_of_range_in_utc_makes_a_malformed_delivery_not_a_failed_receive():
    app = QueueingApp()
    _, prod = make(app)
    doc = json.loads(prod.envelope_for(Job(n=1)).encode())
    doc["created_at"] = "0001-01-01T00:00:00+05:00"
    got = Delivery.of(json.dumps(doc).encode(), queue="shortcut-jobs")
    assert got.envelope is None
    assert got.malformed is not None


async def test_the_tally_counts_every_outcome_and_wait_without_a_hook_of_its_own():
    """``GET metrics``' handled messages and waiting times are counted by the pipeline itself: an app
    whose hooks observe nothing costs no hook event per message, and every outcome is still counted,
    those decided before a handler runs included; a hook registered by the user still sees each event."""
    from queueing_core.throughput import Throughput

    @queue("shortcut-tally", max_attempts=1, expiration=timedelta(hours=1))
    class Tallied(QueueMessage):
        fail: bool = False

    app = QueueingApp()
    pipe, prod = make(app)

    @app.handler()
    async def handle(msg: Tallied) -> None:
        if msg.fail:
            raise RuntimeError("boom")

    tally = Throughput.of(app.hooks)  # (what a runtime of the app reads for ``GET metrics``)
    assert pipe.tally is tally
    assert not any(app.hooks.wants(e) for e in Event)  # (nothing observes: no Observation per message)
    sent = prod.envelope_for(Tallied()).model_copy(update={"created_at": T0 - timedelta(seconds=3)})
    await pipe.process(Delivery(sent.queue, sent.encode(), sent, None, 1))
    failing = prod.envelope_for(Tallied(fail=True))
    await pipe.process(Delivery(failing.queue, failing.encode(), failing, None, 1))
    stale = prod.envelope_for(Tallied()).model_copy(update={"expires_at": T0 - timedelta(seconds=1)})
    await pipe.process(Delivery(stale.queue, stale.encode(), stale, None, 1))
    assert dict(tally.handled) == {
        ("shortcut-tally", "succeeded"): 1,
        ("shortcut-tally", "dead_lettered"): 1,
        ("shortcut-tally", "expired"): 1,
    }
    lag = tally.lag["shortcut-tally"]
    assert (lag.count, lag.total, lag.last) == (2, 3.0, 0.0)  # (waited 3 s, then none: created at T0)
    seen: list[Event] = []
    app.hooks.on()(lambda obs: seen.append(obs.event))
    await pipe.process(Delivery(sent.queue, sent.encode(), sent, None, 1))
    assert seen == [Event.BEGAN, Event.SUCCEEDED]
    assert tally.handled[("shortcut-tally", "succeeded")] == 2
