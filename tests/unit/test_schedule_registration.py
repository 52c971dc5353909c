"""Schedule registration: cron expressions every host reads the same way, and one schedule per name."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import QueueingApp, QueueMessage
from queueing_core.app import Router
from queueing_core.errors import RegistrationError

NOW = datetime(2026, 3, 2, 5, 30, tzinfo=UTC)


class Digest(QueueMessage):
    pass


@pytest.mark.parametrize(
    ("cron", "field", "value"),
    [
        ("R * * * *", "minute", "R"),
        ("R(0-5) * * * *", "minute", "R(0-5)"),
        ("0 R * * *", "hour", "R"),
        ("0 6 r * *", "day-of-month", "r"),
        ("0 6 * R(1-6) *", "month", "R(1-6)"),
        ("0 6 * * R", "day-of-week", "R"),
        ("R/15 * * * *", "minute", "R/15"),
        ("H 6 * * *", "minute", "H"),
        ("H(0-29)/10 * * * *", "minute", "H(0-29)/10"),
    ],
)
def test_a_random_or_hashed_cron_field_is_refused_naming_the_field(cron: str, field: str, value: str) -> None:
    # croniter draws R anew each time it reads the expression: each host (and each round of one host)
    # would compute other ticks, and the schedule would fire at random many times an hour
    app = QueueingApp()
    said = re.escape(f"the {field} field {value!r} is croniter's random (R) or hashed (H) value")
    with pytest.raises(RegistrationError, match=said):
        app.schedule(cron, name="drawn")(lambda: None)
    assert app.schedules.get("drawn") is None


@pytest.mark.parametrize("cron", ["@reboot", "@every 5m", "@weekdays"])
def test_an_at_name_that_is_no_timetable_is_refused(cron: str) -> None:
    with pytest.raises(RegistrationError, match="of the @-names, only @annually, @daily, @hourly"):
        QueueingApp().schedule(cron, name="s")(lambda: None)


@pytest.mark.parametrize(
    ("cron", "next_tick"),
    [
        ("@hourly", datetime(2026, 3, 2, 6, 0, tzinfo=UTC)),
        ("@DAILY", datetime(2026, 3, 3, 0, 0, tzinfo=UTC)),
        ("@midnight", datetime(2026, 3, 3, 0, 0, tzinfo=UTC)),
        ("@weekly", datetime(2026, 3, 8, 0, 0, tzinfo=UTC)),
        ("@monthly", datetime(2026, 4, 1, 0, 0, tzinfo=UTC)),
        ("@yearly", datetime(2027, 1, 1, 0, 0, tzinfo=UTC)),
        ("0 6 * * MON-FRI", datetime(2026, 3, 2, 6, 0, tzinfo=UTC)),
        ("30 */2 * * *", datetime(2026, 3, 2, 6, 30, tzinfo=UTC)),
    ],
)
def test_five_field_expressions_and_their_at_names_are_taken_and_always_give_the_same_ticks(
    cron: str, next_tick: datetime
) -> None:
    app = QueueingApp()
    app.schedule(cron, name="s")(lambda: None)
    s = app.schedules.get("s")
    assert s is not None
    assert {s.next_after(NOW) for _ in range(20)} == {next_tick}


def test_two_timetables_stacked_on_one_function_fail_asking_for_names() -> None:
    app = QueueingApp()
    with pytest.raises(
        RegistrationError, match=r"two schedules are named .*'0 6 \* \* \*'.*give each its own name="
    ):

        @app.schedule("0 6 * * *", timezone="Europe/Paris")
        @app.schedule("0 18 * * *", timezone="Europe/Paris")
        def twice_a_day() -> Digest:
            return Digest()

    # with a name each, both are kept
    @app.schedule("0 6 * * *", timezone="Europe/Paris", name="morning")
    @app.schedule("0 18 * * *", timezone="Europe/Paris", name="evening")
    def twice_a_day_named() -> Digest:
        return Digest()

    assert sorted((s.name, s.cron) for s in app.schedules if s.name in ("morning", "evening")) == [
        ("evening", "0 18 * * *"),
        ("morning", "0 6 * * *"),
    ]


def report() -> Digest:
    return Digest()


@pytest.mark.parametrize(
    "other",
    [
        {"cron": "0 7 * * *"},
        {"timezone": "Europe/Paris"},
        {"catch_up": "skip"},
    ],
)
def test_the_same_function_and_name_with_another_timetable_or_policy_is_refused(
    other: dict[str, str],
) -> None:
    app = QueueingApp()
    first = {"cron": "0 6 * * *", "timezone": "UTC", "catch_up": "once"}
    app.schedule(first["cron"], timezone=first["timezone"], name="r", catch_up=first["catch_up"])(report)  # type: ignore[arg-type]
    second = {**first, **other}
    with pytest.raises(RegistrationError, match="two schedules are named 'r'"):
        app.schedule(second["cron"], timezone=second["timezone"], name="r", catch_up=second["catch_up"])(
            report
        )  # type: ignore[arg-type]
    s = app.schedules.get("r")
    assert s is not None
    assert (s.cron, s.timezone, s.catch_up) == ("0 6 * * *", "UTC", "once")


def test_the_same_interval_function_at_another_interval_is_refused() -> None:
    app = QueueingApp()
    app.every(timedelta(minutes=1), report, name="r")
    with pytest.raises(RegistrationError, match="two schedules are named 'r'"):
        app.every(timedelta(minutes=2), report, name="r")


def test_registering_the_very_same_schedule_again_is_harmless() -> None:
    # a router included twice, or a decorator run again with the same arguments
    router = Router()
    router.schedule("0 6 * * *", timezone="Europe/Paris", name="digest")(report)
    router.every(timedelta(minutes=5), report, name="five")
    app = QueueingApp()
    app.include(router)
    app.include(router)
    app.schedule("0 6 * * *", timezone="Europe/Paris", name="digest")(report)
    assert sorted(s.name for s in app.schedules) == ["digest", "five"]
    digest = app.schedules.get("digest")
    assert digest is not None
    assert digest.cron == "0 6 * * *"
