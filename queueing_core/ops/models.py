"""Typed shapes of the operations service and its HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from ..messages import CUSTOM_STATUS_PATTERN
from ..options import Health

#: what no name the ops API takes may hold: whitespace, control characters (U+0000-U+001F, U+007F-U+009F), the
#: invisible formatting ones of the Basic Multilingual Plane (Unicode's category Cf there: zero-width,
#: bidirectional overrides and isolates) that make one name look like another, and markup and quoting
#: characters (< > " ' ` \): the dashboard escapes names, but no real name needs them, and a name that
#: holds none cannot become markup or break out of a quoted value anywhere. The pattern is published in
#: the OpenAPI document and run by browsers (the API's docs page checks a name before it sends it), so
#: it is written as every engine reads it, without the u flag: \uXXXX escapes only (an escape of a
#: character past U+FFFF read there as letters, and refused names such as "ui-reports")
_FORMAT = (  # every Cf character below U+10000 (a test holds it against Python's Unicode database)
    r"\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890-\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    r"\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb"
)
_UNSAFE = r"\s\x00-\x1f\x7f-\x9f" + _FORMAT + "<>\"'`" + r"\\"
#: Registration takes any string as a queue or type name, and names such as `_internal` or
#: `billing-invoice` (kebab-case, CloudEvents-style) are common: the API takes every name but those
#: it cannot carry safely (see _UNSAFE). A name never starts with '.' or '/' (a path's "." and ".."
#: segments are collapsed by clients); a queue name may hold '/' (its routes take the rest of the
#: path), a type name not. Names reach SQL as bound parameters and the dashboard escaped.
QUEUE_NAME = rf"^[^{_UNSAFE}/.][^{_UNSAFE}]{{0,259}}$"
TYPE_NAME = rf"^[^{_UNSAFE}/.][^{_UNSAFE}/]{{0,255}}$"
NAME_RULES = (
    "a name there has no whitespace, control characters or < > \" ' ` \\, and does not start with "
    "'.' or '/'; a type name has no '/' and at most 256 characters, a queue name at most 260"
)
STATUS_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
SCHEDULE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}$"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class CircuitInfo(_Model):
    state: Literal["closed", "open", "half_open"]
    consecutive_failures: int
    open_until: datetime | None = None


class QueueSummary(_Model):
    queue: str
    type: str
    category: str | None
    has_handler: bool
    paused: bool = Field(description="the queue is paused")
    type_paused: bool = Field(description="the message type is paused")
    circuit: CircuitInfo | None = Field(description="null when the type has no circuit breaker")
    counts: dict[str, int] = Field(description="unarchived messages by status")
    total: int
    health: Health
    transport_counts: dict[str, int] | None = Field(
        default=None,
        description="what the broker itself reports (Service Bus: active, scheduled, dead_lettered)",
    )


class Summary(_Model):
    provider: str
    generated_at: datetime
    queues: list[QueueSummary]
    totals: dict[str, int] = Field(description="unarchived messages by status, all queues")
    other_queues: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="counts for queues this app does not register (other apps, old names)",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="what limits these figures, e.g. transport counts taken by peeking for lack of rights",
    )


class SubscriptionInfo(_Model):
    type: str
    queue: str
    physical_queue: str
    category: str | None
    handler: str | None
    max_attempts: int
    max_concurrency: int
    lease_seconds: float
    time_limit_seconds: float | None
    expiration_seconds: float | None
    ordered: bool
    default_status: str
    circuit_breaker: dict[str, Any] | None
    example: dict[str, Any] | None = Field(description="an example body to enqueue")
    json_schema: dict[str, Any] = Field(description="JSON schema of the message body")


_UNREADABLE = " (null only on a damaged row whose stored value does not read: see `malformed`)"


class MessageSummary(_Model):
    message_id: UUID | None = Field(description="the message's id" + _UNREADABLE)
    tracking_id: UUID | None = Field(description="the id shared by every run of the message" + _UNREADABLE)
    type: str
    queue: str
    status: str
    attempt: int
    correlation_id: str | None
    created_at: datetime | None = Field(description="when it was enqueued (UTC)" + _UNREADABLE)
    updated_at: datetime | None = Field(description="its last change (UTC)" + _UNREADABLE)
    not_before: datetime | None
    archived: bool
    reason: str | None
    malformed: str | None = Field(
        default=None,
        description="set on a row damaged outside the kit: which of its fields do not read and why, "
        'e.g. "message id is not a UUID"; those fields are null or empty here',
    )
    stored: dict[str, str] | None = Field(
        default=None, description="a damaged row's stored text of each field that does not read"
    )


class MessageDetail(MessageSummary):
    expires_at: datetime | None
    locked_by: str | None
    locked_until: datetime | None
    last_error: str | None
    description: str | None
    archived_at: datetime | None
    headers: dict[str, str]
    result: Any = None
    progress: dict[str, Any] | None = Field(
        default=None, description="what the handler last reported: step, total, text and when (at)"
    )
    duplicates: int = Field(
        default=0,
        description="deliveries of this message recognised as duplicates of a run already recorded "
        "and completed without running the handler",
    )


class MessageContent(_Model):
    message_id: UUID
    type: str
    body: dict[str, Any] | None = Field(description="the message body; null if it could not be decoded")
    raw: str | None = Field(description="the stored text of a body that could not be decoded")
    headers: dict[str, str]


class MessagePage(_Model):
    items: list[MessageSummary]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")


class MessageStats(_Model):
    total: int
    by_status: dict[str, int]
    by_queue: dict[str, dict[str, int]]


class ActionResult(_Model):
    message_id: UUID
    status: str
    detail: str


class PurgeResult(_Model):
    deleted: int
    skipped_leased: int = Field(description="matching messages left alone because a worker holds them")
    left_waiting: int = Field(
        default=0,
        description="matching messages the transport still holds and could not remove: one waiting in "
        "a queue that cannot be emptied message by message (RabbitMQ, SQS, Storage Queues, Service Bus), "
        "or a dead letter another reader held; they stay, history and all, and waiting ones run",
    )


class ScheduleInfo(_Model):
    name: str
    expression: str = Field(description="the cron expression, or `every <n>s`")
    timezone: str
    catch_up: Literal["skip", "once"] = Field(
        description="after every host was down past a tick: run the newest missed tick once, or none"
    )
    paused: bool
    last_tick: datetime | None = Field(description="the newest tick a host claimed (UTC)")
    next_tick: datetime = Field(description="the next tick after now (UTC)")


class PauseResult(_Model):
    kind: Literal["queue", "type", "schedule"]
    name: str
    paused: bool


class CircuitResetResult(_Model):
    type: str
    state: Literal["closed"] = "closed"


class EnqueuedMessage(_Model):
    message_id: UUID
    tracking_id: UUID
    type: str
    queue: str
    status: str
    not_before: datetime | None
    expires_at: datetime | None
    #: ``enqueued``; for idempotent types also ``discarded`` or ``replaced`` (the ids are then the
    #: waiting message's)
    outcome: str = "enqueued"
    #: the waiting version this one superseded (idempotent types, off SQL)
    supersedes: UUID | None = None


class EnqueueResult(_Model):
    enqueued: list[EnqueuedMessage]


class HealthReport(_Model):
    status: Health
    queues: dict[str, Health]
    reasons: dict[str, str] = Field(default_factory=dict)
    history_backlog: int = Field(
        default=0,
        description="history records this host has not been able to write yet (being retried); "
        "while any wait, the status is at least Degraded",
    )


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``)."""

    type: str = Field(default="about:blank", description="`urn:queueing-kit:problem:<kind>`")
    title: str
    status: int
    detail: str | None = None
    instance: str | None = Field(default=None, description="the request's path")
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="validation errors (`loc`, `msg`, `type`), at most 50"
    )
    error_count: int | None = Field(default=None, description="how many errors there were, when over 50")


