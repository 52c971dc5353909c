"""While a circuit is half-open, only the probe that is out decides: a failure of any other run (a
probe that outlived ``probe_timeout`` and was replaced, or a run admitted before the circuit opened)
neither reopens it nor keeps the live probe's success from closing it. On memory, SQLite and
PostgreSQL, and through the pipeline."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, RetryAfter, queue
from queueing_core.control import MemoryControlStore
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.providers.sql import SqlProvider
from queueing_core.transport import Delivery
from tests.clocks import ManualClock, NullProvider
from tests.services import POSTGRES_URL, drop_schema, require

OPTS = CircuitBreakerOptions(
    failure_threshold=1, cooldown=timedelta(seconds=30), probe_timeout=timedelta(minutes=1)
)
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryControlStore()
        return
    if request.param == "sqlite":
        provider = SqlProvider(f"sqlite:///{tmp_path}/control.db")
        yield provider.control_store()
        await provider.close()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qi_{uuid.uuid4().hex[:10]}"
    provider = SqlProvider(POSTGRES_URL, schema=schema)
    yield provider.control_store()
    await provider.close()
    await drop_schema(schema)


async def _two_probes(store) -> tuple[datetime, datetime]:
    """Open, probe A, and probe B once A outlived probe_timeout: (A's, B's) acquired-until times."""
    await store.record_failure("T", OPTS, T0)
    a = T0 + OPTS.cooldown
    assert await store.acquire_probe("T", OPTS, a)
    b = a + OPTS.probe_timeout
    assert await store.acquire_probe("T", OPTS, b)
    return a + OPTS.probe_timeout, b + OPTS.probe_timeout


async def test_a_replaced_probe_s_late_failure_leaves_the_live_probe_to_decide(store):
    """Before the fix A's failure reopened the circuit for a new cooldown, and B's success, no longer
    the probe out, left it open."""
    held_a, held_b = await _two_probes(store)
    await store.record_failure("T", OPTS, held_a + timedelta(seconds=5), held_a)  # A, late
    state = (await store.state()).circuit("T")
    assert (state.state, state.probe_until, state.consecutive_failures) == ("half_open", held_b, 1)
    assert (await store.record_success("T", held_b)).state == "closed"


async def test_a_failure_of_a_run_that_was_not_a_probe_leaves_a_half_open_circuit(store):
    held_a, held_b = await _two_probes(store)
    await store.record_failure("T", OPTS, held_a + timedelta(seconds=5))  # admitted before it opened
    assert (await store.state()).circuit("T").state == "half_open"
    assert (await store.record_success("T", held_b)).state == "closed"


async def test_the_probe_that_is_out_still_reopens_it(store):
    _, held_b = await _two_probes(store)
    at = held_b - timedelta(seconds=10)
    await store.record_failure("T", OPTS, at, held_b)
    state = (await store.state()).circuit("T")
    assert (state.state, state.open_until, state.probe_until) == ("open", at + OPTS.cooldown, None)


# --- through the pipeline -----------------------------------------------------------------------


@queue("late-failures", max_attempts=100, circuit_breaker=OPTS)
class Call(QueueMessage):
    n: int


async def test_a_run_admitted_before_the_circuit_opened_fails_while_a_probe_is_out():
    """A slow run admitted while closed fails while the probe is out: the circuit stays half-open, and
    the probe's success closes it (before the fix the slow run's failure reopened it for a new
    cooldown, and the probe's success was then ignored)."""
    app, clock, control = QueueingApp(), ManualClock(T0), MemoryControlStore()
    slow_may_fail = asyncio.Event()

    @app.handler()
    async def call(msg: Call):
        if msg.n == 0:
            raise ConnectionError("down")  # opens the circuit (threshold 1)
        if msg.n == 1:
            await slow_may_fail.wait()
            raise ConnectionError("down, seen late")
        return None  # the probe: the downstream is back

    pipe = Pipeline(app, control, clock=clock, rand=lambda: 0.5)
    prod = Producer(app, NullProvider(), clock=clock)

    def delivery(n: int) -> Delivery:
        env = prod.envelope_for(Call(n=n))
        return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)

    slow = asyncio.create_task(pipe.process(delivery(1)))  # admitted while closed
    await asyncio.sleep(0)
    assert isinstance(await pipe.process(delivery(0)), RetryAfter)
    assert (await control.state()).circuit("Call").state == "open"
    clock.now = T0 + OPTS.cooldown + timedelta(seconds=1)
    assert await control.acquire_probe("Call", OPTS, clock.now)  # a probe out (another host's)
    slow_may_fail.set()
    assert isinstance(await slow, RetryAfter)
    state = (await control.state()).circuit("Call")
    assert state.state == "half_open"
    assert (await control.record_success("Call", clock.now + OPTS.probe_timeout)).state == "closed"


async def test_a_failing_probe_through_the_pipeline_reopens_it():
    app, clock, control = QueueingApp(), ManualClock(T0), MemoryControlStore()

    @app.handler()
    async def call(msg: Call):
        raise ConnectionError("down")

    pipe = Pipeline(app, control, clock=clock, rand=lambda: 0.5)
    prod = Producer(app, NullProvider(), clock=clock)

    def delivery(n: int) -> Delivery:
        env = prod.envelope_for(Call(n=n))
        return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)

    await pipe.process(delivery(0))
    clock.now = T0 + OPTS.cooldown + timedelta(seconds=1)
    assert isinstance(await pipe.process(delivery(1)), RetryAfter)  # the probe, failing
    state = (await control.state()).circuit("Call")
    assert (state.state, state.open_until) == ("open", clock.now + OPTS.cooldown)
