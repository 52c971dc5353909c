"""Plain ``def`` handlers run on their type's own threads, and a thread asyncio cannot stop (past its
time limit, its run cancelled, the host stopping) keeps its type's concurrency slot until it ends.

A review found that such a thread gave its slot back at once and ran on in the loop's default executor:
the retry started another thread beside it (``max_concurrency=1`` ran one message on several threads),
the hung threads filled that executor, and every other type's plain ``def`` handlers, DNS lookups
(``loop.getaddrinfo``) and the Functions host's settlement calls waited behind them."""

from __future__ import annotations

import asyncio
import contextvars
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from queueing_core import (
    Complete,
    Defer,
    HandlerContext,
    QueueingApp,
    QueueMessage,
    Release,
    RetryAfter,
    queue,
)
from queueing_core.control import MemoryControlStore
from queueing_core.pipeline import Pipeline
from queueing_core.producer import Producer
from queueing_core.transport import Capabilities, Delivery

WAIT = 30.0  # generous: how long a blocked handler waits at most, so no test can hang on it
#: how long work that must not be starved may wait for a thread (well within WAIT: a starved call
#: would otherwise get its thread when the blocked ones give up)
STARVED = 10.0


class _NullProvider:
    capabilities = Capabilities()


def make(app: QueueingApp) -> tuple[Pipeline, Producer]:
    return Pipeline(app, MemoryControlStore(), rand=lambda: 0.5), Producer(app, _NullProvider())


def delivery(prod: Producer, msg: QueueMessage, attempt: int = 1) -> Delivery:
    env = prod.envelope_for(msg)
    return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=attempt)


