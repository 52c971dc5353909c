"""Tracker protocol and the record it keeps per message."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..clock import as_utc, to_utc
from ..envelope import Envelope
from ..errors import InvalidArgument, InvalidOperation
from ..messages import MessageStatus

T = TypeVar("T")


#: what a damaged record (see ``MessageRecord.malformed``) holds where a required id or time does not
#: read; the operator's views show null there
UNREADABLE_ID = UUID(int=0)
UNREADABLE_TIME = datetime(1, 1, 1, tzinfo=UTC)


class MessageRecord(BaseModel):
    """One message's life as the ops API shows it."""

    model_config = ConfigDict(frozen=False)

    message_id: UUID
    tracking_id: UUID
    type: str
    queue: str
    status: str
    attempt: int = 0
    correlation_id: str | None = None
    created_at: datetime
    updated_at: datetime
    not_before: datetime | None = None
    expires_at: datetime | None = None
    locked_by: str | None = None
    locked_until: datetime | None = None
    last_error: str | None = None
    reason: str | None = None
    description: str | None = None
    archived: bool = False
    archived_at: datetime | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    body: dict[str, Any] | None = None
    #: the raw text of a message whose envelope could not be decoded
    raw: str | None = None
    result: Any = None
    #: what a running handler last reported: ``{"step", "total", "text", "at"}``
    progress: dict[str, Any] | None = None
    #: the transport's id of a delivery whose outcome went on in a copy though the original could not
    #: be removed (Service Bus: the copy was sent, completing the original failed); if that original
    #: comes back it is recognised as a duplicate and completed without running the handler
    copied_from: str | None = None
    #: deliveries recognised as duplicates and completed without running the handler
    duplicates: int | None = None
    #: why the stored record does not read in full (damaged outside the kit), e.g. ``message id is not
    #: a UUID``; the fields named hold no value (or a stand-in) and their stored text is in ``stored``
    malformed: str | None = None
    #: the stored text of each field of a damaged record that does not read
    stored: dict[str, str] | None = None
    #: the fields of a damaged record that do not read, stored text or not (an empty one has none)
    unreadable: frozenset[str] = Field(default=frozenset(), exclude=True)

    def readable(self, name: str) -> bool:
        """Whether the field ``name`` holds what was stored (not a damaged record's stand-in)."""
        return name not in self.unreadable


