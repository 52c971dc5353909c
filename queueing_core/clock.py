"""Time in one place: everything the kit stamps is timezone-aware UTC."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """Naive datetimes are taken to be UTC (as SQLite returns them); aware ones are converted."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def to_utc(value: datetime) -> datetime:
    """:func:`as_utc` for input from outside (a query string, a filter): a time whose UTC form falls
    outside the years 1-9999 is a ``ValueError`` (pydantic turns that into a validation error)."""
    try:
        return as_utc(value)
    except OverflowError:
        raise ValueError("the time is out of range once converted to UTC") from None


def opt_utc(value: datetime | None) -> datetime | None:
    return None if value is None else as_utc(value)