class Blocking:
    """A plain def handler's body that blocks until released, counting its threads."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.started = 0
        self.running = 0
        self.most = 0
        self.entered = threading.Semaphore(0)

    def __call__(self) -> None:
        with self.lock:
            self.started += 1
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.release()
        try:
            self.release.wait(WAIT)
        finally:
            with self.lock:
                self.running -= 1

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.acquire, True, WAIT), "the handler never started"


async def until(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_thread_past_its_time_limit_keeps_its_slot_until_it_ends() -> None:
    @queue("threads-one", max_concurrency=1, time_limit=timedelta(milliseconds=100), max_attempts=5)
    class OneAtATime(QueueMessage):
        pass

    app = QueueingApp("threads")
    body = Blocking()

    @app.handler()
    def hang(msg: OneAtATime) -> None:
        body()

    pipe, prod = make(app)
    msg = OneAtATime()
    first = await pipe.process(delivery(prod, msg, 1))
    # decided (and settled) at the time limit, its thread still running
    assert isinstance(first, RetryAfter)
    assert "execution time limit" in first.error
    assert body.running == 1
    # its retry waits for the slot the running thread holds: it does not start beside it
    retry = asyncio.ensure_future(pipe.process(delivery(prod, msg, 2)))
    await asyncio.sleep(0.5)
    assert not retry.done()
    assert body.started == 1
    assert body.most == 1
    body.release.set()  # the thread ends: the slot is free, the retry runs (and ends at once)
    assert isinstance(await asyncio.wait_for(retry, WAIT), Complete)
    assert body.started == 2
    assert body.most == 1


async def test_a_cancelled_or_handed_back_run_keeps_its_slot_until_its_thread_ends() -> None:
    @queue("threads-cut", max_concurrency=1)
    class Cut(QueueMessage):
        pass

    app = QueueingApp("threads")
    body = Blocking()

    @app.handler()
    def hang(msg: Cut) -> None:
        body()

    pipe, prod = make(app)
    running = asyncio.ensure_future(pipe.process(delivery(prod, Cut())))
    await body.wait_entered()
    running.cancel()  # the host stopping: handed back uncounted, its thread runs on
    assert isinstance(await running, Release)
    busy = await pipe.process(delivery(prod, Cut()), slot_wait=0.3)
    assert isinstance(busy, Defer)
    assert "no free slot" in (busy.reason or "")
    assert body.started == 1
    body.release.set()
    assert isinstance(await pipe.process(delivery(prod, Cut()), slot_wait=WAIT), Complete)
    assert body.most == 1


async def test_hung_threads_of_one_type_starve_neither_other_types_nor_dns() -> None:
    @queue("threads-hung", max_concurrency=2, time_limit=timedelta(milliseconds=50), max_attempts=50)
    class Hung(QueueMessage):
        pass

    @queue("threads-quick")
    class Quick(QueueMessage):
        pass

    app = QueueingApp("threads")
    body = Blocking()
    quick_ran: list[str] = []

    @app.handler()
    def hang(msg: Hung) -> None:
        body()

    @app.handler()
    def quick(msg: Quick) -> None:
        quick_ran.append(threading.current_thread().name)

    loop = asyncio.get_running_loop()
    # a small default executor, so that the test does not depend on the machine's CPU count
    small = ThreadPoolExecutor(2)
    loop.set_default_executor(small)
    pipe, prod = make(app)
    try:
        for attempt in range(1, 7):  # three times the default executor's threads
            d = await pipe.process(delivery(prod, Hung(), attempt), slot_wait=0.05)
            assert isinstance(d, RetryAfter | Defer)
        assert body.running == 2, "more threads of the type than its max_concurrency"
        try:
            quick_done = await asyncio.wait_for(pipe.process(delivery(prod, Quick())), STARVED)
        except TimeoutError:
            pytest.fail("another type's plain def handler waited for a thread behind the hung ones")
        assert isinstance(quick_done, Complete), f"another type's plain def handler did not run: {quick_done}"
        assert len(quick_ran) == 1
        assert quick_ran[0].startswith("queueing-"), "not on the type's own threads"
        try:
            assert await asyncio.wait_for(loop.getaddrinfo("localhost", 5432), STARVED)
        except TimeoutError:
            pytest.fail("a DNS lookup waited behind the hung handler threads")
    finally:
        body.release.set()
        small.shutdown(wait=False)


async def test_context_variables_flow_into_the_handlers_thread() -> None:
    @queue("threads-context")
    class WithContext(QueueMessage):
        pass

    tenant: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")
    app = QueueingApp("threads")
    seen: list[str] = []

    @app.handler()
    def handle(msg: WithContext, ctx: HandlerContext) -> None:
        seen.append(tenant.get())

    pipe, prod = make(app)
    tenant.set("t-1")
    assert isinstance(await pipe.process(delivery(prod, WithContext())), Complete)
    assert seen == ["t-1"]


async def test_a_types_threads_are_as_many_as_its_slots_and_end_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    from queueing_core.app import HandlerThreads

    monkeypatch.setattr("queueing_core.app.THREAD_IDLE", 0.05)
    pool = HandlerThreads(3, "idle")
    gate = threading.Event()
    calls = [pool.submit(gate.wait, WAIT) for _ in range(5)]
    await until(lambda: pool.threads == 3, "the pool did not start its threads")
    gate.set()
    assert [await asyncio.wrap_future(c) for c in calls] == [True] * 5
    await until(lambda: pool.threads == 0, "idle threads did not end")
    # and a new call after they ended starts one again
    assert await asyncio.wrap_future(pool.submit(lambda: 42)) == 42


def test_a_hung_handler_thread_does_not_hold_up_the_process_exit(tmp_path: Path) -> None:
    """A worker stopped with a handler still blocked hands its message back and closes; the process
    then exits. (On the loop's default executor, ``asyncio.run`` waited for the thread for ever.)"""
    script = tmp_path / "hung.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from queueing_core import QueueingApp, QueueMessage, queue
            from queueing_core.testing import in_process
            from queueing_core.worker import Worker

            @queue("exit-hung")
            class Hung(QueueMessage):
                pass

            app = QueueingApp("exit")
            entered = threading.Event()

            @app.handler()
            def hang(msg: Hung) -> None:
                entered.set()
                threading.Event().wait()  # never returns

            async def main():
                runtime = in_process(app)
                async with Worker(runtime, shutdown_timeout=0.2):
                    await app.enqueue(Hung())
                    assert await asyncio.to_thread(entered.wait, 30)
                print("stopped", flush=True)

            asyncio.run(main())
            """
        )
    )
    try:
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: it waited for the hung handler's thread")
    assert done.returncode == 0, done.stderr
    assert "stopped" in done.stdout


def test_a_thread_that_outlives_its_event_loop_still_gives_its_slot_back() -> None:
    """A pipeline used again on a new loop (``asyncio.run`` twice, a fixture shared across tests): a
    thread that returned after its loop closed kept its type's slot for good, and the second loop's
    run waited for ever (found by a review)."""

    @queue("loop-slot", max_concurrency=1, time_limit=timedelta(milliseconds=100))
    class Slow(QueueMessage):
        n: int = 0

    app = QueueingApp("loop-slot")
    gate = threading.Event()

    @app.handler()
    def handle(msg: Slow) -> None:
        gate.wait(5)  # past its time limit, then returns

    pipe = Pipeline(app, MemoryControlStore(), rand=lambda: 0.5)
    prod = Producer(app, _NullProvider())

    def one() -> Delivery:
        env = prod.envelope_for(Slow())
        return Delivery(queue=env.queue, raw=env.encode(), envelope=env, malformed=None, attempt=1)

    asyncio.run(pipe.process(one()))  # decided at its time limit; its thread runs on
    gate.set()
    sub = app.subscription("Slow")
    assert sub is not None
    for _ in range(500):  # the thread returns, after its loop has closed
        if pipe.limiter(sub)._value == 1:
            break
        time.sleep(0.01)
    assert pipe.limiter(sub)._value == 1

    async def again() -> object:
        return await asyncio.wait_for(pipe.process(one()), 10)

    assert asyncio.run(again()) is not None
