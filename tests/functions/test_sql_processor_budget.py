"""The SQL processor timer at its budget's end (on SQLite, as the other timer tests): a handler still
running then gets the processor's stop grace to finish, and one that outlasts the grace too counts a
failed attempt, so a handler longer than a run is dead-lettered with its reason rather than started
on every tick for ever. A worker's own stop (a deploy, a restart) still hands a running handler back
with no attempt counted. And the margin the budget is held to covers the stop the grace makes longer.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from azure.functions.timer import TimerRequest

from functions import BUDGET_MARGIN, STOP_BEYOND_GRACE, build_app
from functions.host import PROCESSOR_STOP_GRACE, FunctionsHost
from queueing_core import QueueingApp, QueueMessage, RetryPolicy, queue
from queueing_core.settings import QueueingSettings
from queueing_core.worker import CLAIM_GRACE, CLOSE_FLOOR, Worker

from .conftest import functions_of, user

#: see test_timers_and_http: the apps are kept until the session ends
_KEPT: list[Any] = []


# a lease no run here outlasts; attempts retried at once (the next tick finds them due)
@queue(
    "budget-slow",
    lease_duration=timedelta(seconds=60),
    max_attempts=2,
    retry=RetryPolicy(base=timedelta(milliseconds=10), jitter=0),
)
class Slow(QueueMessage):
    #: seconds after ``until_from`` (a monotonic time) the handler returns
    seconds: float
    until_from: float = 0.0


def sql_app(tmp_path: Any, budget: float) -> tuple[QueueingApp, FunctionsHost, dict[str, Any], list[float]]:
    app = QueueingApp("budget")
    started: list[float] = []

    @app.handler()
    async def handle(msg: Slow) -> None:
        started.append(time.monotonic())
        await asyncio.sleep(max(0.0, msg.until_from + msg.seconds - time.monotonic()))

    cfg = QueueingSettings(
        provider="sql",
        database_url=f"sqlite:///{tmp_path}/fn.db",
        functions_local_sqlite=True,  # one host in this test
        functions_processor_budget=budget,
    )
    host = FunctionsHost(app, cfg)
    _KEPT.append(build_app(cfg, app, host=host, env={}))
    return app, host, functions_of(_KEPT[-1]), started


async def test_a_handler_running_at_the_budgets_end_gets_the_stop_grace(tmp_path: Any) -> None:
    """Budget 5 s: the stop grace is min(10, 5 / 5) = 1 s. The handler ends half a second past the
    budget. (The grace was cut to what was left of the budget, nothing at its end: the run was
    cancelled, handed back, and started from the beginning on the next tick.)"""
    app, host, fns, started = sql_app(tmp_path, budget=5)
    rt = await host.runtime()
    t0 = time.monotonic()
    sent = await app.enqueue(Slow(seconds=5.5, until_from=t0))
    await user(fns["queueing_sql_processor"])(TimerRequest(past_due=False))
    rec = await rt.tracker.get(sent.message_id)
    await rt.close()
    assert rec is not None
    assert (rec.status, rec.attempt, len(started)) == ("Succeeded", 1, 1), rec.last_error


async def test_a_handler_longer_than_budget_and_grace_counts_attempts_until_dead_lettered(
    tmp_path: Any,
) -> None:
    """Budget 1 s, grace 0.2 s, a handler of 30 s: each tick cuts it, and each cut is a failed
    attempt; after max_attempts (2) it is dead-lettered naming the budget. (Handed back uncounted, it
    was started on every tick, for ever, attempt 0, Pending.)"""
    app, host, fns, started = sql_app(tmp_path, budget=1)
    rt = await host.runtime()
    sent = await app.enqueue(Slow(seconds=30, until_from=time.monotonic()))
    for _ in range(3):
        await user(fns["queueing_sql_processor"])(TimerRequest(past_due=False))
    rec = await rt.tracker.get(sent.message_id)
    await rt.close()
    assert rec is not None
    assert (rec.status, rec.attempt, len(started)) == ("DeadLettered", 2, 2), (
        rec.status,
        rec.attempt,
        started,
    )
    assert rec.reason == "max-attempts-exceeded"
    assert "cut short: still running after its host's budget (1 s)" in (rec.description or ""), (
        rec.description
    )


async def test_a_workers_own_stop_still_hands_a_running_handler_back_uncounted(tmp_path: Any) -> None:
    """A worker's stop (not a scheduled host's budget): a handler still running at its deadline is
    given back with no attempt used, as the docs promise for a deploy or a restart."""
    app, host, _fns, started = sql_app(tmp_path, budget=5)
    rt = await host.runtime()
    sent = await app.enqueue(Slow(seconds=30, until_from=time.monotonic()))
    worker = Worker(rt, shutdown_timeout=0.2, poll_min=0.05, poll_max=0.2, schedules=False)
    await worker.start()
    for _ in range(200):
        if started:
            break
        await asyncio.sleep(0.05)
    assert started, "the handler never started"
    await worker.shutdown()
    rec = await rt.tracker.get(sent.message_id)
    await rt.close()
    assert rec is not None
    assert (rec.status, rec.attempt) == ("Pending", 0), (rec.status, rec.attempt, rec.last_error)


def test_the_budget_margin_covers_the_longest_stop_and_a_cold_open() -> None:
    """What ``functionTimeout`` must leave after the budget: the stop grace, then the worker's own
    bound past it (the claims' grace, the final flush, the close), then opening the runtime."""
    assert STOP_BEYOND_GRACE == CLAIM_GRACE + 2 * CLOSE_FLOOR  # (restated in functions/: not imported)
    assert BUDGET_MARGIN >= PROCESSOR_STOP_GRACE + STOP_BEYOND_GRACE + 10
