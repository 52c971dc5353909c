"""Schedules: registration, tick arithmetic, catch-up after an outage, pause, one enqueue per tick."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import QueueingApp, QueueMessage
from queueing_core.errors import RegistrationError
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.scheduler import Scheduler
from queueing_core.schedules import SCHEDULE_HEADER, TICK_HEADER, tick_message_id
from queueing_core.tracking import MessageQuery

T0 = datetime(2026, 1, 15, 12, 0, 0, tzinfo=UTC)
GRACE = timedelta(seconds=60)


class Report(QueueMessage):
    kind: str = "daily"


def test_interval_ticks_are_aligned_to_the_epoch_so_every_host_computes_the_same() -> None:
    app = QueueingApp()
    s = app.every(timedelta(seconds=10), Report())
    assert s.at_or_before(T0 + timedelta(seconds=19, microseconds=5)) == T0 + timedelta(seconds=10)
    assert s.next_after(T0 + timedelta(seconds=10)) == T0 + timedelta(seconds=20)


def test_cron_ticks_follow_the_time_zone_including_daylight_saving() -> None:
    app = QueueingApp()

    @app.schedule("0 9 * * *", timezone="Europe/Paris", name="morning")
    def morning() -> Report:
        return Report()

    s = app.schedules.get("morning")
    assert s is not None
    assert s.next_after(T0) == datetime(2026, 1, 16, 8, 0, tzinfo=UTC)  # CET: UTC+1
    assert s.next_after(datetime(2026, 7, 1, tzinfo=UTC)) == datetime(2026, 7, 1, 7, 0, tzinfo=UTC)  # CEST
    assert s.at_or_before(datetime(2026, 1, 16, 8, 0, tzinfo=UTC)) == datetime(2026, 1, 16, 8, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("catch_up", "expected"),
    [("once", [T0 - timedelta(minutes=10)]), ("skip", [])],
)
def test_a_long_outage_ends_in_at_most_one_catch_up_tick(catch_up: str, expected: list[datetime]) -> None:
    app = QueueingApp()
    s = app.every(timedelta(minutes=5), Report(), catch_up=catch_up)  # type: ignore[arg-type]
    last = T0 - timedelta(days=3)  # every host was down for three days
    assert s.due(last, T0 - timedelta(minutes=8), GRACE) == expected
    # ticks that are only a little late are on time and all run, in order
    assert s.due(T0 - timedelta(minutes=5), T0 + timedelta(seconds=30), GRACE) == [T0]


def test_a_new_schedule_starts_with_its_current_tick_only() -> None:
    app = QueueingApp()
    s = app.every(timedelta(seconds=1), Report())
    assert s.due(None, T0 + timedelta(milliseconds=300), GRACE) == [T0]
    hourly = app.every(timedelta(hours=1), Report(kind="h"))
    assert hourly.due(None, T0 + timedelta(minutes=30), GRACE) == []  # its tick is long past


def test_ticks_within_the_grace_all_run_after_a_short_restart() -> None:
    app = QueueingApp()
    s = app.every(timedelta(seconds=1), Report())
    ticks = s.due(T0, T0 + timedelta(seconds=5, milliseconds=10), GRACE)
    assert ticks == [T0 + timedelta(seconds=k) for k in range(1, 6)]


@pytest.mark.parametrize(
    ("register", "message"),
    [
        (lambda app: app.schedule("not cron")(lambda: None), "not a cron expression"),
        (lambda app: app.schedule("* * * * *", timezone="Mars/Olympus")(lambda: None), "unknown time zone"),
        (lambda app: app.every(timedelta(milliseconds=500), Report()), "at least 1 second"),
        (lambda app: app.every(timedelta(seconds=5), Report(), catch_up="all"), "catch_up"),
        (lambda app: app.schedule("* * * * *", name="bad name")(lambda: None), "schedule name"),
        (lambda app: app.schedule("* * * * *")(lambda a, b: None), r"must take \(\) or \(tick\)"),
    ],
)
def test_bad_schedules_fail_at_registration(register, message: str) -> None:
    with pytest.raises(RegistrationError, match=message):
        register(QueueingApp())


def test_two_schedules_with_one_name_fail_naming_the_clash() -> None:
    app = QueueingApp()
    app.every(timedelta(seconds=5), Report(), name="r")
    with pytest.raises(RegistrationError, match="two schedules are named 'r'"):
        app.every(timedelta(seconds=9), Report(), name="r")


async def test_each_tick_is_enqueued_once_with_ids_that_are_the_same_on_every_host() -> None:
    app = QueueingApp()
    seen: list[datetime] = []

    @app.schedule("*/5 * * * *", name="fives")
    async def fives(tick: datetime) -> list[Report]:
        seen.append(tick)
        return [Report(kind="a"), Report(kind="b")]

    rt = app.use(InProcessProvider())
    scheduler = Scheduler(rt)
    async with rt:
        assert await scheduler.run_due(T0 + timedelta(seconds=1)) == 1
        assert await scheduler.run_due(T0 + timedelta(seconds=2)) == 0  # already claimed
        assert seen == [T0]
        records = (await rt.tracker.query(MessageQuery(), limit=10)).items
    ids = {r.message_id for r in records}
    assert ids == {tick_message_id("fives", T0, 0), tick_message_id("fives", T0, 1)}
    assert all(r.headers[SCHEDULE_HEADER] == "fives" for r in records)
    assert all(r.headers[TICK_HEADER] == T0.isoformat() for r in records)


async def test_a_paused_schedule_enqueues_nothing_and_resuming_does_not_replay_its_ticks() -> None:
    app = QueueingApp()
    sent: list[datetime] = []
    app.every(timedelta(seconds=1), lambda tick: sent.append(tick), name="beat")
    rt = app.use(InProcessProvider())
    scheduler = Scheduler(rt)
    async with rt:
        await scheduler.run_due(T0)
        await rt.control.set_paused("schedule", "beat", True)
        for k in range(1, 4):
            await scheduler.run_due(T0 + timedelta(seconds=k))
        await rt.control.set_paused("schedule", "beat", False)
        await scheduler.run_due(T0 + timedelta(seconds=4))
    assert sent == [T0, T0 + timedelta(seconds=4)]


async def test_a_failing_schedule_function_leaves_its_tick_for_the_next_round() -> None:
    app = QueueingApp()
    calls: list[datetime] = []

    def flaky(tick: datetime) -> Report:
        calls.append(tick)
        if len(calls) == 1:
            raise RuntimeError("not yet")
        return Report()

    app.every(timedelta(seconds=1), flaky, name="flaky")
    rt = app.use(InProcessProvider())
    scheduler = Scheduler(rt)
    async with rt:
        assert await scheduler.run_due(T0) == 0
        assert await scheduler.run_due(T0 + timedelta(milliseconds=500)) == 1
    assert calls == [T0, T0]


def test_each_deployment_claims_ticks_where_its_hosts_share_state(tmp_path) -> None:
    from azure.data.tables.aio import TableClient

    from queueing_core.control import MemoryControlStore
    from queueing_core.providers.sql import SqlProvider
    from queueing_core.providers.tables import TablesControlStore
    from queueing_core.providers.tables_schedules import TablesTickStore
    from queueing_core.scheduler import tick_store_for
    from queueing_core.schedules import MemoryTickStore

    app = QueueingApp()
    sql = tick_store_for(app.use(SqlProvider(f"sqlite:///{tmp_path}/q.db")))
    assert getattr(sql, "writes_messages", False)  # the tick and its messages in one transaction
    table = TableClient.from_connection_string("UseDevelopmentStorage=true", "queueingcontrol")
    tables = TablesControlStore(table)  # Service Bus and Storage Queues keep pauses (and ticks) here
    assert isinstance(tick_store_for(app.use(InProcessProvider(), control=tables)), TablesTickStore)
    memory = app.use(InProcessProvider(), control=MemoryControlStore())
    assert isinstance(tick_store_for(memory), MemoryTickStore)
