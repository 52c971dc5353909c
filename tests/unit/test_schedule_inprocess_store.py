"""The in-process provider's schedules: one tick store per provider, shared by every Scheduler of the
runtime (the worker's, a test's) and by the ops API, as the hosts of a deployment share theirs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.scheduler import Scheduler, tick_store_for

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@queue("inprocess-beats")
class InProcessBeat(QueueMessage):
    pass


async def test_two_schedulers_on_one_runtime_fire_a_tick_once_and_ops_shows_it() -> None:
    app = QueueingApp("inprocess-schedules")
    app.every(timedelta(minutes=1), InProcessBeat(), name="beat")

    @app.handler()
    async def handle(msg: InProcessBeat) -> None:
        pass

    rt = app.use(InProcessProvider())
    async with rt:
        assert tick_store_for(rt) is tick_store_for(rt)
        assert await Scheduler(rt).run_due(T0 + timedelta(seconds=1)) == 1
        assert await Scheduler(rt).run_due(T0 + timedelta(seconds=2)) == 0  # claimed already
        [info] = await OpsService(rt, clock=lambda: T0 + timedelta(seconds=3)).schedules()
        assert info.last_tick == T0
        assert await rt.tracker.counts() == {("inprocess-beats", "Pending"): 1}  # one message, not two
    # another provider (another process, in effect) has a store of its own
    other = app.use(InProcessProvider())
    assert tick_store_for(other) is not tick_store_for(rt)
