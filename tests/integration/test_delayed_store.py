"""The delayed-message store and its dispatcher on SQLite and PostgreSQL: the
store's operations, fetching under a lock, wake-ups, forwarding when due, failure counting into the
dead-letter queue, and the store/fetch/dispatch circuit breakers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest

from queueing_core import MessageStatus
from queueing_core.clock import utcnow
from queueing_core.envelope import REPEATED_FORWARD, Envelope
from queueing_core.errors import ProviderError, ProviderUnavailable
from queueing_core.naming import Transport
from queueing_core.providers.delayed import (
    FORWARD_FAILED,
    CircuitBreaker,
    DelayedDispatcher,
    DelayedMessage,
)
from queueing_core.providers.sql.history import SideStores
from queueing_core.tracking.base import record_from_envelope
from tests.contract.harness import wait_until
from tests.envelopes import an_envelope
from tests.services import POSTGRES_URL, drop_schema, require


@dataclass
class Db:
    url: str
    schema: str | None
    made: list[SideStores] = field(default_factory=list)

    def stores(self, **kw) -> SideStores:
        s = SideStores(self.url, schema=self.schema, **kw)
        self.made.append(s)
        return s


@pytest.fixture(params=["sqlite", "postgres"])
async def db(request, tmp_path):
    if request.param == "sqlite":
        d = Db(f"sqlite:///{tmp_path}/delayed.db", None)
        yield d
        for s in d.made:
            await s.close()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    d = Db(POSTGRES_URL, f"qd_{uuid.uuid4().hex[:10]}")
    yield d
    for s in d.made:
        await s.close()
    await drop_schema(d.schema)


def envelope(n: int = 0) -> Envelope:
    return an_envelope(body={"n": n})


@dataclass
class Target:
    """The transport side, recording what the dispatcher sends; ``fail`` decides per call."""

    fail: object = None  # None, an exception, or a callable returning one (or None)
    forwarded: list[tuple[DelayedMessage, datetime]] = field(default_factory=list)
    dead: list[tuple[DelayedMessage, str]] = field(default_factory=list)
    calls: int = 0

    async def forward_delayed(self, item: DelayedMessage) -> None:
        self.calls += 1
        exc = self.fail() if callable(self.fail) else self.fail
        if exc is not None:
            raise exc
        self.forwarded.append((item, utcnow()))

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        self.dead.append((item, description))


def asleep_after_first_look(dispatcher: DelayedDispatcher) -> list[int]:
    """Counts the dispatcher's looks for the next due time: once one has returned on an empty store it
    waits out ``max_idle`` unless woken (no fixed sleep that a loaded machine might not honour)."""
    looks: list[int] = []
    store = dispatcher.store
    next_due = store.next_due

    async def counted() -> datetime | None:
        due = await next_due()
        looks.append(1)
        return due

    store.next_due = counted  # type: ignore[method-assign]
    return looks


def listeners_of(store) -> list:
    """The LISTEN connections the dispatcher opens on this store's database, as it opens them."""
    made: list = []
    make = store.sql.listener

    def capture(channel: str):
        made.append(make(channel))
        return made[-1]

    store.sql.listener = capture
    return made


