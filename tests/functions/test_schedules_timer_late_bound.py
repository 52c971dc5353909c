"""How late a run of the schedules timer may come and still enqueue every tick of a schedule more
frequent than the timer: up to QUEUEING_SCHEDULE_GRACE_SECONDS late (the documented bound). A run
later than that is an outage: the ticks older than the grace plus the timer's interval are missed, and
catch_up decides (the default, "once": the newest of them is enqueued, the older ones are not)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from functions import build_app
from functions.host import FunctionsHost
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.settings import QueueingSettings
from tests.functions.conftest import functions_of, user


@queue("timed-late-bound")
class TimedLateBound(QueueMessage):
    n: int = 0


@pytest.mark.parametrize(
    ("late", "never_enqueued"),
    # 3 s late (a cold start) to 59 s: every tick; 70 s late: 1..9 s are missed, 10 s is the newest missed
    [(3, []), (59, []), (70, list(range(1, 10)))],
)
async def test_a_late_schedules_timer_run_enqueues_every_tick_within_the_documented_bound(
    tmp_path: Path, late: int, never_enqueued: list[int]
) -> None:
    t0 = datetime(2026, 3, 2, 12, 0, 0, tzinfo=UTC)
    now = [t0 + timedelta(seconds=0.2)]
    app = QueueingApp("fn-beats-late")
    app.every(timedelta(seconds=1), TimedLateBound(n=0), name="beat")

    @app.handler()
    async def handle(msg: TimedLateBound) -> None:
        pass

    cfg = QueueingSettings(
        provider="sql", database_url=f"sqlite:///{tmp_path}/fn.db", functions_local_sqlite=True
    )
    assert (cfg.schedule_grace_seconds, cfg.functions_schedules_schedule) == (60, "0 * * * * *")
    host = FunctionsHost(app, cfg)
    fns = functions_of(build_app(cfg, app, host=host, env={}))
    rt = await host.runtime()
    rt.clock = lambda: now[0]
    try:
        await user(fns["queueing_schedules"])(TimerRequest(past_due=False))  # the 12:00 run
        now[0] = t0 + timedelta(seconds=60 + late + 0.2)  # the 12:01 run, late
        await user(fns["queueing_schedules"])(TimerRequest(past_due=True))
        ticks = rt.provider.tables.ticks
        async with rt.provider.engine.connect() as conn:
            fired = (
                await conn.execute(sa.select(ticks.c.tick_at).where(ticks.c.schedule == "beat"))
            ).scalars()
            seconds = {round((t.replace(tzinfo=UTC) - t0).total_seconds()) for t in fired}
        pending = await rt.tracker.counts()
    finally:
        await rt.close()
    assert sorted(set(range(60 + late + 1)) - seconds) == never_enqueued
    assert pending == {("timed-late-bound", "Pending"): len(seconds)}  # one message a tick, no more


def test_the_docs_state_the_bound_of_a_late_run() -> None:
    text = Path(__file__).parents[2].joinpath("docs/concepts/schedules.md").read_text()
    flat = " ".join(text.split())
    assert "every one of them, even when the run comes late" not in flat
    assert "as long as the run comes at most `QUEUEING_SCHEDULE_GRACE_SECONDS` late" in flat
