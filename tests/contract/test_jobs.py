"""Job control on every provider: cancellation by tracking id, progress, results from code."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import MessageStatus, NonRetryableError, QueueMessage, RetryPolicy, queue
from queueing_core.errors import InvalidOperation, JobCancelled
from queueing_core.ops import OpsService
from queueing_core.pipeline import MAX_RESULT_CHARS

from .harness import ops_client, record, running, wait_until


# A handler that obeys stops at its next step, so its grace is a fallback only; long, because a step
# includes a store write of its progress, which on a loaded machine has taken longer than 300 ms (the
# grace then cancelled the run before its handler looked, and the test that it looks failed)
@queue("tasks", cancel_grace=timedelta(seconds=10), max_attempts=3)
class Task(QueueMessage):
    key: str
    steps: int = 0
    big: bool = False


# ignores the cancellation, and is cancelled after its (short) grace
@queue("stubborn_tasks", cancel_grace=timedelta(milliseconds=300), max_attempts=3)
class Stubborn(QueueMessage):
    key: str
    steps: int = 0


def task_app(harness):
    app = harness.app()
    calls: list[str] = []
    seen_cancel: list[str] = []

    @app.handler()
    async def handle(msg: Task, ctx):
        calls.append(msg.key)
        for step in range(msg.steps):
            await ctx.report_progress(step + 1, msg.steps, f"step {step + 1}")
            if ctx.cancelled.is_set():
                seen_cancel.append(msg.key)
                return {"stopped_at": step + 1}
            await asyncio.sleep(0.05)
        if msg.big:
            return "x" * (MAX_RESULT_CHARS + 10)
        return {"key": msg.key, "steps": msg.steps}

    @app.handler()
    async def stubborn(msg: Stubborn, ctx):
        calls.append(msg.key)
        for _ in range(msg.steps):
            await asyncio.sleep(0.05)  # (ctx.cancelled never looked at)
        return {"key": msg.key, "steps": msg.steps}

    return app, calls, seen_cancel


async def test_a_waiting_message_cancelled_by_tracking_id_never_runs(harness):
    app, calls, _ = task_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "tasks", True)
    kept = await app.enqueue(Task(key="kept"))
    doomed = await app.enqueue(Task(key="doomed"))
    receipt = await app.cancel(doomed.tracking_id)
    assert receipt.status == MessageStatus.CANCELLED
    assert (await app.status(doomed.tracking_id)).status == MessageStatus.CANCELLED
    await rt.control.set_paused("queue", "tasks", False)
    async with running(rt):
        await wait_until(lambda: calls == ["kept"], what="the other message to run")
        await asyncio.sleep(0.5)  # time for the cancelled one to be received (and not run)
        await wait_until(lambda: _status_is(rt, doomed.message_id, MessageStatus.CANCELLED), what="Cancelled")
    assert calls == ["kept"]
    assert (await record(rt, kept.message_id)).status == MessageStatus.SUCCEEDED
    with pytest.raises(JobCancelled):
        await app.result(doomed.tracking_id, timeout=1)


async def test_a_tracking_id_names_the_newest_of_its_messages_though_it_is_the_firsts_message_id(harness):
    """A message's tracking id is its own message id unless given. From code, a tracking id that a
    later message was sent with (the work sent again) names that later message; the ops API (the
    dashboard's buttons, the command line) names the message whose own id it is."""
    app, _, _ = task_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "tasks", True)
    first = await app.enqueue(Task(key="first"))
    assert first.tracking_id == first.message_id
    await asyncio.sleep(0.05)  # (a later creation time, on a coarse clock too)
    again = await app.enqueue(Task(key="again"), tracking_id=first.tracking_id)
    assert (again.tracking_id, again.message_id != first.message_id) == (first.tracking_id, True)
    assert (await app.status(first.tracking_id)).message_id == again.message_id
    async with ops_client(rt) as client:
        shown = await client.get(f"/messages/{first.message_id}")
        assert shown.json()["message_id"] == str(first.message_id), shown.text
        res = await client.post(f"/messages/{first.message_id}/cancel")
        assert res.status_code == 200, res.text
        assert res.json()["message_id"] == str(first.message_id)
    assert (await record(rt, first.message_id)).status == MessageStatus.CANCELLED
    assert (await record(rt, again.message_id)).status == MessageStatus.PENDING  # left alone
    receipt = await app.cancel(first.tracking_id)  # from code: the newest
    assert receipt.message_id == again.message_id
    assert (await record(rt, again.message_id)).status == MessageStatus.CANCELLED