#: one step of a JSON path into a message body: a property name or an array index
PATH_SEGMENT = r"(?:[A-Za-z_][A-Za-z0-9_]{0,63}|[0-9]{1,6})"
MAX_PATH_DEPTH = 8
#: a dotted path of such steps (what the database receives, as a bound parameter, is built from them)
JSON_PATH = rf"^{PATH_SEGMENT}(?:\.{PATH_SEGMENT}){{0,{MAX_PATH_DEPTH - 1}}}$"


def _encodable(text: str) -> str:
    text.encode("utf-8")  # a lone surrogate (JSON's "\ud800") is stored nowhere: a ValueError, a 422
    return text


#: what a filter compares with: text without NUL (PostgreSQL refuses it), a 64-bit integer, a finite
#: number (NaN sorts above every number on PostgreSQL and below none on SQLite), a boolean or null
_WhereText = Annotated[
    str, StringConstraints(max_length=1024, pattern=r"^[^\x00]*$"), AfterValidator(_encodable)
]
_WhereInt = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
_WhereNumber = Annotated[float, Field(allow_inf_nan=False)]
#: how many statuses a filter may name
MAX_STATUSES = 32


def distinct_statuses(values: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The statuses of a filter, each once, at most :data:`MAX_STATUSES`. Each one becomes a term of
    the store's query: SQLite refuses an expression about 1,000 terms deep (a 500), so a long list is
    refused by name; a status repeated is the same filter and does not count."""
    distinct = tuple(dict.fromkeys(values))
    if len(distinct) > MAX_STATUSES:
        raise PydanticCustomError(
            "too_many_statuses",
            "at most {max} different statuses (given {given})",
            {"max": MAX_STATUSES, "given": len(distinct)},
        )
    return distinct


class StatusWhere(_Model):
    """Which messages: those whose body has ``value`` at ``path`` compared by ``op``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(
        pattern=JSON_PATH,
        description="a dotted path into the body, e.g. customer.country or lines.0.sku: property "
        "names (letters, digits, _) and array indexes, at most 8 steps",
        examples=["customer.country"],
    )
    op: Literal["eq", "ne", "lt", "le", "gt", "ge"] = "eq"
    value: _WhereText | _WhereInt | _WhereNumber | bool | None = Field(
        description="compared as text, number or boolean by its JSON type; null (missing or null) "
        "with eq/ne, and nothing is less or greater than null"
    )

    @field_validator("value", mode="before")
    @classmethod
    def _integer_in_range(cls, value: Any) -> Any:
        # an integer past 64 bits would be taken as the nearest float by the next member of the
        # union, and an eq filter then match a neighbouring integer
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise ValueError("an integer must fit in 64 bits")
        return value

    def steps(self) -> tuple[str | int, ...]:
        return tuple(int(s) if s.isdigit() else s for s in self.path.split("."))


class StatusUpdate(_Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    where: StatusWhere
    set: str = Field(pattern=CUSTOM_STATUS_PATTERN, description="the status to set")
    status: list[Annotated[str, StringConstraints(pattern=STATUS_NAME)]] | None = Field(
        default=None,
        max_length=MAX_STATUSES,
        description="only messages in these statuses (default: any but Leased)",
    )


class StatusUpdateResult(_Model):
    queue: str
    status: str
    updated: int
