"""The report a test near its timeout prints: every asyncio task, down the chain of what it awaits,
also through an async generator (``async with`` of a context manager, ``async for``), from any thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

from tests.hung_tasks import _dump, _print_tasks, _timeout


async def _waits_on(event: asyncio.Event) -> None:
    await event.wait()


async def _calls_down(event: asyncio.Event) -> None:
    await _waits_on(event)


@contextlib.asynccontextmanager
async def _entered_after(event: asyncio.Event) -> AsyncIterator[None]:
    await _waits_on(event)
    yield


async def _enters(event: asyncio.Event) -> None:
    async with _entered_after(event):
        pass


def _chain_of(err: str, task_name: str) -> str:
    """The task's line and the frames printed under it."""
    first, *rest = err[err.index(f"name='{task_name}'") :].splitlines()
    chain = [first]
    for line in rest:
        if not line.startswith("  "):
            break
        chain.append(line)
    return "\n".join(chain)


async def test_each_task_is_printed_down_to_what_it_waits_on(capsys):
    event = asyncio.Event()
    task = asyncio.create_task(_calls_down(event), name="held-task")
    await asyncio.sleep(0)  # it runs up to its wait
    _print_tasks(asyncio.get_running_loop(), "the::test")
    event.set()
    await task
    err = capsys.readouterr().err
    assert "the::test: near its timeout, 2 asyncio task(s)" in err
    held = _chain_of(err, "held-task")
    # outermost first, down to the event's own wait, and the future it waits on
    assert held.index("in _calls_down") < held.index("in _waits_on") < held.index("in wait")
    assert "wait_for=<Future pending" in held
    assert "in test_each_task_is_printed_down_to_what_it_waits_on" in err


async def test_the_chain_goes_on_through_an_async_context_manager(capsys):
    event = asyncio.Event()
    task = asyncio.create_task(_enters(event), name="entering")
    await asyncio.sleep(0)
    _print_tasks(asyncio.get_running_loop(), "the::test")
    event.set()
    await task
    held = _chain_of(capsys.readouterr().err, "entering")
    assert held.index("in _enters") < held.index("in _entered_after") < held.index("in _waits_on")


async def test_a_dump_from_another_thread_is_printed_by_the_loop_itself(capsys):
    event = asyncio.Event()
    task = asyncio.create_task(_calls_down(event), name="held-task")
    await asyncio.sleep(0)
    timer = threading.Thread(target=_dump, args=("the::test",))
    timer.start()
    timer.join()
    await asyncio.sleep(0.05)  # the loop runs the printing it was handed
    event.set()
    await task
    err = capsys.readouterr().err
    assert f"of the loop in thread {threading.current_thread().name}" in err
    assert "in _waits_on" in _chain_of(err, "held-task")


@pytest.mark.timeout(timeout=42)
def test_the_timeout_is_read_as_pytest_timeout_reads_it(request):
    assert _timeout(request.node) == 42.0