async def test_a_running_handler_sees_the_cancellation_and_is_recorded_cancelled(harness):
    app, calls, seen = task_app(harness)
    rt = await harness.runtime(app)
    # far more steps than the test needs (0.05 s each): the handler is still running when the
    # cancellation comes however slow the machine; it stops at the cancellation, so this costs nothing
    r = await app.enqueue(Task(key="long", steps=4000))
    async with running(rt, cancel_poll=0.05):
        await wait_until(lambda: calls == ["long"], what="the handler to start")
        await wait_until(lambda: _has_progress(rt, r.message_id), what="progress while it runs")
        status = await app.status(r.tracking_id)
        assert status.progress is not None
        assert status.progress["total"] == 4000
        assert status.progress["text"].startswith("step ")
        receipt = await app.cancel(r.tracking_id)
        assert receipt.status == MessageStatus.LEASED  # running: told, not yet stopped
        await wait_until(lambda: _status_is(rt, r.message_id, MessageStatus.CANCELLED), what="Cancelled")
    assert seen == ["long"]
    rec = await record(rt, r.message_id)
    assert rec.attempt <= 1
    assert calls == ["long"]


async def test_a_handler_that_ignores_the_cancellation_is_cancelled_after_its_grace(harness):
    app, calls, _ = task_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Stubborn(key="stubborn", steps=4000))  # still running when cancelled
    async with running(rt, cancel_poll=0.05):
        await wait_until(lambda: calls == ["stubborn"], what="the handler to start")
        await app.cancel(r.tracking_id)
        await wait_until(lambda: _status_is(rt, r.message_id, MessageStatus.CANCELLED), what="Cancelled")
    assert calls == ["stubborn"]
    assert (await record(rt, r.message_id)).status == MessageStatus.CANCELLED  # not run again


async def test_cancelling_a_finished_message_is_refused_with_the_reason(harness):
    app, _, _ = task_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Task(key="done"))
    async with running(rt):
        assert await app.result(r.tracking_id, timeout=60) == {"key": "done", "steps": 0}
    with pytest.raises(InvalidOperation, match="already succeeded"):
        await app.cancel(r.tracking_id)
    async with ops_client(rt) as client:
        res = await client.post(f"/messages/{r.tracking_id}/cancel")
        assert res.status_code == 409, res.text
        assert "already succeeded" in res.json()["detail"]
        detail = (await client.get(f"/messages/{r.message_id}")).json()
        assert detail["result"] == {"key": "done", "steps": 0}


async def test_results_and_the_last_progress_are_kept_and_an_oversized_result_is_cut(harness):
    app, _, _ = task_app(harness)
    rt = await harness.runtime(app)
    small = await app.enqueue(Task(key="small", steps=3))
    big = await app.enqueue(Task(key="big", big=True))
    async with running(rt):
        assert await app.result(small.tracking_id, timeout=60) == {"key": "small", "steps": 3}
        kept = await app.result(big.tracking_id, timeout=60)
    assert kept["_truncated"] is True
    assert kept["_original_chars"] > MAX_RESULT_CHARS
    done = await app.status(small.tracking_id)
    assert done.status == MessageStatus.SUCCEEDED
    assert done.progress is not None
    assert done.progress["step"] == 3


async def test_result_times_out_while_the_message_waits(harness):
    app, _, _ = task_app(harness)
    rt = await harness.runtime(app)
    r = await app.enqueue(Task(key="waiting"))
    with pytest.raises(TimeoutError, match="still"):
        await app.result(r.tracking_id, timeout=0.3)
    assert rt.provider is not None


async def _status_is(rt, message_id, status) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == status


async def _has_progress(rt, message_id) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.progress is not None


@queue("prices", idempotent=True, identity="sku", max_attempts=2)
class PriceUpdate(QueueMessage):
    sku: str
    price: int