@contextlib.asynccontextmanager
async def dispatching(dispatcher: DelayedDispatcher):
    task = asyncio.create_task(dispatcher.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


# -- the store ---------------------------------------------------------------------------------------


async def test_store_fetch_remove_and_next_due(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    assert await store.next_due() is None
    now = utcnow()
    soon, later = envelope(n=1), envelope(n=2)
    first = await store.store(soon, "t-jobs", now - timedelta(seconds=1))
    await store.store(later, "t-jobs", now + timedelta(hours=1))
    assert abs((await store.next_due()) - (now - timedelta(seconds=1))) < timedelta(milliseconds=1)

    item = await store.fetch_next_due(now)
    assert item is not None
    assert item.id == first
    assert item.destination == "t-jobs"
    assert Envelope.decode(item.envelope) == soon
    assert item.failures == 0
    # taken: no other fetch gets it while it is being forwarded
    assert await store.fetch_next_due(now) is None

    assert await store.remove(first) is True
    assert await store.remove(first) is False  # already gone
    assert abs((await store.next_due()) - (now + timedelta(hours=1))) < timedelta(milliseconds=1)
    assert await store.counts() == {"t-jobs": 1}


async def test_transports_sharing_a_database_see_only_their_own_messages(db):
    stores = db.stores()
    rabbit, sqs = stores.delayed_store(Transport.RABBITMQ), stores.delayed_store(Transport.SQS)
    await sqs.store(envelope(), "q", utcnow() - timedelta(seconds=1))
    assert await rabbit.fetch_next_due() is None
    assert await rabbit.next_due() is None
    assert await sqs.fetch_next_due() is not None


async def test_failures_are_counted_and_the_message_comes_back_when_asked(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    now = utcnow()
    mid = await store.store(envelope(), "q", now - timedelta(seconds=1))
    item = await store.fetch_next_due(now)
    assert item is not None
    assert await store.increment_failure(item.id, error="boom", retry_at=now) is True
    again = await store.fetch_next_due(now)
    assert again is not None
    assert again.id == mid
    assert again.failures == 1
    assert again.last_error == "boom"
    assert await store.remove(mid) is True
    assert await store.increment_failure(mid) is False  # gone: nothing to count


async def test_two_fetchers_never_get_the_same_message(db):
    a = db.stores().delayed_store(Transport.RABBITMQ)
    b = db.stores().delayed_store(Transport.RABBITMQ)  # another engine: another host, say
    now = utcnow()
    ids = {await a.store(envelope(n=i), "q", now - timedelta(seconds=1)) for i in range(30)}
    taken: list[uuid.UUID] = []
    while True:
        # twenty fetches in flight at once, from both "hosts"
        got = await asyncio.gather(*(s.fetch_next_due(utcnow()) for s in [a, b] * 10))
        found = [g.id for g in got if g is not None]
        if not found:
            break
        taken += found
    assert len(taken) == len(set(taken)), "a message was handed to two fetchers"
    assert set(taken) == ids


# -- the dispatcher -------------------------------------------------------------------------------------


async def test_a_store_wakes_the_dispatcher_without_waiting_for_its_poll(db):
    stores = db.stores()
    store = stores.delayed_store(Transport.RABBITMQ)
    target = Target()
    dispatcher = DelayedDispatcher(store, target, max_idle=120)
    looks = asleep_after_first_look(dispatcher)
    async with dispatching(dispatcher):
        await wait_until(lambda: looks, timeout=30, what="the dispatcher asleep on an empty store")
        started = time.monotonic()
        await store.store(envelope(), "q", utcnow())
        await wait_until(lambda: target.forwarded, timeout=30, what="the forward")
    # woken, not polled: its poll would come two minutes later (the bound is wide for a loaded machine)
    assert time.monotonic() - started < 30
    assert await store.next_due() is None  # removed after the forward


async def test_a_store_from_another_process_wakes_the_dispatcher_through_notify(db):
    if db.schema is None:
        pytest.skip("SQLite has no NOTIFY: other processes are found by polling")
    store = db.stores().delayed_store(Transport.RABBITMQ)
    other = db.stores().delayed_store(Transport.RABBITMQ)  # no in-process link to the dispatcher
    target = Target()
    dispatcher = DelayedDispatcher(store, target, max_idle=120)
    looks = asleep_after_first_look(dispatcher)
    listeners = listeners_of(store)
    async with dispatching(dispatcher):
        await wait_until(
            lambda: listeners and listeners[0].connected.is_set() and looks,
            timeout=30,
            what="LISTEN up and the dispatcher asleep",
        )
        started = time.monotonic()
        await other.store(envelope(), "q", utcnow())
        await wait_until(lambda: target.forwarded, timeout=30, what="the forward")
    # woken by NOTIFY, not polled: its poll would come two minutes later
    assert time.monotonic() - started < 30


async def test_messages_are_forwarded_when_due_not_before(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    target = Target()
    dispatcher = DelayedDispatcher(store, target, max_idle=60)
    due = utcnow() + timedelta(milliseconds=700)
    async with dispatching(dispatcher):
        await store.store(envelope(n=1), "q", due)
        await store.store(envelope(n=2), "q", due + timedelta(milliseconds=300))
        await wait_until(lambda: len(target.forwarded) == 2, timeout=30, what="two forwards")
    for item, at in target.forwarded:
        assert at >= item.due_at
    assert [Envelope.decode(i.envelope).body["n"] for i, _ in target.forwarded] == [1, 2]
    assert dispatcher.forwarded == 2


async def test_repeated_forward_failures_move_the_message_to_the_error_queue(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    target = Target(fail=ProviderError("the destination refused it: message too large"))
    dispatcher = DelayedDispatcher(store, target, retries=3, retry_delay=timedelta(milliseconds=10))
    env = envelope()
    async with dispatching(dispatcher):
        await store.store(env, "q", utcnow())
        await wait_until(lambda: target.dead, timeout=30, what="the dead letter")
    [(item, description)] = target.dead
    assert Envelope.decode(item.envelope).message_id == env.message_id
    assert target.calls == 4  # the first forward and three retries
    assert description.startswith("4 forward(s) to q failed")
    assert "message too large" in description
    assert await store.next_due() is None  # it left the store
    assert dispatcher.dead_lettered == 1
    assert FORWARD_FAILED == "delayed-forward-failed"


async def test_a_stop_during_a_forward_finishes_the_batch_so_nothing_is_sent_twice(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    sent = asyncio.Event()

    class SlowAck(Target):
        async def forward_delayed(self, item: DelayedMessage) -> None:
            await super().forward_delayed(item)
            sent.set()
            await asyncio.sleep(0.2)  # the broker has it; its confirm is still on the way

    target = SlowAck()
    dispatcher = DelayedDispatcher(store, target, max_idle=60)
    async with dispatching(dispatcher):
        await store.store(envelope(), "q", utcnow())
        await asyncio.wait_for(sent.wait(), timeout=30)
    # the stop waited for the confirm and the removal: a restart will not forward it again
    assert len(target.forwarded) == 1
    assert await store.next_due() is None


async def test_an_unreachable_destination_does_not_use_up_the_messages_retries(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    outage = {"left": 5}

    def fail() -> Exception | None:
        if outage["left"]:
            outage["left"] -= 1
            return ProviderUnavailable("broker down")
        return None

    target = Target(fail=fail)
    dispatcher = DelayedDispatcher(store, target, retries=0, open_backoff=0.05)
    async with dispatching(dispatcher):
        await store.store(envelope(), "q", utcnow())
        await wait_until(lambda: target.forwarded, timeout=30, what="the forward after the outage")
    assert target.dead == []  # retries=0, yet the outage was not the message's fault
    assert target.calls == 6
    assert target.forwarded[0][0].failures == 0


async def test_a_forward_after_failed_ones_is_marked_as_a_possible_repeat(db):
    """A forward that raised may have reached the transport all the same (RabbitMQ: the broker took
    the publish and the confirm was lost): the next forward is marked, so a host that finds the
    outcome already recorded completes it without running the handler again. The claims used to be
    cleared on such a failure, and the repeat went unmarked (found in review)."""
    store = db.stores().delayed_store(Transport.RABBITMQ)
    errors = [ProviderUnavailable("confirm lost"), ProviderError("answer lost")]
    target = Target(fail=lambda: errors.pop(0) if errors else None)
    dispatcher = DelayedDispatcher(
        store, target, retries=3, retry_delay=timedelta(milliseconds=10), open_backoff=0.01
    )
    async with dispatching(dispatcher):
        sent = envelope()
        await store.store(sent, "q", utcnow())
        await wait_until(lambda: target.forwarded, timeout=30, what="the forward after two failures")
    [(item, _)] = target.forwarded
    forwarded = Envelope.decode(item.envelope)
    assert forwarded.message_id == sent.message_id
    assert forwarded.headers[REPEATED_FORWARD] == "2"
    assert dispatcher.repeated == 2  # the second try was marked too


async def test_dispatch_breaker_opens_after_continuous_failures_and_closes_on_recovery(db, caplog):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    await store.sql.ensure_open()  # the schema first: the outage under test is the broker's
    # the broker stays down until the test has seen the breaker open: no wall-clock outage that
    # a loaded machine could outlast before the first dispatch
    broker_up = asyncio.Event()
    target = Target(fail=lambda: None if broker_up.is_set() else ProviderUnavailable("broker down"))
    dispatcher = DelayedDispatcher(
        store, target, time_to_trigger_dispatch=timedelta(milliseconds=300), open_backoff=0.2
    )
    breaker = dispatcher.dispatch_breaker
    states: list[str] = []
    with caplog.at_level(logging.WARNING, logger="queueing.delayed"):
        async with dispatching(dispatcher):
            await store.store(envelope(), "q", utcnow())
            await wait_until(lambda: breaker.state == "open", timeout=30, what="the breaker to open")
            states.append(breaker.state)
            calls_when_open = target.calls
            await asyncio.sleep(0.3)
            # backing off: at most a couple of tries in 0.3 s, not a hammering loop
            assert target.calls - calls_when_open <= 3
            broker_up.set()
            await wait_until(lambda: target.forwarded, timeout=30, what="the forward after recovery")
    assert breaker.state == "closed"
    assert breaker.triggered == 1
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1
    assert "delayed store (dispatch) circuit breaker triggered" in critical[0].getMessage()
    assert any("circuit breaker closed" in r.getMessage() for r in caplog.records)


async def many_due(store, count: int) -> set[uuid.UUID]:
    now = utcnow()
    envs = [envelope(n=i) for i in range(count)]
    await store.store_many([(e, "q", now - timedelta(seconds=1)) for e in envs])
    return {e.message_id for e in envs}


async def test_the_dispatcher_probes_an_open_breaker_and_then_forwards_the_backlog(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    ids = await many_due(store, 100)
    broker_up = asyncio.Event()
    target = Target(fail=lambda: None if broker_up.is_set() else ProviderUnavailable("broker down"))
    dispatcher = DelayedDispatcher(
        store, target, batch=10, time_to_trigger_dispatch=timedelta(0), open_backoff=0.3, listen=False
    )
    async with dispatching(dispatcher):
        await wait_until(lambda: target.calls >= 10, timeout=30, what="the first batch")
        assert dispatcher.dispatch_breaker.state == "open"
        broker_up.set()
        await wait_until(lambda: len(target.forwarded) == 100, timeout=60, what="the backlog forwarded")
    assert dispatcher.dispatch_breaker.state == "closed"
    assert {Envelope.decode(i.envelope).message_id for i, _ in target.forwarded} == ids
    failed = target.calls - 100
    # the first batch and one probe per back-off, however long the test was held up meanwhile
    assert 10 <= failed < 60


async def test_messages_that_fail_on_their_own_do_not_hold_back_the_others(db):
    """Only an unreachable transport makes the dispatcher back off: a run of messages the destination
    refuses one by one (counted on each, then dead-lettered) opens the breaker all the same, but
    the backlog behind them is not slowed to a probe per back-off."""
    store = db.stores().delayed_store(Transport.RABBITMQ)
    await many_due(store, 30)
    healthy = envelope(n=99)
    await store.store(healthy, "q", utcnow())
    target = Target(fail=lambda: None if target.calls > 30 else ProviderError("refused: message too large"))
    dispatcher = DelayedDispatcher(
        store, target, batch=10, retries=0, time_to_trigger_dispatch=timedelta(0), open_backoff=3600
    )
    async with dispatching(dispatcher):
        await wait_until(lambda: target.forwarded, timeout=30, what="the message behind the refused ones")
    assert len(target.dead) == 30
    assert Envelope.decode(target.forwarded[0][0].envelope).message_id == healthy.message_id


async def test_store_and_fetch_breakers_open_on_an_unreachable_database_and_fail_fast(caplog):
    dead = SideStores("postgresql://postgres@127.0.0.1:1/test", connect_retries=0)
    store = dead.delayed_store(Transport.SQS)
    store.store_breaker.time_to_trigger = 0.2
    store.store_breaker.open_backoff = 30
    with caplog.at_level(logging.WARNING, logger="queueing.delayed"):
        deadline = time.monotonic() + 30
        while store.store_breaker.state != "open" and time.monotonic() < deadline:
            with pytest.raises(ProviderUnavailable):
                await store.store(envelope(), "q", utcnow() + timedelta(hours=1))
            await asyncio.sleep(0.05)
        assert store.store_breaker.state == "open"
        tried: list[int] = []
        ensure_open = store.sql.ensure_open

        async def counted_open() -> None:
            tried.append(1)
            await ensure_open()

        store.sql.ensure_open = counted_open  # type: ignore[method-assign]
        with pytest.raises(ProviderUnavailable, match="circuit breaker open"):
            await store.store(envelope(), "q", utcnow() + timedelta(hours=1))
        assert tried == []  # failed fast: the database was not tried (not a timing, which load skews)
        store.sql.ensure_open = ensure_open  # type: ignore[method-assign]

        dispatcher = DelayedDispatcher(
            store, Target(), time_to_trigger_fetch=timedelta(milliseconds=200), open_backoff=0.1, listen=False
        )
        async with dispatching(dispatcher):
            await wait_until(
                lambda: dispatcher.fetch_breaker.state == "open", timeout=30, what="fetch breaker"
            )
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert any("delayed store (store) circuit breaker triggered" in m for m in messages)
    assert any("delayed store (fetch) circuit breaker triggered" in m for m in messages)
    await dead.close()


async def test_dispatch_due_forwards_what_is_due_within_a_budget(db):
    store = db.stores().delayed_store(Transport.RABBITMQ)
    target = Target()
    dispatcher = DelayedDispatcher(store, target, batch=2)
    now = utcnow()
    for i in range(5):
        await store.store(envelope(n=i), "q", now - timedelta(seconds=1))
    await store.store(envelope(n=99), "q", now + timedelta(hours=1))
    assert await dispatcher.dispatch_due(60.0) == 5  # a budget a stalled machine cannot run out of
    assert sorted(Envelope.decode(i.envelope).body["n"] for i, _ in target.forwarded) == [0, 1, 2, 3, 4]
    assert await store.counts() == {"q": 1}


async def test_a_late_enqueue_record_does_not_replace_what_a_fast_worker_wrote(db):
    history = db.stores().history
    now = utcnow()
    outcomes = {
        MessageStatus.SUCCEEDED: {},
        MessageStatus.DEAD_LETTERED: {"reason": "NonRetryable"},
        MessageStatus.FAILED: {"last_error": "ValueError: later"},  # waiting for its retry
    }
    envs = {status: envelope() for status in outcomes}
    for status, fields in outcomes.items():
        await history.upsert([record_from_envelope(envs[status], status, now, **fields)])
    fresh = envelope()
    # the producer's records, written after the send: one per message, in one call
    await history.upsert(
        [record_from_envelope(e, MessageStatus.PENDING, now) for e in [*envs.values(), fresh]]
    )
    for status, env in envs.items():
        assert (await history.get(env.message_id)).status == status
    assert (await history.get(fresh.message_id)).status == MessageStatus.PENDING


def test_circuit_breaker_semantics_follow_seed_004():
    now = [0.0]
    b = CircuitBreaker("x", timedelta(seconds=30), open_backoff=10, clock=lambda: now[0])
    assert b.failure(RuntimeError("a")) < 1  # failing, not yet triggered: a short back-off
    assert b.state == "failing"
    now[0] = 29.0
    b.failure(RuntimeError("b"))
    assert b.state == "failing"  # not for longer than the time to trigger yet
    now[0] = 31.0
    assert b.failure(RuntimeError("c")) == 10
    assert b.state == "open"
    assert b.blocked() == pytest.approx(10)
    b.success()
    assert (b.state, b.failures, b.blocked()) == ("closed", 0, 0.0)
    # a success in between starts the clock again
    b.failure(RuntimeError("d"))
    now[0] = 50.0
    b.success()
    b.failure(RuntimeError("e"))
    now[0] = 75.0
    b.failure(RuntimeError("f"))
    assert b.state == "failing"
