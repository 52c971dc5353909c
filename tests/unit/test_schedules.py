"""Schedules: registration, tick arithmetic, catch-up after an outage, pause, one enqueue per tick."""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from queueing_core import QueueingApp, QueueMessage
from queueing_core.errors import RegistrationError
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.scheduler import Scheduler
from queueing_core.schedules import SCHEDULE_HEADER, TICK_HEADER, Schedule, tick_message_id
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
        # NCRONTAB's seconds-first six fields: croniter would read the sixth as seconds, at the end
        (lambda app: app.schedule("0 0 9 * * *")(lambda: None), "has 6 fields.*'0 9 \\* \\* \\*'"),
        (lambda app: app.schedule("0 0 9 * * * 2027")(lambda: None), "has 7 fields"),
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


# -- daylight saving ---------------------------------------------------------------------------------
# 2024-10-27 Berlin goes from CEST (UTC+2) to CET (UTC+1) at 01:00 UTC: 02:00-03:00 local happens twice
# (00:00-01:00 and 01:00-02:00 UTC). 2024-11-03 New York goes from EDT to EST at 06:00 UTC: 01:00-02:00
# local happens twice (05:00-06:00 and 06:00-07:00 UTC). 2024-04-07 Lord Howe Island goes back half an
# hour at 15:00 UTC: 01:30-02:00 local happens twice (14:30-15:00 and 15:00-15:30 UTC).
BERLIN_FALL = (datetime(2024, 10, 26, 22, 0, tzinfo=UTC), datetime(2024, 10, 27, 4, 0, tzinfo=UTC))
NEW_YORK_FALL = (datetime(2024, 11, 3, 3, 0, tzinfo=UTC), datetime(2024, 11, 3, 9, 0, tzinfo=UTC))
LORD_HOWE_FALL = (datetime(2024, 4, 6, 13, 0, tzinfo=UTC), datetime(2024, 4, 6, 17, 0, tzinfo=UTC))
FALL_BACK = [
    # (zone, window, cron, whether it runs in both occurrences of the repeated hour)
    ("Europe/Berlin", BERLIN_FALL, "0 * * * *", True),
    ("Europe/Berlin", BERLIN_FALL, "*/30 * * * *", True),
    ("Europe/Berlin", BERLIN_FALL, "45 */2 * * *", True),
    ("Europe/Berlin", BERLIN_FALL, "@hourly", True),
    ("Europe/Berlin", BERLIN_FALL, "30 2 * * *", False),
    ("Europe/Berlin", BERLIN_FALL, "15,45 2 * * *", False),
    ("Europe/Berlin", BERLIN_FALL, "0 1-3 * * *", False),
    ("America/New_York", NEW_YORK_FALL, "0 * * * *", True),
    ("America/New_York", NEW_YORK_FALL, "*/20 * * * *", True),
    ("America/New_York", NEW_YORK_FALL, "30 1 * * *", False),
    ("Australia/Lord_Howe", LORD_HOWE_FALL, "*/7 * * * *", True),
    ("Australia/Lord_Howe", LORD_HOWE_FALL, "45 1 * * *", False),
]
FALL_BACK_ZONES = [
    ("Europe/Berlin", BERLIN_FALL),
    ("America/New_York", NEW_YORK_FALL),
    ("Australia/Lord_Howe", LORD_HOWE_FALL),
]


def _wall_clock_ticks(cron: str, zone: str, window: tuple[datetime, datetime], twice: bool) -> list[datetime]:
    """The expected ticks, minute by minute in UTC: the local time matches the expression, and a local
    time already seen earlier in the window (the repeated hour) counts only for an interval-like one."""
    from croniter import croniter

    start, end = window
    seen: set[datetime] = set()
    ticks: list[datetime] = []
    minute = start
    while minute < end:
        local = minute.astimezone(ZoneInfo(zone)).replace(tzinfo=None)
        if croniter.match(cron, local) and (twice or local not in seen):
            ticks.append(minute)
        seen.add(local)
        minute += timedelta(minutes=1)
    return ticks


async def _ticks_fired(
    crons: list[str], zone: str, window: tuple[datetime, datetime], step: timedelta
) -> dict[str, list[datetime]]:
    """Drive the real scheduler across the window, a round every ``step``, as a worker would."""
    app = QueueingApp()
    fired: dict[str, list[datetime]] = {}
    for i, cron in enumerate(crons):
        fired[cron] = []
        app.schedule(cron, timezone=zone, name=f"s{i}")(lambda tick, seen=fired[cron]: seen.append(tick))
    rt = app.use(InProcessProvider())
    scheduler = Scheduler(rt)
    async with rt:
        now = window[0] + timedelta(seconds=5)
        while now < window[1]:
            await scheduler.run_due(now)
            now += step
    return fired


@pytest.mark.parametrize(("zone", "window"), FALL_BACK_ZONES)
async def test_cron_schedules_run_each_wall_clock_time_as_documented_across_fall_back(
    zone: str, window: tuple[datetime, datetime]
) -> None:
    cases = [(cron, twice) for z, w, cron, twice in FALL_BACK if z == zone]
    fired = await _ticks_fired([cron for cron, _ in cases], zone, window, timedelta(seconds=30))
    for cron, twice in cases:
        # interval-like: both occurrences (an hourly job keeps one run per real hour); a fixed
        # wall-clock time: once, at its first occurrence; and never a late catch-up of the second
        assert fired[cron] == _wall_clock_ticks(cron, zone, window, twice), cron


