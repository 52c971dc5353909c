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


def opt_utc(value: datetime | None) -> datetime | None:
    return None if value is None else as_utc(value)
