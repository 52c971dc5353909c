"""A handler that raises a ``BaseException`` that is not an ``Exception``.

``SystemExit`` (``sys.exit``, argparse), ``KeyboardInterrupt`` and a library's own (gevent's
``Timeout``, greenlet's ``GreenletExit``, pytest's ``Failed``) went past the pipeline's handling of a
handler's error, found by a review: the message stayed leased, renewed for the worker's life and never
settled, or the worker's process ended without a stop (every other message's lease then lapsed). Such
a raise is now a failed attempt like any error (retried with backoff, dead-lettered after
``max_attempts``) and the worker goes on; whatever the worker's own processing raises still hands the
message a settlement."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from queueing_core import (
    DeadLetter,
    DeadLetterReason,
    MessageStatus,
    QueueingApp,
    QueueMessage,
    RetryAfter,
    RetryPolicy,
    queue,
)
from queueing_core.control import MemoryControlStore
from queueing_core.decisions import Decision
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Capabilities, Delivery
from queueing_core.worker import Worker

T0 = datetime(2026, 5, 1, 9, 0, tzinfo=UTC)


class LibraryAbort(BaseException):
    """As gevent's ``Timeout``, greenlet's ``GreenletExit`` or pytest's ``Failed``."""


RAISED = {
    "a library's own": lambda: LibraryAbort("aborted"),
    "SystemExit": lambda: SystemExit(3),
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
}


@queue("base-exc", max_attempts=2, retry=RetryPolicy(base=timedelta(seconds=2), jitter=0))
class Aborts(QueueMessage):
    kind: str


class _NullProvider:
    capabilities = Capabilities()


def _pipeline(sync: bool) -> tuple[Pipeline, Producer]:
    app = QueueingApp("base-exc")
    if sync:

        @app.handler()
        def handle(msg: Aborts) -> None:
            raise RAISED[msg.kind]()

    else:

        @app.handler()
        async def handle_async(msg: Aborts) -> None:
            raise RAISED[msg.kind]()

    clock = lambda: T0  # noqa: E731
    return Pipeline(app, MemoryControlStore(), clock=clock), Producer(app, _NullProvider(), clock=clock)


async def _decide(pipe: Pipeline, prod: Producer, msg: QueueMessage, attempt: int) -> Decision:
    env = prod.envelope_for(msg)
    d = Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=attempt)
    try:
        return await pipe.process(d)
    except BaseException as exc:  # (raised on, it must not end the test run: KeyboardInterrupt would)
        pytest.fail(f"the pipeline let the handler's {type(exc).__name__} through")


@pytest.mark.parametrize(
    ("kind", "sync"),
    [(kind, False) for kind in RAISED]
    # (not GeneratorExit from a plain def: asyncio hands a thread's error to the task, which closes the
    # whole chain of coroutines for a GeneratorExit; the worker's own fallback settles that message)
    + [(kind, True) for kind in RAISED if kind != "GeneratorExit"],
)
async def test_a_base_exception_from_the_handler_is_a_failed_attempt(
    kind: str, sync: bool, caplog: pytest.LogCaptureFixture
) -> None:
    pipe, prod = _pipeline(sync)
    msg = Aborts(kind=kind, created_at=T0)
    with caplog.at_level(logging.ERROR, logger="queueing.pipeline"):
        first = await _decide(pipe, prod, msg, attempt=1)
    assert isinstance(first, RetryAfter), first
    assert first.delay == timedelta(seconds=2)  # the type's backoff
    name = type(RAISED[kind]()).__name__
    assert first.error.startswith(f"{name}:"), first.error
    # told as an error naming the type: a handler that exits the process is not a usual failure
    assert any(name in r.getMessage() and "not an Exception" in r.getMessage() for r in caplog.records)
    last = await _decide(pipe, prod, msg, attempt=2)
    assert isinstance(last, DeadLetter), last
    assert last.reason is DeadLetterReason.MAX_ATTEMPTS
    assert not pipe.running  # (nothing left registered as running)


@queue(
    "base-exc-worker",
    max_attempts=2,
    retry=RetryPolicy(base=timedelta(0), jitter=0),
    lease_duration=timedelta(seconds=2),
)
class Exits(QueueMessage):
    n: int


@queue("base-exc-worker-other")
class Fine(QueueMessage):
    n: int


async def _until(check, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)


