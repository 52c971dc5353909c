"""Job control on every transport (the contract harnesses), for cases the contract suite did not cover
(found by a review): a cancel of a message running on a transport whose history does not say so, and
a history record no store keeps among others."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueMessage, queue
from queueing_core.errors import JobCancelled
from tests.contract.harness import running, wait_until


@queue("cancel-running", cancel_grace=timedelta(seconds=5))
class Slow(QueueMessage):
    key: str


@queue("history-poison-record", max_attempts=2)
class Odd(QueueMessage):
    kind: str


async def test_cancel_of_a_running_message_is_not_reported_cancelled_before_it_ran(harness):
    """B9 / docs/concepts/jobs.md "Cancellation": a message not yet running never runs and ends
    Cancelled; a running one is told to stop. Where the history is not the transport, a running
    message's history still says Pending (nothing records that a host began it), so ``cancel`` takes
    it for one that has not run: it answers Cancelled "settled without running" and writes Cancelled
    into the history while the handler runs on. A handler that finishes before the host's next look
    at the control store succeeds: the history flips from Cancelled to Succeeded, and a waiter that
    looked in between was told JobCancelled for a job that ran to its end."""
    app = harness.app()
    started = asyncio.Event()
    finish = asyncio.Event()
    ran: list[str] = []

    @app.handler()
    async def handle(msg: Slow, ctx):
        started.set()
        await finish.wait()
        ran.append(msg.key)
        return {"done": msg.key}

    rt = await harness.runtime(app)
    sent = await app.enqueue(Slow(key="k"))
    # the host looks at the control store for cancellations only every 30 s here: the handler ends first
    async with running(rt, cancel_poll=30.0):
        await asyncio.wait_for(started.wait(), 30)
        receipt = await app.cancel(sent.tracking_id)
        try:
            early = await app.result(sent.tracking_id, timeout=0.5)
        except JobCancelled:
            early = "JobCancelled"
        except TimeoutError:
            early = "still running"
        finish.set()
        await wait_until(lambda: ran == ["k"], what="the handler to finish")
        await asyncio.sleep(1.0)
        final = await app.status(sent.tracking_id)
    # the message was running: the answer must not say "cancelled before it ran". SQL knows it runs
    # (Leased); elsewhere the receipt says a running host may finish first
    if receipt.status != MessageStatus.LEASED:
        assert "before it ran" not in receipt.detail
        assert "unless it finishes first" in receipt.detail, receipt.detail
    # and what a waiter is told is what the message finally is. Elsewhere than SQL the host looks for
    # cancellations every 30 s here, so the run finishes first: Succeeded, and the waiter waited. On
    # SQL a NOTIFY (PostgreSQL) or the claim's own look may reach the run first: then Cancelled
    if harness.name not in ("sqlite", "postgres"):
        assert final.status == MessageStatus.SUCCEEDED, final.status
    if final.status == MessageStatus.SUCCEEDED:
        assert early == "still running", early
        assert await app.result(sent.tracking_id, timeout=5) == {"done": "k"}
    else:
        assert final.status == MessageStatus.CANCELLED, final.status


async def test_one_result_the_history_cannot_keep_does_not_stop_the_history_of_other_messages(harness):
    """DESIGN "history converges to the transport's truth": the history backlog retries a failed write
    "until it lands", but a record that can never land (a result with a lone surrogate) stays at the
    head of the backlog, and every later record of this host waits behind it: other messages that
    ran and succeeded read Pending for ever, and ``app.result`` on them times out."""
    app = harness.app()
    runs: list[str] = []

    @app.handler()
    async def handle(msg: Odd, ctx):
        runs.append(msg.kind)
        return "bad \ud800 text" if msg.kind == "surrogate" else {"ok": msg.kind}

    rt = await harness.runtime(app)
    bad = await app.enqueue(Odd(kind="surrogate"))
    async with running(rt):
        await wait_until(lambda: runs == ["surrogate"], what="the odd handler to run")
        await asyncio.sleep(1.0)
        good = await app.enqueue(Odd(kind="fine"))
        await wait_until(lambda: "fine" in runs, what="the good handler to run")
        try:
            got = await app.result(good.tracking_id, timeout=10)
        except TimeoutError as exc:
            got = f"timed out: {exc}"
    assert got == {"ok": "fine"}, (got, bad.message_id)