@queue("stock", idempotent=True, identity=lambda m: f"{m.warehouse}/{m.sku}")
class StockLevel(QueueMessage):
    warehouse: str
    sku: str
    count: int


SQL = ("sqlite", "postgres")


async def test_idempotent_enqueue_discards_an_identical_waiting_message_and_gives_ctx_previous(harness):
    app = harness.app()
    seen: list[tuple[int, int | None]] = []

    @app.handler()
    async def handle(msg: PriceUpdate, ctx):
        seen.append((msg.price, ctx.previous.price if ctx.previous is not None else None))

    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "prices", True)
    first = await app.enqueue(PriceUpdate(sku="A", price=10))
    again = await app.enqueue(PriceUpdate(sku="A", price=10))
    other = await app.enqueue(PriceUpdate(sku="B", price=5))
    assert (first.outcome, again.outcome, other.outcome) == ("enqueued", "discarded", "enqueued")
    assert again.message_id == first.message_id
    assert again.tracking_id == first.tracking_id
    waiting = [r for r in await _all(rt) if r.type == "PriceUpdate"]
    assert len(waiting) == 2  # one per identity
    changed = await app.enqueue(PriceUpdate(sku="A", price=12))
    if harness.name in SQL:  # the waiting row takes the new body
        assert changed.outcome == "replaced"
        assert changed.message_id == first.message_id
        assert (await record(rt, first.message_id)).body == {"sku": "A", "price": 12}
    else:  # a queued message cannot be edited: the new one is sent, the waiting one superseded
        assert changed.outcome == "enqueued"
        assert changed.supersedes == first.message_id
        assert changed.message_id != first.message_id
    await rt.control.set_paused("queue", "prices", False)
    async with running(rt):
        await wait_until(lambda: len(seen) == 2, what="both identities")
        assert sorted(seen) == [(5, None), (12, None)]
        if harness.name not in SQL:
            await wait_until(
                lambda: _status_is(rt, first.message_id, MessageStatus.CANCELLED), what="superseded"
            )
            gone = await record(rt, first.message_id)
            assert gone.reason == f"superseded by {changed.message_id}"
            with pytest.raises(JobCancelled, match="superseded by"):
                await app.result(first.tracking_id, timeout=5)
        # a new version after the first succeeded: the handler sees the last processed one (once its
        # success is recorded: the brokers' history is written just after the run, and a version whose
        # record still says it waits is superseded, as it should be)
        await wait_until(lambda: _status_is(rt, changed.message_id, MessageStatus.SUCCEEDED), what="recorded")
        nxt = await app.enqueue(PriceUpdate(sku="A", price=15))
        assert nxt.outcome == "enqueued"
        assert nxt.supersedes is None  # the last version had run: nothing to supersede
        await wait_until(lambda: len(seen) == 3, what="the new version")
        # the same body again once it ran: it runs again (only a waiting copy is discarded)
        await wait_until(lambda: _status_is(rt, nxt.message_id, MessageStatus.SUCCEEDED), what="Succeeded")
        rerun = await app.enqueue(PriceUpdate(sku="A", price=15))
        assert rerun.outcome == "enqueued"
        await wait_until(lambda: len(seen) == 4, what="the same version again")
    assert seen[2:] == [(15, 12), (15, 15)]


def _prices_app(harness: Any) -> tuple[Any, list[int]]:
    """An app whose handler of price updates notes each price it runs."""
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: PriceUpdate):
        seen.append(msg.price)

    return app, seen


