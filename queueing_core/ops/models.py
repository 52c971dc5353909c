"""Typed shapes of the operations service and its HTTP API."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from ..options import Health

QUEUE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,259}$"
TYPE_NAME = r"^[A-Za-z_][A-Za-z0-9_.]{0,255}$"
STATUS_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"


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


class MessageSummary(_Model):
    message_id: UUID
    tracking_id: UUID
    type: str
    queue: str
    status: str
    attempt: int
    correlation_id: str | None
    created_at: datetime
    updated_at: datetime
    not_before: datetime | None
    archived: bool
    reason: str | None


class MessageDetail(MessageSummary):
    expires_at: datetime | None
    locked_by: str | None
    locked_until: datetime | None
    last_error: str | None
    description: str | None
    archived_at: datetime | None
    headers: dict[str, str]
    result: Any = None


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


class PauseResult(_Model):
    kind: Literal["queue", "type"]
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


class EnqueueResult(_Model):
    enqueued: list[EnqueuedMessage]


class HealthReport(_Model):
    status: Health
    queues: dict[str, Health]
    reasons: dict[str, str] = Field(default_factory=dict)


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
