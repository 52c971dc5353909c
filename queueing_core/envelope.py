"""The versioned wire envelope and its strict decoding.

Every transport carries the same JSON document::

    {"v": 1, "type": "OrderPlaced", "queue": "orders", "message_id": "...", "tracking_id": "...",
     "correlation_id": null, "attempt": 0, "created_at": "...", "not_before": null,
     "expires_at": "...", "headers": {}, "body": {...}}

``attempt`` counts the attempts already used before this copy was sent; a transport that counts its
own deliveries (Service Bus, Storage Queues, SQS) adds its count on top.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import NAMESPACE_OID, UUID, uuid5

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from .clock import to_utc
from .errors import MalformedEnvelope, UnsupportedEnvelopeVersion

ENVELOPE_VERSION = 1

#: headers on a dead-lettered copy (Storage Queues, RabbitMQ, SQS; Service Bus has native fields)
REASON = "x-queueing-dead-letter-reason"
DESCRIPTION = "x-queueing-dead-letter-description"
DEAD_AT = "x-queueing-dead-lettered-at"


def dead_letter_marks(reason: str, description: str, now: datetime) -> dict[str, str]:
    """Why and when a message was dead-lettered, as headers (the description cut to 4,000 chars)."""
    return {REASON: reason, DEAD_AT: now.isoformat(), DESCRIPTION: description[:4000]}


#: header on a delayed message forwarded again after a dispatcher stopped before it could remove the
#: row (its value: the earlier unreported fetches). The first forward may already have run: a host that
#: finds the message's outcome recorded completes this copy without running it.
REPEATED_FORWARD = "queueing-repeated-forward"


#: a time in UTC (naive taken as UTC). On the type rather than a validator of the model's fields: an
#: absent ``not_before`` / ``expires_at`` (most envelopes) is then never handed to Python, and every
#: message the worker claims is validated into an envelope. A time valid as written but outside the
#: years 1-9999 in UTC (``0001-01-01T00:00:00+05:00``) is a validation error, so a malformed envelope
#: dead-lettered alone, not an ``OverflowError`` that fails every receive of its queue
_Utc = Annotated[datetime, AfterValidator(to_utc)]


class Envelope(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    v: Literal[1] = 1
    type: str = Field(min_length=1, max_length=256)
    queue: str = Field(min_length=1, max_length=260)
    message_id: UUID
    tracking_id: UUID
    correlation_id: str | None = Field(default=None, max_length=256)
    attempt: int = Field(default=0, ge=0)
    created_at: _Utc
    not_before: _Utc | None = None
    expires_at: _Utc | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    body: dict[str, Any]

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    def encode_text(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: bytes | str) -> Envelope:
        """Decode strictly; anything that is not a valid v1 envelope raises :class:`MalformedEnvelope`."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            version = _version_of(raw)
            if version is not None and version != ENVELOPE_VERSION:
                raise UnsupportedEnvelopeVersion(version, raw) from None
            raise MalformedEnvelope(_summarize(exc), raw) from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedEnvelope(f"not JSON: {exc}", raw) from None

    def with_attempt(self, attempt: int, **changes: Any) -> Envelope:
        return self.model_copy(update={"attempt": attempt, **changes})


#: the type a history record shows for a message whose JSON names none
UNKNOWN_TYPE = "(unknown)"


def malformed_identity(raw_text: str) -> tuple[UUID, UUID, str]:
    """Message id, tracking id and type for a message that is not a valid envelope: what its JSON
    carries where that is usable (an operator then finds it under the id its sender used), otherwise
    an id derived from the text (the same text always gets the same id) and ``(unknown)``."""
    try:
        doc = json.loads(raw_text)
    except (ValueError, RecursionError):  # (JSON nested deeper than the interpreter's stack goes)
        doc = None
    fields: dict[str, Any] = doc if isinstance(doc, dict) else {}
    message_id = _uuid_or_none(fields.get("message_id")) or uuid5(NAMESPACE_OID, raw_text)
    tracking_id = _uuid_or_none(fields.get("tracking_id")) or message_id
    type_name = fields.get("type")
    if not (isinstance(type_name, str) and 0 < len(type_name) <= 256 and type_name.isprintable()):
        type_name = UNKNOWN_TYPE
    return message_id, tracking_id, type_name


def malformed_id(raw_text: str) -> UUID:
    """The id the history gives a message that is not an envelope; a transport marks its dead-letter
    copy with it so the ops actions find that copy."""
    return malformed_identity(raw_text)[0]


def _uuid_or_none(value: object) -> UUID | None:
    if not isinstance(value, str):
        return None
    try:
        return UUID(value)
    except ValueError:
        return None


def _version_of(raw: bytes | str) -> object | None:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # (see malformed_identity)
        return None
    return doc.get("v") if isinstance(doc, dict) else None


def _summarize(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(document)"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
