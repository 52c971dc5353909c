"""RabbitMQ's count of redelivered hand-outs (the kit's own, in the side database) is kept per
published copy and proves only what it can: a new copy (a handler's "run again later", an operator's
retry) starts its own count; a first redelivery that a stop or a pause sends on as a copy does not pass
its unproven attempt on; a side database that is locked does not hold up the receive. Each failed on
the first version of the count (found in review). Real broker (RabbitMQ at 127.0.0.1:5672)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, RetryPolicy, queue
from queueing_core.decisions import Defer, Release
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require


@queue("Final.Sleeper", max_attempts=2, retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0))
class Sleeper(QueueMessage):
    n: int


@queue("Final.OneShot", max_attempts=1, retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0))
class FinalOneShot(QueueMessage):
    n: int


def _rabbit(tmp_path, prefix: str, calls: list):
    from queueing_core.providers.rabbitmq import RabbitMQProvider
    from queueing_core.providers.sql.history import SideStores

    app = QueueingApp("review-final", naming=QueueNaming(prefix=prefix))

    @app.handler(max_concurrency=4)
    async def sleeper(msg: Sleeper, ctx) -> None:
        calls.append(("sleeper", msg.n, ctx.attempt))

    @app.handler(max_concurrency=4)
    async def oneshot(msg: FinalOneShot, ctx) -> None:
        calls.append(("oneshot", msg.n, ctx.attempt))

    stores = SideStores(f"sqlite:///{tmp_path}/{prefix}side.db")
    provider = RabbitMQProvider(RABBITMQ_URL, stores=stores, idle_timeout=30, reconnect_interval=0.5)
    return app, Runtime(app, provider, control_ttl=0.05)


async def _one(provider, sub):
    """The next delivery the provider hands out (the consumer's buffer filled by the broker)."""
    for _ in range(100):
        got = await provider.receive(sub, 1)
        if got:
            assert len(got) == 1
            return got[0]
        await provider.wait_for_work(sub, 0.2)
    raise AssertionError("nothing delivered")


async def _settled(rt: Runtime, message_id) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status in (MessageStatus.SUCCEEDED, MessageStatus.DEAD_LETTERED)


async def test_a_sleeping_messages_redeliveries_in_separate_cycles_do_not_add_up(tmp_path):
    """A handler that returns a time ("run again later") settles as Defer(reset_attempts=True): the copy
    carries attempt 0 and the same message id, so every cycle's copy has the same redelivery key
    ``<id>/0``. Each cycle here runs fine; only once per cycle a consumer dies holding the copy (the
    broker marks it redelivered, the next consumer runs it and it sleeps again). The counts of the
    earlier cycles' redeliveries were added to the new cycle's first redelivery, which then read as
    proof that the attempts were used by runs: the message was dead-lettered without running, though
    no copy was ever redelivered more than once. Each copy has its own count now."""
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    calls: list = []
    app, rt = _rabbit(tmp_path, prefix, calls)
    await rt.open()
    try:
        sent = await app.enqueue(Sleeper(n=1))
        sub = app.subscription("Sleeper")
        provider = rt.provider
        # cycle 1: a consumer dies holding the copy (broker requeues it, redelivered); the next one runs
        # it and the handler asks to run again later: the kit's Defer with fresh attempts
        first = await _one(provider, sub)
        assert not first.handle.message.redelivered
        await first.handle.message.nack(requeue=True)  # what a consumer's death does, to the broker
        again = await _one(provider, sub)
        assert again.handle.message.redelivered
        assert not again.runs_counted
        now = provider.clock()
        sleep = Defer(now, MessageStatus.SLEEPING, "handler asked to run again later", reset_attempts=True)
        await provider.settle([Settlement(again, sleep)])
        # cycle 2: the new copy (attempt 0, same id) is taken by a consumer that dies; the worker then
        # gets its first (and only) redelivery
        second = await _one(provider, sub)
        assert second.envelope.attempt == 0
        assert not second.handle.message.redelivered
        await second.handle.message.nack(requeue=True)
        async with running(rt):
            await wait_until(lambda: _settled(rt, sent.message_id), what="settled")
        rec = await rt.tracker.get(sent.message_id)
        assert calls, (
            f"a copy redelivered once was {rec.status} without running: {rec.reason}: {rec.description}"
        )
        assert rec.status == MessageStatus.SUCCEEDED
    finally:
        await rt.close()


async def test_a_buffered_redelivery_released_at_a_stop_still_runs_on_its_next_delivery(
    tmp_path,
):
    """A first redelivery is not proof of a run (the message may only have sat in the buffer of a
    consumer whose connection dropped), so a max_attempts=1 message still runs. When that delivery was
    released (a stop: the pipeline gives back what has not started) or deferred (a pause), the copy's
    envelope carried the attempt the redelivery counted, and the copy, delivered fresh, read as runs
    counted: attempt 2 of 1, dead-lettered without ever having run. The copy keeps the envelope's."""
    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    calls: list = []
    app, rt = _rabbit(tmp_path, prefix, calls)
    await rt.open()
    try:
        sent = await app.enqueue(FinalOneShot(n=1))
        sub = app.subscription("FinalOneShot")
        provider = rt.provider
        physical = provider.physical(sub.queue)
        await provider.receive(sub, 0)  # the consumer starts; the broker pushes the message to its buffer
        await wait_until(lambda: len(provider._consumers[physical].buffer) == 1, what="prefetch")
        await provider._conn.transport.connection.close()  # a network blip: requeued, redelivered
        await wait_until(lambda: provider._conn.connected.is_set(), what="reconnected")
        d = await _one(provider, sub)
        assert d.handle.message.redelivered
        assert not d.runs_counted
        assert d.attempt == 2
        # the worker stops before it starts the run: the pipeline's Release (no attempt counted)
        await provider.settle([Settlement(d, Release("the worker is stopping"))])
        await asyncio.sleep(0.2)
        async with running(rt):
            await wait_until(lambda: _settled(rt, sent.message_id), what="settled")
        rec = await rt.tracker.get(sent.message_id)
        assert calls, f"a message that never ran was {rec.status}: {rec.reason}: {rec.description}"
        assert rec.status == MessageStatus.SUCCEEDED
    finally:
        await rt.close()


async def test_an_operator_retry_after_a_crash_loop_runs_after_one_redelivery(tmp_path):
    """The same collision by an operator's retry: a message dead-lettered by the crash-loop count (its
    key ``<id>/0`` holds 2) is retried after the fix is deployed; the retry's copy carries attempt 0 and
    the same id. One consumer death (or one dropped connection with it buffered) within the day the
    count was kept, and its first redelivery inherited the old count: dead-lettered again, unrun."""
    from queueing_core.ops import OpsService

    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    calls: list = []
    app, rt = _rabbit(tmp_path, prefix, calls)
    await rt.open()
    try:
        sent = await app.enqueue(Sleeper(n=2))  # max_attempts=2
        sub = app.subscription("Sleeper")
        provider = rt.provider
        # the crash loop: each consumer dies holding it; the third hand-out is dead-lettered unrun
        d = await _one(provider, sub)
        await d.handle.message.nack(requeue=True)
        d = await _one(provider, sub)  # first redelivery (counted 1): would run, and dies
        await d.handle.message.nack(requeue=True)
        async with running(rt):  # second redelivery: past its attempts, dead-lettered (as designed)
            await wait_until(lambda: _settled(rt, sent.message_id), what="dead-lettered")
        assert (await rt.tracker.get(sent.message_id)).status == MessageStatus.DEAD_LETTERED
        assert not calls
        # the operator retries it; a consumer dies once holding the retried copy
        await OpsService(rt).retry(sent.message_id)
        again = await _one(provider, sub)
        assert again.envelope.attempt == 0
        assert not again.handle.message.redelivered
        await again.handle.message.nack(requeue=True)
        async with running(rt):
            await wait_until(lambda: _settled(rt, sent.message_id), what="settled")
        rec = await rt.tracker.get(sent.message_id)
        assert calls, f"the retried copy, redelivered once, was {rec.status} unrun: {rec.description}"
    finally:
        await rt.close()


async def test_a_locked_side_database_does_not_hold_up_the_rabbitmq_receive(tmp_path):
    """The count is a side-database transaction in RabbitMQ's receive for any batch with a redelivered
    message. While another connection holds the database's write lock (SQLite; a row lock or a
    connection timeout on PostgreSQL alike), the receive waited out the busy timeout (30 s) before it
    fell back to the uncounted reading, and every message of the batch waited with it. The receive
    waits a second at most now; the count goes on by itself."""
    import sqlite3
    import time

    require("RabbitMQ", "127.0.0.1", 5672)
    prefix = fresh_prefix()
    calls: list = []
    app, rt = _rabbit(tmp_path, prefix, calls)
    await rt.open()
    db = None
    try:
        await app.enqueue(Sleeper(n=3))
        sub = app.subscription("Sleeper")
        provider = rt.provider
        d = await _one(provider, sub)
        await d.handle.message.nack(requeue=True)  # a consumer died holding it: redelivered
        await provider.wait_for_work(sub, 5)
        db = sqlite3.connect(f"{tmp_path}/{prefix}side.db", isolation_level=None)
        db.execute("BEGIN EXCLUSIVE")  # e.g. another process's prune, purge or migration
        started = time.monotonic()
        got = await provider.receive(sub, 1)
        took = time.monotonic() - started
        assert len(got) == 1
        assert took < 5, f"a receive of one redelivered message took {took:.1f}s behind the side database"
    finally:
        if db is not None:
            db.execute("ROLLBACK")
            db.close()
        await rt.close()