async def test_an_identical_enqueue_discarded_against_a_version_that_expires_sooner_still_runs(harness):
    """A review found the same JSON discarded against a waiting version with a short time to live (or
    one already past it, not yet settled so): that version expired unrun, and the run the second
    enqueue asked for was lost. The discard now gives the waiting version the new one's expiry (SQL:
    its row; elsewhere its identity's document, which a host reads before it expires the message).
    Where the transport drops a message an hour after its own expiry (Service Bus and RabbitMQ give it
    a time to live of their own), a longer life cannot be given: the new one is sent instead,
    superseding the waiting one. Either way one run."""
    app, seen = _prices_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "prices", True)
    short = await app.enqueue(PriceUpdate(sku="X", price=7), ttl=timedelta(seconds=1))
    await asyncio.sleep(1.2)  # its time is up, and nothing has settled it yet
    again = await app.enqueue(PriceUpdate(sku="X", price=7))  # the queue's expiry: hours away
    if getattr(rt.provider, "drops_expired_after", None) is None:
        assert again.outcome == "discarded"
        assert again.message_id == short.message_id
    else:
        assert again.outcome == "enqueued"
        assert again.supersedes == short.message_id
    await rt.control.set_paused("queue", "prices", False)
    async with running(rt):
        await wait_until(lambda: seen == [7], what="the requested run")
        await wait_until(lambda: _status_is(rt, again.message_id, MessageStatus.SUCCEEDED), what="Succeeded")
        await asyncio.sleep(0.3)
    assert seen == [7]


async def test_a_version_that_expired_is_not_discarded_against(harness):
    """The other order: a host expired the waiting version first (it marks the identity's newest
    version, as a start does), and an identical enqueue after that is sent and runs."""
    app, seen = _prices_app(harness)
    rt = await harness.runtime(app)
    short = await app.enqueue(PriceUpdate(sku="Y", price=8), ttl=timedelta(milliseconds=300))
    await asyncio.sleep(0.5)
    async with running(rt):  # a host receives it past its expiry and settles it so
        await wait_until(lambda: _status_is(rt, short.message_id, MessageStatus.EXPIRED), what="Expired")
        again = await app.enqueue(PriceUpdate(sku="Y", price=8))
        assert again.outcome == "enqueued"
        await wait_until(lambda: seen == [8], what="the new run")


@pytest.mark.parametrize("call", ["identity_doc", "put_identity_doc"])
async def test_a_host_that_cannot_read_or_mark_the_identity_runs_a_version_past_its_expiry(harness, call):
    """The docs: a host that finds an idempotent message past its expiry and cannot read its identity's
    document (where an enqueue discarded against it may have given it a longer life), or cannot mark
    it started there, runs it: a duplicate run beats a lost one. Expiring it on a failed read would
    lose the run a discarded enqueue asked for."""
    from queueing_core.errors import ProviderUnavailable
    from tests.faults.inject import CallPoint, Injector

    if harness.name in SQL:
        pytest.skip("SQL keeps a discarded enqueue's expiry on the message's row: no document is read")
    app, seen = _prices_app(harness)
    rt = await harness.runtime(app)
    assert rt.identities is not None
    short = await app.enqueue(PriceUpdate(sku="Z", price=9), ttl=timedelta(milliseconds=300))
    await asyncio.sleep(0.5)
    fails = CallPoint(call, lambda rt: rt.identities.store, call, lambda: ProviderUnavailable("injected"))
    injector = Injector([fails], mode="error", at=0)  # its first call (the host's look at the expiry)
    with injector.installed(rt), injector.armed_for():
        async with running(rt):
            await wait_until(lambda: seen == [9], what="the run of the version past its expiry")
            succeeded = MessageStatus.SUCCEEDED
            await wait_until(lambda: _status_is(rt, short.message_id, succeeded), what="Succeeded")
    assert injector.fired
    assert seen == [9]


@queue(
    "retried_prices",
    idempotent=True,
    identity="sku",
    max_attempts=3,
    retry=RetryPolicy(base=timedelta(milliseconds=300), factor=1.0, jitter=0),
)
class RetriedPrice(QueueMessage):
    sku: str
    cents: int