def _on_a_loop_of_its_own(scenario: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """``scenario`` run on an event loop of its own (in a thread): what escapes that loop (a
    ``SystemExit`` let through ended it) is returned, not raised into the test run's loop."""
    try:
        return asyncio.run(scenario())
    except BaseException as exc:
        return exc


@pytest.mark.parametrize("raised", [LibraryAbort, SystemExit], ids=["a library's own", "SystemExit"])
async def test_the_worker_settles_such_a_message_and_goes_on(raised: type[BaseException]) -> None:
    async def scenario() -> tuple[Any, bool, list[int], int]:
        app = QueueingApp("base-exc-worker")
        done: list[int] = []

        @app.handler()
        async def exits(msg: Exits) -> None:
            raise raised("handler gave up")

        @app.handler()
        async def fine(msg: Fine) -> None:
            done.append(msg.n)

        rt = Runtime(app, SqlProvider(f"sqlite:///{tempfile.mkdtemp()}/db.sqlite"))
        await rt.open()
        failing = await app.enqueue(Exits(n=1))
        worker = Worker(rt, poll_min=0.01, poll_max=0.05)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        try:

            async def dead_lettered() -> bool:
                rec = await rt.tracker.get(failing.message_id)
                return rec is not None and rec.status == MessageStatus.DEAD_LETTERED.value

            await _until(dead_lettered)
            await app.enqueue(Fine(n=2))  # the worker goes on with other work

            async def other_done() -> bool:
                return bool(done)

            await _until(other_done)
            alive = not task.done()
        finally:
            worker.request_stop()
            await asyncio.wait_for(task, 30)
        try:
            return await rt.tracker.get(failing.message_id), alive, done, len(worker._in_flight)
        finally:
            await rt.close()  # (before its loop closes)

    outcome = await asyncio.to_thread(_on_a_loop_of_its_own, scenario)
    assert not isinstance(outcome, BaseException), f"the worker's loop ended with {outcome!r}"
    rec, alive, done, renewed = outcome
    assert rec is not None
    # (before: Leased at attempt 0, renewed for the worker's life; or the process ended)
    assert (rec.status, rec.attempt, rec.reason) == (
        MessageStatus.DEAD_LETTERED.value,
        2,
        "max-attempts-exceeded",
    )
    assert rec.description is not None
    assert f"{raised.__name__}: handler gave up" in rec.description
    assert alive
    assert done == [2]
    assert renewed == 0  # no lease renewed for a message that is settled


@queue("base-exc-kit")
class Job(QueueMessage):
    n: int


async def test_a_base_exception_in_the_workers_own_processing_still_settles_the_message(monkeypatch) -> None:
    """Not the handler's (the pipeline takes care of those): the kit's own processing, a hook say."""
    monkeypatch.setattr("queueing_core.worker.PIPELINE_ERROR_WAIT", timedelta(seconds=30))
    app = QueueingApp("base-exc-kit")

    @app.handler()
    async def handle(msg: Job) -> None:
        return None

    rt = Runtime(app, InProcessProvider())
    await rt.open()
    failed: list[int] = []

    async def broken(delivery: Delivery, **kwargs: object) -> Decision:
        failed.append(delivery.attempt)
        raise LibraryAbort("the kit's own processing")

    monkeypatch.setattr(rt.pipeline, "process", broken)
    receipt = await app.enqueue(Job(n=1))
    worker = Worker(rt, poll_min=0.01, poll_max=0.05)
    task = asyncio.create_task(worker.run(install_signal_handlers=False))
    try:

        async def deferred() -> bool:
            rec = await rt.tracker.get(receipt.message_id)
            return rec is not None and rec.status == MessageStatus.PENDING.value and rec.reason is not None

        await _until(deferred)
        held = len(worker._in_flight)
        alive = not task.done()
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
    rec = await rt.tracker.get(receipt.message_id)
    assert rec is not None
    assert failed == [1]
    # handed back due later, no attempt used, as for any failure of the kit's own
    assert (rec.status, rec.attempt) == (MessageStatus.PENDING.value, 0)
    assert "pipeline error: LibraryAbort: the kit's own processing" in (rec.reason or "")
    assert rec.not_before is not None
    assert rec.not_before - rec.updated_at >= timedelta(seconds=20)
    assert alive
    assert held == 0
