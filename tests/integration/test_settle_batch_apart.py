"""One settlement a store refuses must not hold back the rest of its batch.

Found by a review of the SQL hot path: a handler's exception text went into the settlement as it was.
PostgreSQL refuses text with U+0000 and neither database takes a lone surrogate, so the batch (one
transaction) failed on every try, the settler gave up, and every message in it, successes included,
ran again once its lease lapsed (a success could end dead-lettered for attempts it never failed). On
SQLite the surrogate's ``UnicodeEncodeError``, a ``ValueError``, was also read as the connection being
closed: reported as the database's absence, and the pool's one connection thrown away at every try.

Now a decision's texts are made storable as the decision is made (``decisions._keep_text``), a value
``sqlite3`` cannot encode is the data's error, and a batch that fails for anything but the store's
absence is settled one settlement at a time (``Settler._settle``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.errors import Retry
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Worker
from tests.contract.harness import wait_until


@queue("settle-apart", max_attempts=3, lease_duration=timedelta(seconds=30))
class Job(QueueMessage):
    kind: str


def build(bad: BaseException) -> tuple[QueueingApp, list[str], asyncio.Event]:
    app = QueueingApp("settle-apart")
    runs: list[str] = []
    gate = asyncio.Event()

    @app.handler(max_concurrency=2)
    async def handle(msg: Job, ctx):
        runs.append(msg.kind)
        await gate.wait()  # both end together: their settlements share a batch
        if msg.kind == "bad":
            raise bad
        return None

    return app, runs, gate


async def run_pair(sql_db, bad: BaseException, until_bad: set[MessageStatus] | None):
    """Runs a good and a bad message whose settlements share one batch; the good one's record, the bad
    one's, and the runs."""
    app, runs, gate = build(bad)
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        bad_sent = await app.enqueue(Job(kind="bad"))
        good_sent = await app.enqueue(Job(kind="good"))
        # a long linger: the two settlements are sure to go in one batch
        worker = Worker(rt, poll_min=0.01, poll_max=0.1, shutdown_timeout=5.0, settle_linger=0.3)
        await worker.start()
        try:
            await wait_until(lambda: len(runs) >= 2, 15, "both messages running")
            gate.set()

            async def settled() -> bool:
                good = await app.status(good_sent.tracking_id)
                if good.status != MessageStatus.SUCCEEDED:
                    return False
                if until_bad is None:
                    return True
                return (await app.status(bad_sent.tracking_id)).status in until_bad

            await wait_until(settled, 20, "the good message settled")
            good = await app.status(good_sent.tracking_id)
            bad_rec = await app.status(bad_sent.tracking_id)
        finally:
            await worker.shutdown()
        return good, bad_rec, runs
    finally:
        await rt.close()


@pytest.mark.parametrize("text", ["bad \x00 byte", "bad \ud800 text"], ids=["nul", "surrogate"])
async def test_an_exception_text_no_store_keeps_is_recorded_replaced(sql_db, text):
    ended = {MessageStatus.FAILED, MessageStatus.DEAD_LETTERED}
    good, bad, runs = await run_pair(sql_db, ValueError(text), ended)
    assert good.status == MessageStatus.SUCCEEDED
    assert runs.count("good") == 1, runs  # its success committed the first time
    # a retry (or, its retries quick, the dead letter after them), recorded with its error
    assert bad.status in ended, bad.status
    assert bad.last_error is not None
    assert "bad \ufffd" in bad.last_error, bad.last_error


async def test_a_settlement_that_cannot_be_made_does_not_hold_back_its_batch(sql_db, caplog, monkeypatch):
    # a delay no timestamp holds: the provider cannot make this retry's due time, on any try (an
    # OverflowError before the statement; a value the store refuses fails the batch's call alike).
    # (The pipeline bounds a retry's delay now: unbounded here, as a settlement the store cannot make)
    monkeypatch.setattr("queueing_core.pipeline.LONGEST_RETRY", timedelta.max)
    caplog.set_level(logging.WARNING, logger="queueing.worker")
    good, bad, runs = await run_pair(sql_db, Retry(after=timedelta.max), None)
    # the two shared a batch, which failed and was settled apart (not two batches from the start)
    assert "settling 2 message(s) failed" in caplog.text
    assert "settling each on its own" in caplog.text
    assert good.status == MessageStatus.SUCCEEDED
    assert runs.count("good") == 1, runs  # settled on its own, at once, not after the lease lapsed
    # the bad one is not lost: its lease lapses and it comes back (then ends by its attempts)
    assert bad.status in {MessageStatus.LEASED, MessageStatus.PENDING, MessageStatus.FAILED}, bad.status


@pytest.mark.parametrize("branch", ["idle", "borrowed"])
async def test_sqlite_a_value_it_cannot_encode_is_not_a_closed_connection(sql_db, branch):
    """Both ways of the SQLite hot path to its connection: idle in the pool (taken without borrowing,
    the provider's later calls) and borrowed from it (a provider's first call)."""
    if sql_db.backend != "sqlite":
        pytest.skip("SQLite's hot path")
    app = QueueingApp("settle-apart-encode")

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    provider = sql_db.provider()
    rt = Runtime(app, provider)
    await rt.open()
    try:
        await app.enqueue(Job(kind="a"))
        await app.enqueue(Job(kind="b"))
        sub = app.subscription("Job")
        assert sub is not None
        first, second = await provider.receive(sub, 2)
        settling = provider
        if branch == "borrowed":
            # another provider on the same file, its first hot-path call this settlement (one that
            # is not this worker's is refused by its fence, but only after the statement ran)
            settling = sql_db.provider()
            other = Runtime(app, settling)
            await other.open()
        retry = RetryAfter(timedelta(0), "x")
        # a text past the decision's own cleaning: any value sqlite3 cannot encode, reaching the hot path
        object.__setattr__(retry, "error", "bad \ud800 text")
        engine = settling.engine.sync_engine
        replaced: list[str] = []  # the pool's connection thrown away, or a new one made
        sa.event.listen(engine, "invalidate", lambda *_: replaced.append("invalidated"))
        sa.event.listen(engine, "connect", lambda *_: replaced.append("connected"))
        with pytest.raises(UnicodeEncodeError):
            await settling.settle([Settlement(first, retry)])
        await settling.settle([Settlement(first, Complete())])  # the next call, on the same connection
        assert replaced == []
        assert engine.pool.checkedin() == 1
        rest = [second]
        if branch == "borrowed":
            assert first.refused  # (not its lease: the fence held, the connection worked)
            await other.close()
            first.refused = False
            rest = [first, second]
        else:
            assert not first.refused
        await provider.settle([Settlement(d, Complete()) for d in rest])
        assert not any(d.refused for d in rest)
    finally:
        await rt.close()
