"""A test still running shortly before its timeout prints the stack of every asyncio task: what
pytest-timeout shows is the threads', and a hung async test's thread only sits in the event loop's
``select``, which says nothing of what the test awaits (a dispatcher's stop, a pool, a lock)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import pytest

#: seconds before the timeout: enough for the tasks' stacks to be printed before the test is failed
AHEAD = 20.0


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, KeyError):
        return 0.0


def _awaiting(awaitable: object) -> list[str]:
    """Where a suspended coroutine waits, outermost first, down its chain of awaits (a task's own
    stack shows a suspended coroutine's outermost frame only)."""
    lines: list[str] = []
    while awaitable is not None and len(lines) < 100:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        frame = frame or getattr(awaitable, "gi_frame", None)
        if frame is not None:
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
    print(f"\n--- {nodeid}: near its timeout, {len(tasks)} asyncio task(s) ---", file=sys.stderr)
    for task in tasks:
        print(f"{task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        print("\n".join(_awaiting(task.get_coro())), file=sys.stderr)
    sys.stderr.flush()


def _dump(nodeid: str) -> None:
    # the test's loop belongs to its thread: its tasks are read there, between two of its callbacks
    for loop in [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]:
        if loop.is_running():
            loop.call_soon_threadsafe(_print_tasks, loop, nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    # the whole of setup, call and teardown, as pytest-timeout times it: a fixture's teardown (a
    # schema dropped behind a lock, a pool closed) hangs as well as a test's body
    timeout = _timeout(item)
    if timeout <= AHEAD:
        return (yield)
    timer = threading.Timer(timeout - AHEAD, _dump, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()
