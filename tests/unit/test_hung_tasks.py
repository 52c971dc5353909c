"""The report a test near its timeout prints: every asyncio task, down the chain of what it awaits."""

from __future__ import annotations

import asyncio

from tests.hung_tasks import _print_tasks


async def _waits_on(event: asyncio.Event) -> None:
    await event.wait()


async def _calls_down(event: asyncio.Event) -> None:
    await _waits_on(event)


async def test_each_task_is_printed_down_to_what_it_waits_on(capsys):
    event = asyncio.Event()
    task = asyncio.create_task(_calls_down(event), name="held-task")
    await asyncio.sleep(0)  # it runs up to its wait
    _print_tasks(asyncio.get_running_loop(), "the::test")
    event.set()
    await task
    err = capsys.readouterr().err
    assert "the::test: near its timeout, 2 asyncio task(s)" in err
    held = err[err.index("held-task:") :]
    # outermost first, down to the lock's own wait
    assert held.index("in _calls_down") < held.index("in _waits_on") < held.index("in wait")
    assert "in test_each_task_is_printed_down_to_what_it_waits_on" in err
