"""Results a handler returns that no store keeps as they are (NaN, U+0000, lone surrogates).

A result holding U+0000 or a lone surrogate went to the store as it was: PostgreSQL refused it, so the
settlement failed on every try (the message ran again, then was dead-lettered although its work was
done), and on RabbitMQ and SQS the history write failed for ever. Such characters are now replaced
with U+FFFD (queueing_core/storable.py); found by a review."""

from __future__ import annotations

import contextlib

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker
from tests.contract.harness import running, wait_until


@queue("unstorable-results-sql", max_attempts=2)
class Calc(QueueMessage):
    kind: str


def build():
    app = QueueingApp("review-results")
    runs: list[str] = []

    @app.handler()
    async def handle(msg: Calc, ctx):
        runs.append(msg.kind)
        if msg.kind == "nan":
            return {"ratio": float("nan")}
        if msg.kind == "inf":
            return float("inf")
        if msg.kind == "nul":
            return {"text": "a\x00b"}
        if msg.kind == "surrogate":
            return "bad \ud800 text"
        return {"ok": True}

    return app, runs


@pytest.mark.parametrize("kind", ["nan", "inf", "nul", "surrogate"])
async def test_a_result_the_store_cannot_keep_still_settles_the_message(sql_db, kind):
    app, runs = build()
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        sent = await app.enqueue(Calc(kind=kind))
        worker = Worker(rt, poll_min=0.01, poll_max=0.1, shutdown_timeout=5.0, settle_linger=0.0)
        await worker.start()
        try:
            with contextlib.suppress(TimeoutError):
                await app.result(sent.tracking_id, timeout=8)
            status = await app.status(sent.tracking_id)
        finally:
            await worker.shutdown()
        # the handler succeeded once: the message must be settled (Succeeded, its result kept in some
        # form), not left leased and run again at every lease
        assert status.status == MessageStatus.SUCCEEDED, (status.status, runs)
        assert runs == [kind]
        kept = {"nan": {"ratio": None}, "inf": None, "nul": {"text": "a\ufffdb"}}
        kept["surrogate"] = "bad \ufffd text"
        assert await app.result(sent.tracking_id, timeout=5) == kept[kind]
    finally:
        await rt.close()


@queue("unstorable-results", max_attempts=2)
class Odd(QueueMessage):
    kind: str


@pytest.mark.parametrize("kind", ["nul", "surrogate"])
async def test_a_result_with_text_no_store_keeps_still_finishes_the_job(harness, kind):
    """B10: "What the handler returns is the message's result, kept on every transport ... anything
    else as its repr". A string result holding U+0000 (or a lone surrogate) is JSON-ready data, so it
    goes to the store as it is: PostgreSQL refuses it, and the settlement (SQL) or the history write
    (the others) fails for good. The message the handler finished never reads Succeeded and
    ``app.result`` never returns."""
    app = harness.app()
    runs: list[str] = []

    @app.handler()
    async def handle(msg: Odd, ctx):
        runs.append(msg.kind)
        return {"text": "a\x00b"} if msg.kind == "nul" else "bad \ud800 text"

    rt = await harness.runtime(app)
    sent = await app.enqueue(Odd(kind=kind))
    async with running(rt):
        await wait_until(lambda: len(runs) >= 1, what="the handler to run")
        with contextlib.suppress(TimeoutError):
            await app.result(sent.tracking_id, timeout=8)
        status = await app.status(sent.tracking_id)
    assert status.status == MessageStatus.SUCCEEDED, (status.status, runs)
    assert runs == [kind]
