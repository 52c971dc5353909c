"""The decisions the pipeline makes. Transports only settle them (DESIGN.md: "the one idea")."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from .clock import as_utc
from .messages import MessageStatus
from .storable import storable_text

#: the longest reason a store keeps (the SQL transport's column): a waiting message's reason names its
#: type or queue, up to 256 characters, and a longer reason failed its settlement on PostgreSQL: the
#: lease lapsed and the sweeper counted an attempt the handler never ran
REASON_CHARS = 128


def _keep_reason(decision: Complete | Defer | Release) -> None:
    """The decision's ``reason`` as every store keeps it (see :func:`_keep_text`), cut to fit."""
    _keep_text(decision, "reason")
    text = decision.reason
    if text is not None and len(text) > REASON_CHARS:
        object.__setattr__(decision, "reason", text[: REASON_CHARS - 1] + "\u2026")


def _keep_text(decision: object, name: str) -> None:
    """The decision's text ``name`` as every store keeps it. It may be a handler's exception text or a
    reason it gave, which may hold U+0000 or a lone surrogate; a store refuses those, and one settlement
    refused fails the whole batch it rides in, on every try (the other messages, successes included,
    ran again when their leases lapsed). Replaced here, once, whatever the transport and the history."""
    text = getattr(decision, name)
    if text is not None:
        kept = storable_text(text)
        if kept is not text:
            object.__setattr__(decision, name, kept)  # (frozen: set once, as it is made)


class DeadLetterReason(StrEnum):
    MALFORMED_ENVELOPE = "malformed-envelope"
    INVALID_BODY = "invalid-body"
    MAX_ATTEMPTS = "max-attempts-exceeded"
    NON_RETRYABLE = "non-retryable"
    EXPIRED = "expired"

    @property
    def pascal(self) -> str:
        """The spelling Service Bus users expect in ``DeadLetterReason``."""
        return {
            "malformed-envelope": "MalformedEnvelope",
            "invalid-body": "InvalidBody",
            "max-attempts-exceeded": "MaxDeliveryAttemptsExceeded",
            "non-retryable": "NonRetryable",
            "expired": "Expired",
        }[self.value]


@dataclass(frozen=True, slots=True)
class Complete:
    result: Any = None
    cancelled: bool = False
    #: why a message ended without running (a cancelled one superseded by a newer version)
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.reason is not None:  # (most have none: no call for them)
            _keep_reason(self)

    @property
    def status(self) -> MessageStatus:
        return MessageStatus.CANCELLED if self.cancelled else MessageStatus.SUCCEEDED


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """A failed attempt: try again after ``delay`` (the attempt is counted)."""

    delay: timedelta
    error: str

    status = MessageStatus.FAILED

    def __post_init__(self) -> None:
        _keep_text(self, "error")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason: DeadLetterReason
    description: str

    status = MessageStatus.DEAD_LETTERED

    def __post_init__(self) -> None:
        _keep_text(self, "description")


@dataclass(frozen=True, slots=True)
class Defer:
    """Not now, and not a failure: paused, circuit open, waiting for a handler, sleeping."""

    until: datetime
    status: MessageStatus
    reason: str
    counts_attempt: bool = False
    #: the handler succeeded and asked to run again later: the next run starts with fresh attempts
    reset_attempts: bool = False
    #: with ``reset_attempts``, the message's expiry from then on (None: it never expires). A run
    #: asked for later starts the type's expiration again from that time: kept, the first run's expiry
    #: expired the message before its second run (a recurring job ran once)
    expires_at: datetime | None = None

    def __post_init__(self) -> None:
        _keep_reason(self)
        if self.until.tzinfo is not UTC or self.until > LATEST:
            object.__setattr__(self, "until", _in_utc(self.until))  # (frozen: set once, as it is made)


#: the latest time a deferral keeps: a day short of the year 10000, so that the time read back in any
#: time zone is still a date (PostgreSQL gives a timestamp as text in its session's zone, and one 14
#: hours ahead of UTC made the last hours of 9999 a year 10000 that no reader takes: "never" as a
#: handler may say it, ``datetime.max``, failed every read of its history while it slept)
LATEST = datetime(9999, 12, 30, tzinfo=UTC)


def _in_utc(when: datetime) -> datetime:
    """A deferral's time as every time the kit keeps: in UTC, a naive one taken as UTC. It may be a
    handler's "run again at"; left naive, it failed the settlement after the handler had succeeded,
    where it met an aware time. One past :data:`LATEST` (or past the year 9999 once in UTC) is
    :data:`LATEST`; one before the year 1 in UTC is the first time there is."""
    try:
        return min(as_utc(when), LATEST)
    except OverflowError:
        return LATEST if when.year == datetime.max.year else datetime.min.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Release:
    """Give the lease back untouched (shutdown, lost interest); the attempt is not counted."""

    reason: str

    status = MessageStatus.PENDING

    def __post_init__(self) -> None:
        _keep_reason(self)


@dataclass(frozen=True, slots=True)
class Expire:
    expired_at: datetime

    status = MessageStatus.EXPIRED


Decision = Complete | RetryAfter | DeadLetter | Defer | Release | Expire


def counts_attempt(decision: Decision) -> bool:
    """Whether the delivery that led to ``decision`` used up an attempt."""
    if isinstance(decision, Defer):
        return decision.counts_attempt
    return not isinstance(decision, Release)


def due_at(decision: RetryAfter | Defer | Release, now: datetime) -> datetime | None:
    """When a message settled by sending a copy runs again (None: at once)."""
    if isinstance(decision, RetryAfter):
        return now + decision.delay
    if isinstance(decision, Defer):
        return decision.until
    return None


def dead_letter_of(decision: Expire | DeadLetter) -> tuple[DeadLetterReason, str]:
    """The reason and description a dead-lettering decision carries (expiry is one as well)."""
    if isinstance(decision, Expire):
        return DeadLetterReason.EXPIRED, f"expired at {decision.expired_at.isoformat()}"
    return decision.reason, decision.description