def test_hourly_in_berlin_runs_once_per_real_hour_through_the_repeated_hour() -> None:
    app = QueueingApp()
    app.schedule("0 * * * *", timezone="Europe/Berlin", name="hourly")(lambda: None)
    s = app.schedules.get("hourly")
    assert s is not None
    # 02:00 CET (01:00 UTC), the second 02:00 of the night, is a tick of its own
    assert s.at_or_before(datetime(2024, 10, 27, 1, 0, 5, tzinfo=UTC)) == datetime(
        2024, 10, 27, 1, tzinfo=UTC
    )
    assert s.due(
        datetime(2024, 10, 27, 0, tzinfo=UTC), datetime(2024, 10, 27, 1, 0, 5, tzinfo=UTC), GRACE
    ) == [datetime(2024, 10, 27, 1, tzinfo=UTC)]


@pytest.mark.parametrize(("zone", "window", "cron", "twice"), FALL_BACK)
def test_at_or_before_and_next_after_agree_through_the_repeated_hour(
    zone: str, window: tuple[datetime, datetime], cron: str, twice: bool
) -> None:
    app = QueueingApp()
    app.schedule(cron, timezone=zone, name="s")(lambda: None)
    s = app.schedules.get("s")
    assert s is not None
    when = window[0] + timedelta(minutes=1, seconds=7)
    while when < window[1]:
        tick = s.at_or_before(when)
        assert tick <= when < s.next_after(tick), (cron, when)
        assert s.next_after(when) == s.next_after(tick), (cron, when)
        when += timedelta(minutes=7, seconds=3)


def test_an_outage_across_the_repeated_hour_catches_up_its_newest_tick_once() -> None:
    app = QueueingApp()
    app.schedule("0 * * * *", timezone="Europe/Berlin", name="hourly")(lambda: None)
    s = app.schedules.get("hourly")
    assert s is not None
    down = datetime(2024, 10, 26, 22, tzinfo=UTC)  # every host down from midnight (local) to 02:45 CET
    assert s.due(down, datetime(2024, 10, 27, 1, 45, tzinfo=UTC), GRACE) == [
        datetime(2024, 10, 27, 1, tzinfo=UTC)
    ]


async def test_spring_forward_runs_a_skipped_wall_clock_time_once_when_the_clock_jumps() -> None:
    # 2024-03-31 Berlin jumps from 02:00 CET to 03:00 CEST at 01:00 UTC: there is no 02:30 that night
    window = (datetime(2024, 3, 30, 22, 0, tzinfo=UTC), datetime(2024, 3, 31, 4, 0, tzinfo=UTC))
    fired = await _ticks_fired(["30 2 * * *", "0 * * * *"], "Europe/Berlin", window, timedelta(seconds=20))
    assert fired["30 2 * * *"] == [datetime(2024, 3, 31, 1, tzinfo=UTC)]
    assert fired["0 * * * *"] == [window[0] + timedelta(hours=k) for k in range(6)]


# -- expressions that never match ----------------------------------------------------------------------


@pytest.mark.parametrize("cron", ["0 0 30 2 *", "0 12 31 4 *"])
def test_a_cron_expression_that_never_matches_fails_at_registration_naming_it(cron: str) -> None:
    app = QueueingApp()
    with pytest.raises(RegistrationError, match=rf"schedule 'never'.*{re.escape(repr(cron))}.*never matches"):
        app.schedule(cron, name="never")(lambda: None)
    assert app.schedules.get("never") is None


def _with_unmatchable_schedule(app: QueueingApp) -> None:
    """A schedule whose next tick cannot be computed (registration refuses one: added behind its back)."""
    app.schedules._add(Schedule("feb30", lambda: None, cron="0 0 30 2 *"))


def test_next_wake_skips_a_schedule_whose_next_tick_fails_and_warns_once_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = QueueingApp()
    app.every(timedelta(seconds=10), Report(), name="tens")
    _with_unmatchable_schedule(app)
    scheduler = Scheduler(app.use(InProcessProvider()), poll=30.0)
    with caplog.at_level(logging.WARNING, logger="queueing.schedules"):
        assert scheduler.next_wake(T0 + timedelta(seconds=4)) == 6.0  # the other schedule's next tick
        assert scheduler.next_wake(T0 + timedelta(seconds=5)) == 5.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("schedule feb30: cannot compute its next tick")


async def test_the_scheduler_task_outlives_a_schedule_whose_next_tick_fails() -> None:
    app = QueueingApp()
    beats: list[datetime] = []
    three = asyncio.Event()

    def beat(tick: datetime) -> None:
        beats.append(tick)
        if len(beats) == 3:
            three.set()

    app.every(timedelta(seconds=1), beat, name="beat")
    _with_unmatchable_schedule(app)
    clock = iter(T0 + timedelta(seconds=k) for k in range(10_000))  # a second further each round
    rt = app.use(InProcessProvider(), clock=lambda: next(clock))
    scheduler = Scheduler(rt, poll=0.0)  # no waiting between rounds: the rounds follow the fake clock
    async with rt:
        task = asyncio.create_task(scheduler.run(), name="queueing-schedules")
        waiter = asyncio.create_task(three.wait())
        # returns at the third beat, or at once if the task ends (the timeout only bounds a hang)
        await asyncio.wait({task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        ended = task.done()
        for t in (task, waiter):
            t.cancel()
        outcome = (await asyncio.gather(task, waiter, return_exceptions=True))[0]
    assert not ended, f"the scheduler task ended: {outcome!r}"
    assert len(beats) >= 3
