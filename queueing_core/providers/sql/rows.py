"""Envelope <-> row mapping for the SQL provider."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ...clock import as_utc, opt_utc
from ...envelope import Envelope
from ...errors import MalformedEnvelope
from ...transport import Delivery


def row_for(envelope: Envelope, status: str, now: datetime) -> dict[str, Any]:
    return {
        "message_id": envelope.message_id,
        "tracking_id": envelope.tracking_id,
        "queue": envelope.queue,
        "type": envelope.type,
        "status": status,
        "attempt": envelope.attempt,
        "correlation_id": envelope.correlation_id,
        "created_at": envelope.created_at,
        "updated_at": now,
        "not_before": envelope.not_before,
        "available_at": envelope.not_before or now,
        "expires_at": envelope.expires_at,
        "headers": envelope.headers,
        "body": envelope.body,
    }


def delivery_from_row(row: Mapping[Any, Any]) -> Delivery:
    """Rebuild the envelope from a claimed row; a body that no longer parses becomes a malformed
    delivery (dead-lettered with its text kept) instead of an error that would fail the whole batch."""
    body_text: str | None = row["body_text"]
    raw = body_text if body_text is not None else (row["raw"] or "")
    attempt = int(row["attempt"]) + 1
    try:
        body = json.loads(body_text) if body_text is not None else None
        headers = json.loads(row["headers_text"]) if row["headers_text"] else {}
        if not isinstance(body, dict):
            raise ValueError("the stored body is not a JSON object")
        env = Envelope.model_validate(
            {
                "type": row["type"],
                "queue": row["queue"],
                "message_id": row["message_id"],
                "tracking_id": row["tracking_id"],
                "correlation_id": row["correlation_id"],
                "attempt": int(row["attempt"]),
                "created_at": as_utc(row["created_at"]),
                "not_before": opt_utc(row["not_before"]),
                "expires_at": opt_utc(row["expires_at"]),
                "headers": headers,
                "body": body,
            }
        )
    except (ValueError, TypeError) as exc:
        bad = MalformedEnvelope(f"stored row {row['id']} does not decode: {exc}", raw)
        return Delivery(
            row["queue"], raw, None, bad, attempt, handle=row["id"], lease_until=opt_utc(row["locked_until"])
        )
    return Delivery(
        row["queue"], raw, env, None, attempt, handle=row["id"], lease_until=opt_utc(row["locked_until"])
    )