async def test_a_version_waiting_for_its_retry_is_superseded_and_the_newest_runs(harness):
    """The docs: only a version that has not started is superseded, one waiting for its retry
    included. A review found SQL running the retry of the older version after the newer one had
    succeeded (the newer was a row of its own, written while the older one ran); a second review, the
    first fix superseding the newest version instead, when a third enqueue had put its body into the
    older row. Here: version 100 runs and fails, version 90 comes while it runs, version 80 while 100
    waits for its retry and 90 waits (the queue paused): 80 runs, and nothing else after 100's try."""
    app = harness.app()
    runs: list[int] = []
    changed: list[Any] = []

    @app.handler()
    async def handle(msg: RetriedPrice):
        runs.append(msg.cents)
        if msg.cents == 100 and runs == [100]:
            await rt.control.set_paused("queue", "retried_prices", True)  # (nothing else runs yet)
            changed.append(await app.enqueue(RetriedPrice(sku="T", cents=90)))  # changed while it runs
            raise RuntimeError("the first attempt fails")

    rt = await harness.runtime(app)
    first = await app.enqueue(RetriedPrice(sku="T", cents=100))
    async with running(rt):
        # (90 before 80: the order the versions are sent in is the order they are newer in)
        await wait_until(lambda: runs == [100] and bool(changed), what="the first attempt")

        async def waits_for_its_retry() -> bool:
            rec = await rt.tracker.get(first.message_id)
            return rec is not None and rec.status != MessageStatus.LEASED

        await wait_until(waits_for_its_retry, what="the first attempt settled")
        newest = await app.enqueue(RetriedPrice(sku="T", cents=80))
        await rt.control.set_paused("queue", "retried_prices", False)
        await wait_until(lambda: 80 in runs, what="the newest version")
        await wait_until(lambda: _status_is(rt, first.message_id, MessageStatus.CANCELLED), what="superseded")
        await asyncio.sleep(0.8)  # past the retry delays: nothing else runs
    assert runs == [100, 80]
    rec = await record(rt, first.message_id)
    assert rec.reason is not None
    assert rec.reason.startswith("superseded by ")
    assert newest.outcome in ("enqueued", "replaced")


async def test_an_operators_retry_of_a_version_that_ran_before_a_newer_one_runs_it(harness):
    """A version dead-lettered while a newer one came, retried by an operator, runs: the operator asked
    for it, whatever came after (a review found SQL settling it superseded instead)."""
    app = harness.app()
    runs: list[int] = []
    started, go_on = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def handle(msg: RetriedPrice):
        runs.append(msg.cents)
        if msg.cents == 1 and runs.count(1) == 1:
            started.set()
            await go_on.wait()
            raise NonRetryableError("the first version fails for good")

    rt = await harness.runtime(app)
    first = await app.enqueue(RetriedPrice(sku="D", cents=1))
    async with running(rt):
        await asyncio.wait_for(started.wait(), 30)
        await app.enqueue(RetriedPrice(sku="D", cents=2))  # while the first runs
        go_on.set()
        await wait_until(lambda: _status_is(rt, first.message_id, MessageStatus.DEAD_LETTERED), what="dead")
        await wait_until(lambda: 2 in runs, what="the newer version")
        await OpsService(rt).retry(first.message_id)
        await wait_until(lambda: runs.count(1) == 2, what="the retried version")
        await wait_until(lambda: _status_is(rt, first.message_id, MessageStatus.SUCCEEDED), what="Succeeded")
    assert sorted(runs) == [1, 1, 2]


async def test_an_identity_function_keys_idempotent_messages(harness):
    app = harness.app()
    app.message(StockLevel)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "stock", True)
    a = await app.enqueue(StockLevel(warehouse="w1", sku="A", count=3))
    b = await app.enqueue(StockLevel(warehouse="w2", sku="A", count=3))
    c = await app.enqueue(StockLevel(warehouse="w1", sku="A", count=3))
    assert (a.outcome, b.outcome, c.outcome) == ("enqueued", "enqueued", "discarded")
    async with ops_client(rt) as client:  # the ops API's enqueue says the same
        same = {"warehouse": "w2", "sku": "A", "count": 3}
        res = await client.post("/queues/stock/messages", json=[same, {**same, "count": 4}])
        assert res.status_code in (200, 201, 202), res.text
        first, second = res.json()["enqueued"]
        assert first["outcome"] == "discarded"
        assert first["message_id"] == str(b.message_id)
        if harness.name in SQL:
            assert second["outcome"] == "replaced"
        else:
            assert (second["outcome"], second["supersedes"]) == ("enqueued", str(b.message_id))