class MessageQuery(BaseModel):
    """Filters for listing messages; every field is optional and they combine with AND."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    queue: str | None = None
    type: str | None = None
    status: tuple[str, ...] | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    archived: bool | None = None
    correlation_id: str | None = None
    tracking_id: UUID | None = None

    @field_validator("created_from", "created_to")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        # stored times are UTC, and SQLite compares them as text: a filter must be UTC as well
        return None if value is None else to_utc(value)

    def describe(self) -> str:
        """The filters in words, e.g. ``queue emails, status Pending or Failed`` (empty: none)."""
        parts = []
        if self.queue is not None:
            parts.append(f"queue {self.queue}")
        if self.type is not None:
            parts.append(f"type {self.type}")
        if self.status:
            parts.append("status " + " or ".join(self.status))
        if self.created_from is not None:
            parts.append(f"created at or after {self.created_from:%Y-%m-%d %H:%M:%S} UTC")
        if self.created_to is not None:
            parts.append(f"created before {self.created_to:%Y-%m-%d %H:%M:%S} UTC")
        if self.archived is not None:
            parts.append("archived" if self.archived else "not archived")
        if self.correlation_id is not None:
            parts.append(f"correlation id {self.correlation_id}")
        if self.tracking_id is not None:
            parts.append(f"tracking id {self.tracking_id}")
        return ", ".join(parts)

    def matches(self, r: MessageRecord) -> bool:
        return (
            (self.queue is None or r.queue == self.queue)
            and (self.type is None or r.type == self.type)
            and (self.status is None or r.status in self.status)
            and (self.created_from is None or r.created_at >= self.created_from)
            and (self.created_to is None or r.created_at < self.created_to)
            and (self.archived is None or r.archived == self.archived)
            and (self.correlation_id is None or r.correlation_id == self.correlation_id)
            and (self.tracking_id is None or r.tracking_id == self.tracking_id)
        )


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


def invalid_cursor() -> InvalidArgument:
    """What a tracker raises for a cursor it did not issue (it arrives from a URL: never trust it)."""
    return InvalidArgument("cursor", "not a cursor from a previous page; pass next_cursor unchanged")


#: a record as a purge listed it: its status and when it was last written
Listed = tuple[str, datetime]
#: the message ids a delete may take, or each with its record as listed, which it must still be to go
#: (None: whichever): a purge's
Only = Collection[UUID | str] | Mapping[UUID | str, Listed | None]


def as_listed(only: Only) -> Mapping[UUID | str, Listed | None]:
    """``only`` as id -> the record as listed, which it must still be (None: whichever)."""
    return only if isinstance(only, Mapping) else dict.fromkeys(only)


def still_as_listed(listed: Listed | None, status: object, updated_at: object) -> bool:
    """A stored record (its status and time as stored) is still as it was listed."""
    if listed is None:
        return True
    return (
        status == listed[0] and isinstance(updated_at, datetime) and as_utc(updated_at) == as_utc(listed[1])
    )


@runtime_checkable
class Tracker(Protocol):
    async def upsert(self, records: Sequence[MessageRecord]) -> None: ...

    async def get(self, message_id: UUID) -> MessageRecord | None: ...

    async def query(
        self, query: MessageQuery, *, limit: int = 50, cursor: str | None = None
    ) -> Page[MessageRecord]: ...

    async def counts(self) -> dict[tuple[str, str], int]:
        """Number of messages per (queue, status)."""
        ...

    async def delete(self, query: MessageQuery, only: Only | None = None) -> int:
        """Delete the records that match ``query`` and, when given, whose message id is one of
        ``only`` (the stored text of a damaged record's id that does not read is a ``str``); where
        ``only`` maps an id to its record as listed, that record goes only while it is still as
        listed (its status and time)."""
        ...

    async def reopen(self, record: MessageRecord) -> None:
        """Write ``record`` whatever the stored status says (an operator's retry of a finished
        message); a plain upsert may refuse to overwrite a finished message."""
        ...


@runtime_checkable
class ChangesInPlace(Protocol):
    """A tracker that can change some fields of a stored record by its message id and leave the rest as
    stored (the SQL history, whose rows may be damaged outside the kit)."""

    async def change(self, message_id: UUID, changes: Mapping[str, Any]) -> None: ...


@runtime_checkable
class ChangesIfUnchanged(Protocol):
    """A tracker that can write a change to a record only while it is stored as it was read (its
    status and time): an operator's change made from a read must not replace an outcome a host wrote
    after that read."""

    async def change_if_unchanged(self, seen: MessageRecord, changes: Mapping[str, Any]) -> bool:
        """Write ``seen`` with ``changes`` if the stored record still has ``seen``'s status and
        ``updated_at``; False (nothing written) when it changed or is gone."""
        ...


async def record_change(tracker: Tracker, r: MessageRecord, changes: Mapping[str, Any]) -> None:
    """Write ``changes`` (an action's) to ``r``'s record: as a rule the whole record, changed; a damaged
    one (see ``MessageRecord.malformed``) only those fields, by its message id, so its stand-ins (a zero
    id, the year 1, no headers) never replace the stored text, which the operator still needs."""
    if r.malformed is None:
        await tracker.upsert([r.model_copy(update=dict(changes))])
    elif r.readable("message_id") and isinstance(tracker, ChangesInPlace):
        await tracker.change(r.message_id, changes)
    else:  # (the SQL history is the only tracker that reads damaged rows, and it changes them in place)
        raise InvalidOperation(
            f"cannot record a change of message {r.message_id}: its stored row is damaged ({r.malformed})"
        )


class Activity(BaseModel):
    """What the queues did lately, in equal time slots oldest first (the dashboard's charts): per
    queue, messages that succeeded and that ended otherwise, and the mean seconds from enqueue to
    settlement; and when each queue's oldest message waiting to run became due."""

    since: datetime
    slot_seconds: int
    succeeded: dict[str, list[int]] = Field(default_factory=dict)
    failed: dict[str, list[int]] = Field(default_factory=dict)
    latency: dict[str, list[float | None]] = Field(default_factory=dict)
    oldest_due: dict[str, datetime] = Field(default_factory=dict)


@runtime_checkable
class ActivitySource(Protocol):
    """A tracker that can say what happened lately (the SQL provider's); others show counts only."""

    async def activity(
        self, queues: Sequence[str], since: datetime, slot_seconds: int, slots: int, now: datetime
    ) -> Activity: ...


#: Writes an operator's retry into the history, around the copy's send: a provider's ``ops_retry``
#: enters it after its last refusal and sends the copy inside it, so the outcome of the new run is
#: never overwritten; a send that fails puts the history back as it was (see ``OpsService.retry``).
Reopen = Callable[[], AbstractAsyncContextManager[None]]


def nothing_to_reopen() -> AbstractAsyncContextManager[None]:
    """The ``Reopen`` of providers whose own statement records the retry (the SQL provider)."""
    return contextlib.nullcontext()


class Removed(set[UUID]):
    """The ids a purge took off a transport whose own store also deleted ``forgotten`` of their
    history records, in the same transaction (the delayed store beside its history): a purge counts
    those too, which its own deletion of the history no longer finds."""

    def __init__(self, ids: Iterable[UUID] = (), forgotten: int = 0, held: int = 0) -> None:
        super().__init__(ids)
        self.forgotten = forgotten
        #: how many of them a worker had already received, by the transport's count, which its purge
        #: cannot take (AMQP's leaves the deliveries a consumer has not acked): they run, and write
        #: their history again; the purge counts them as left, not deleted
        self.held = held


#: statuses only processing writes: a producer's record, written after its send, never replaces them
OUTCOMES: frozenset[str] = frozenset(
    {*(s.value for s in MessageStatus.terminal()), MessageStatus.FAILED.value}
)


def is_enqueue_record(rec: MessageRecord) -> bool:
    """A record that says only "it was sent": nothing has happened to the message yet."""
    return (
        rec.status not in OUTCOMES
        and rec.reason is None
        and rec.last_error is None
        and rec.result is None
        and rec.locked_by is None
    )


def is_producers_record(rec: MessageRecord) -> bool:
    """A producer's record ("sent"): an enqueue record that is not a running handler's progress report
    (``Leased``, which says as little but is a run's)."""
    return is_enqueue_record(rec) and rec.status != MessageStatus.LEASED.value


#: the description of a Cancelled record that is only an operator's request (transports whose history
#: does not say whether a host runs the message now): the host's settlement, Cancelled or not, replaces it
CANCEL_REQUESTED = "cancellation requested: settled without running when a host receives it"


def is_cancel_request(rec: MessageRecord) -> bool:
    """A record that says only "an operator asked to cancel it": no host has settled it that way yet."""
    return rec.status == MessageStatus.CANCELLED.value and rec.description == CANCEL_REQUESTED


#: the reason on a record an operator's retry reopened: not a producer's record, which a run's record
#: replaces whatever its time (a run's record older than the retry, landing late, must not)
RETRIED_BY_OPERATOR = "retried by an operator"


def reopening(now: datetime, expires_at: datetime | None) -> dict[str, Any]:
    """The fields an operator's retry changes in a message's record (see :func:`reopened`)."""
    return {
        "status": MessageStatus.PENDING.value,
        "attempt": 0,
        "reason": RETRIED_BY_OPERATOR,
        "description": None,
        "not_before": None,
        "expires_at": expires_at,
        "locked_by": None,
        "locked_until": None,
        "updated_at": now,
    }


def reopened(rec: MessageRecord, now: datetime, expires_at: datetime | None) -> MessageRecord:
    """``rec`` as an operator's retry reopens it: waiting again, its attempts from the start."""
    return rec.model_copy(update=reopening(now, expires_at))


def before_reopening(rec: MessageRecord) -> dict[str, Any]:
    """The fields :func:`reopened` changes, as ``rec`` has them: the change that puts a reopened
    record back (a retry whose copy was not sent)."""
    return {name: getattr(rec, name) for name in reopening(rec.updated_at, None)}


def supersedes(new: MessageRecord, old: MessageRecord) -> bool:
    """The rule for records that may arrive out of order (a late write, a record overtaken by the next
    run's, records waiting for the store): may ``new`` take the place of ``old``? A producer's record
    never replaces an outcome; a run's record always replaces a producer's (whose clock, read after the
    send, may be later than that of a worker that ran the message at once) and an operator's request to
    cancel (a run settled before the request, whose record arrives late, decided the message: the
    request reached no host); otherwise the later ``updated_at`` wins (the hosts' clocks). The SQL and
    Tables history stores say the same in their own terms (``upsert_newer``)."""
    newer = as_utc(new.updated_at) >= as_utc(old.updated_at)
    if is_enqueue_record(new):
        return newer and old.status not in OUTCOMES
    return newer or is_producers_record(old) or is_cancel_request(old)


def newest_per_message(records: Sequence[MessageRecord]) -> dict[UUID, MessageRecord]:
    """The record of each message that :func:`supersedes` the others (what a late write may apply)."""
    latest: dict[UUID, MessageRecord] = {}
    for rec in records:
        old = latest.get(rec.message_id)
        if old is None or supersedes(rec, old):
            latest[rec.message_id] = rec
    return latest


def record_from_envelope(envelope: Envelope, status: str, now: datetime, **fields: Any) -> MessageRecord:
    return MessageRecord(
        message_id=envelope.message_id,
        tracking_id=envelope.tracking_id,
        type=envelope.type,
        queue=envelope.queue,
        status=status,
        attempt=envelope.attempt,
        correlation_id=envelope.correlation_id,
        created_at=envelope.created_at,
        updated_at=now,
        not_before=envelope.not_before,
        expires_at=envelope.expires_at,
        headers=envelope.headers,
        body=envelope.body,
        **fields,
    )
