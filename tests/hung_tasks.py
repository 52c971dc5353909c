"""A test still running shortly before its timeout prints the stack of every asyncio task: what
pytest-timeout shows is the threads', and a hung async test's thread only sits in the event loop's
``select``, which says nothing of what the test awaits (a dispatcher's stop, a pool, a lock)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import sys
import threading
from typing import Any

import pytest
import pytest_timeout

#: seconds before the timeout (at most; a tenth of a short one): enough for the tasks' stacks to be
#: printed before pytest-timeout fails the test
AHEAD = 20.0
_AGEN_AWAITS = ("async_generator_asend", "async_generator_athrow")


def _timeout(item: pytest.Item) -> float:
    """The seconds pytest-timeout gives ``item``'s setup, call and teardown together, read as it reads
    them (marker, ``--timeout``, ``PYTEST_TIMEOUT``, the ini); 0 where it times the call alone
    (``func_only``, which this suite does not set) or not at all. (A private helper of pytest-timeout:
    it has kept this name and shape since 2.0.)"""
    settings = pytest_timeout._get_item_settings(item)
    if settings.func_only or not settings.timeout:
        return 0.0
    return float(settings.timeout)


def _awaiting(awaitable: object) -> list[str]:
    """Where a suspended coroutine waits, outermost first, down its chain of awaits (a task's own
    stack shows a suspended coroutine's outermost frame only), ending with what it waits on when that
    is no future (the future a task waits on is in the task's own line)."""
    lines: list[str] = []
    for _ in range(200):  # (a chain is never this deep; a bound rather than trust)
        if type(awaitable).__name__ in _AGEN_AWAITS:
            # ``async for`` and ``async with`` of an async generator await its ``asend``, which names
            # neither the generator nor its frame: the generator is found among what it refers to
            awaitable = next((r for r in gc.get_referents(awaitable) if inspect.isasyncgen(r)), None)
        if awaitable is None:
            break
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        frame = frame or getattr(awaitable, "gi_frame", None)
        if frame is None:
            if type(awaitable).__name__ != "FutureIter":  # (a future's: the task's line names it)
                lines.append(f"  waiting on {awaitable!r}")
            break
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        awaitable = (
            getattr(awaitable, "cr_await", None)
            or getattr(awaitable, "ag_await", None)
            or getattr(awaitable, "gi_yieldfrom", None)
        )
    return lines


def _print_tasks(loop: asyncio.AbstractEventLoop, nodeid: str) -> None:
    tasks = asyncio.all_tasks(loop)
    where = threading.current_thread().name
    print(
        f"\n--- {nodeid}: near its timeout, {len(tasks)} asyncio task(s) of the loop in thread {where} ---",
        file=sys.stderr,
    )
    for task in tasks:
        print(f"{task!r}", file=sys.stderr)  # its name, its coroutine, the future it waits on
        print("\n".join(_awaiting(task.get_coro())), file=sys.stderr)
    sys.stderr.flush()


def _dump(nodeid: str) -> None:
    # each loop's tasks are read in its own thread, between two of its callbacks
    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
        if loop.is_running():
            # (closed meanwhile, as the test ended while its report began: nothing to report)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_print_tasks, loop, nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    # the whole of setup, call and teardown, as pytest-timeout times it: a fixture's teardown (a
    # schema dropped behind a lock, a pool closed) hangs as well as a test's body
    timeout = _timeout(item)
    if not timeout:
        return (yield)
    timer = threading.Timer(timeout - min(AHEAD, timeout / 10), _dump, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()