async def test_a_batch_of_versions_of_one_identity_runs_only_the_last(harness):
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: PriceUpdate, ctx):
        seen.append(msg.price)

    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "prices", True)
    receipts = await app.enqueue_many([PriceUpdate(sku="Z", price=p) for p in (1, 2, 2, 3)])
    assert receipts[2].outcome == "discarded"
    last = receipts[-1]
    await rt.control.set_paused("queue", "prices", False)
    async with running(rt):
        assert await app.result(last.tracking_id, timeout=30) is None
        for r in receipts[:2]:
            if harness.name not in SQL:  # superseded, settled without running
                await wait_until(
                    lambda r=r: _status_is(rt, r.message_id, MessageStatus.CANCELLED), what="superseded"
                )
        await asyncio.sleep(0.3)  # time for anything still queued to be received (and not run)
    assert seen == [3]


async def _all(rt):
    from queueing_core.tracking import MessageQuery

    return (await rt.tracker.query(MessageQuery(), limit=500)).items


async def test_update_status_where_on_sql_and_a_clear_refusal_elsewhere(harness):
    app, calls, _ = task_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "tasks", True)
    held = await app.enqueue(Task(key="hold-me"))
    await app.enqueue(Task(key="leave-me"))
    change = {"where": {"path": "key", "op": "eq", "value": "hold-me"}, "set": "OnHold"}
    async with ops_client(rt) as client:
        res = await client.post("/queues/tasks/status", json=change)
        if harness.name not in SQL:
            assert res.status_code == 409, res.text
            assert res.json()["type"].endswith("not-supported")
            assert "needs the SQL provider" in res.json()["detail"]
            return
        assert res.status_code == 200, res.text
        assert res.json()["updated"] == 1
    assert (await record(rt, held.message_id)).status == "OnHold"
    await rt.control.set_paused("queue", "tasks", False)
    async with running(rt):
        await wait_until(lambda: calls == ["leave-me"], what="the other message")
        await asyncio.sleep(0.3)
    assert calls == ["leave-me"]  # a custom status holds the message out of processing


async def test_a_cancelled_message_put_back_to_pending_runs(harness):
    """Setting Pending on a cancelled message is the operator asking for it to run: its cancellation
    request (kept a day, read by every host) goes with it, as with a retry; before, the worker settled
    it Cancelled again without running it (found in review)."""
    if harness.name not in SQL:
        pytest.skip("update-status-where needs the SQL provider (the refusal is tested above)")
    app, calls, _ = task_app(harness)
    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "tasks", True)
    sent = await app.enqueue(Task(key="again"))
    assert (await app.cancel(sent.tracking_id)).status == MessageStatus.CANCELLED
    change = {"where": {"path": "key", "op": "eq", "value": "again"}, "set": "Pending"}
    async with ops_client(rt) as client:
        res = await client.post("/queues/tasks/status", json=change)
        assert res.status_code == 200, res.text
        assert res.json()["updated"] == 1
    await rt.control.set_paused("queue", "tasks", False)
    async with running(rt):
        await wait_until(lambda: _status_is(rt, sent.message_id, MessageStatus.SUCCEEDED), what="it ran")
    assert calls == ["again"]


@pytest.mark.parametrize(
    ("mode", "step"),
    [("error", 0), ("crash", 0), ("error", 1), ("crash", 1)],
    ids=["send-fails", "crash-at-send", "mark-fails", "crash-before-mark"],
)
async def test_a_fault_between_sending_the_new_version_and_superseding_the_old_loses_neither(
    harness, mode, step
):
    """Step 0 sends the new version, step 1 marks the waiting one superseded. Whichever fails (an
    error, or the process stopping there: no later call runs), the old version is not superseded, and
    the new one, once sent, is never lost: at worst both run."""
    from queueing_core.errors import ProviderUnavailable
    from tests.faults.inject import CallPoint, Crash, Injector

    if harness.name in SQL:
        pytest.skip("SQL replaces the waiting row in one transaction: there is no step between")
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: PriceUpdate, ctx):
        seen.append(msg.price)

    rt = await harness.runtime(app)
    assert rt.identities is not None
    await rt.control.set_paused("queue", "prices", True)
    old = await app.enqueue(PriceUpdate(sku="F", price=1))
    injector = Injector(
        [
            CallPoint("send", lambda rt: rt.provider, "send", lambda: ProviderUnavailable("injected")),
            CallPoint(
                "put_identity_doc",
                lambda rt: rt.identities.store,
                "put_identity_doc",
                lambda: ProviderUnavailable("injected"),
            ),
        ],
        mode=mode,
        at=step,
    )
    new = None
    with injector.installed(rt), injector.armed_for(), contextlib.suppress(Crash, ProviderUnavailable):
        new = await app.enqueue(PriceUpdate(sku="F", price=2))
    assert injector.fired
    assert injector.calls == ["send", "put_identity_doc"][: step + 1]
    if mode == "error" and step == 1:  # the send stands: the caller is told it was enqueued
        assert new is not None
        assert new.outcome == "enqueued"
        assert new.supersedes is None
    else:
        assert new is None
    await rt.control.set_paused("queue", "prices", False)
    want = [1] if step == 0 else [1, 2]  # a failed send leaves the old one; after it, both run
    async with running(rt):
        await wait_until(lambda: sorted(seen) == want, timeout=30, what=f"versions {want} to run")
        assert (await app.result(old.tracking_id, timeout=30)) is None
        await asyncio.sleep(0.3)  # time for anything else still queued to be received
    assert sorted(seen) == want


async def test_an_operator_retry_of_a_superseded_version_runs_it(harness):
    from queueing_core.ops import OpsService

    if harness.name in SQL:
        pytest.skip("SQL replaces the waiting body: no superseded version is left to retry")
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: PriceUpdate, ctx):
        seen.append(msg.price)

    rt = await harness.runtime(app)
    await rt.control.set_paused("queue", "prices", True)
    old = await app.enqueue(PriceUpdate(sku="R", price=1))
    new = await app.enqueue(PriceUpdate(sku="R", price=2))
    assert new.supersedes == old.message_id
    await rt.control.set_paused("queue", "prices", False)
    async with running(rt):
        await wait_until(lambda: _status_is(rt, old.message_id, MessageStatus.CANCELLED), what="superseded")
        await wait_until(lambda: seen == [2], what="the new version")
        await OpsService(rt).retry(old.message_id)
        assert await app.result(old.tracking_id, timeout=30) is None
    assert seen == [2, 1]


async def test_a_superseded_version_sent_again_with_its_own_id_changes_nothing_and_the_newer_one_runs(
    harness,
):
    """An outbox (or a schedule's tick) replays the first version of an identity, the same message id,
    after a newer version superseded it and a host settled it so. The replay is the older request: it
    once became the newest version again, superseded the newer one and ran in its place (found in
    review: the newer body never ran). It now sends nothing, its receipt names the newer version, and
    that one runs, as on SQL, where a message id sent again changes nothing."""
    from queueing_core.decisions import Release
    from queueing_core.transport import Settlement

    if harness.name in SQL:
        pytest.skip("SQL replaces the waiting body: no version is superseded")
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: PriceUpdate, ctx):
        seen.append(msg.price)

    rt = await harness.runtime(app)
    first_version = PriceUpdate(sku="P", price=1)
    first = await app.enqueue(first_version)
    between = await app.enqueue(PriceUpdate(sku="P", price=2))
    assert between.supersedes == first.message_id
    sub = app.subscription("PriceUpdate")
    assert sub is not None

    async def first_settled() -> bool:
        # a host takes the first version (superseded: Cancelled, not run); the other goes back
        for d in await rt.provider.receive(sub, 10):
            if d.envelope is not None and d.envelope.message_id == first.message_id:
                await rt.process_and_settle(d)
            else:
                await rt.provider.settle([Settlement(d, Release("not this one yet"))])
        return await _status_is(rt, first.message_id, MessageStatus.CANCELLED)

    await wait_until(first_settled, what="the first version settled as superseded")
    assert seen == []
    replay = await app.enqueue(first_version)
    assert (replay.outcome, replay.message_id, replay.supersedes) == ("discarded", between.message_id, None)
    async with running(rt):
        await wait_until(lambda: seen == [2], what="the newer version to run")
        await wait_until(
            lambda: _status_is(rt, between.message_id, MessageStatus.SUCCEEDED), what="the newer one"
        )
        await asyncio.sleep(0.3)  # time for anything still queued to be received (and not run)
    assert seen == [2]
    assert await _status_is(rt, first.message_id, MessageStatus.CANCELLED)
