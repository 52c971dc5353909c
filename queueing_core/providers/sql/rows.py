"""Envelope <-> row mapping for the SQL provider."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

from pydantic_core import PydanticSerializationError, from_json, to_json

from ...clock import opt_utc
from ...envelope import Envelope
from ...errors import InvalidArgument, MalformedEnvelope
from ...messages import TOO_DEEP, too_deep
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


def json_value(text: str) -> Any:
    """JSON text as ``json.loads`` reads it, through pydantic-core's parser (about a sixth of the time
    for a message's body: ``json`` pays its decoder's setup on every call). What that parser refuses
    and ``json`` reads (a lone surrogate's escape, which ``json.dumps`` writes) goes to ``json``, whose
    error text is the one a body that is no JSON at all gets."""
    try:
        return from_json(text)
    except (ValueError, TypeError):
        return json.loads(text)


class Lease(NamedTuple):
    """A SQL delivery's handle: its row and the lease token its claim set, which every settlement,
    renewal and release of that delivery must name."""

    row: int
    token: int


def delivery_from_row(row: Mapping[Any, Any]) -> Delivery:
    """Rebuild the envelope from a claimed row; a body that no longer parses becomes a malformed
    delivery (dead-lettered with its text kept) instead of an error that would fail the whole batch."""
    body_text: str | None = row["body_text"]
    raw = body_text if body_text is not None else (row["raw"] or "")
    attempt = int(row["attempt"]) + 1
    lease, until = Lease(row["id"], row["lease_token"]), opt_utc(row["locked_until"])
    try:
        body = json_value(body_text) if body_text is not None else None
        headers_text = row["headers_text"]
        # most messages carry no headers: "{}" is not parsed for each of them
        headers = json_value(headers_text) if headers_text and headers_text != "{}" else {}
        if not isinstance(body, dict):
            raise ValueError("the stored body is not a JSON object")
        if not isinstance(headers, dict):
            raise ValueError("the stored headers are not a JSON object")
        # (pydantic's validation runs in Rust: cheaper than model_construct, which is pure Python)
        env = Envelope.model_validate(
            {
                "type": row["type"],
                "queue": row["queue"],
                "message_id": row["message_id"],
                "tracking_id": row["tracking_id"],
                "correlation_id": row["correlation_id"],
                "attempt": int(row["attempt"]),
                "created_at": row["created_at"],
                "not_before": row["not_before"],
                "expires_at": row["expires_at"],
                "headers": headers,
                "body": body,
            }
        )
    except (ValueError, TypeError) as exc:
        bad = MalformedEnvelope(f"stored row {row['id']} does not decode: {exc}", raw)
        return Delivery(row["queue"], raw, None, bad, attempt, handle=lease, lease_until=until)
    return Delivery(row["queue"], raw, env, None, attempt, handle=lease, lease_until=until)


_ARRAY_COLUMNS = (
    "message_id",
    "tracking_id",
    "queue",
    "type",
    "status",
    "attempt",
    "correlation_id",
    "created_at",
    "updated_at",
    "not_before",
    "available_at",
    "expires_at",
)


def unnest_params(rows: list[dict[str, Any]], channel: str) -> dict[str, Any]:
    """Column-wise arrays for the PostgreSQL ``unnest`` INSERT; JSON columns as text, cast there."""
    params: dict[str, Any] = {c: [r[c] for r in rows] for c in _ARRAY_COLUMNS}
    params["headers"] = [_fast_json(r["headers"]) for r in rows]
    params["body"] = [_fast_json(r["body"]) for r in rows]
    params["channel"] = channel
    return params


_COPY_TYPES = [
    "uuid",
    "uuid",
    "text",
    "text",
    "text",
    "int4",
    "text",
    "timestamptz",
    "timestamptz",
    "timestamptz",
    "timestamptz",
    "timestamptz",
    "jsonb",
    "jsonb",
]


def _fast_json(value: Any) -> str:
    try:
        return to_json(value).decode()
    except PydanticSerializationError as exc:
        # Enqueue refuses a body nested past MAX_BODY_DEPTH; one that still comes here (enqueue
        # middleware made it deeper) is the caller's to fix, refused before anything is written
        # (the INSERT, or the COPY's transaction, holds none of the batch)
        if too_deep(exc):
            raise InvalidArgument("message", TOO_DEEP) from None
        raise


async def copy_rows(conn: Any, tables: Any, rows: list[dict[str, Any]]) -> None:
    """COPY the rows into the messages table on the SQLAlchemy connection's own transaction."""
    from psycopg.types.json import Jsonb

    raw = (await conn.get_raw_connection()).driver_connection
    columns = ", ".join((*_ARRAY_COLUMNS, "headers", "body"))
    async with (
        raw.cursor() as cur,
        cur.copy(f"COPY {tables.messages.fullname} ({columns}) FROM STDIN (FORMAT BINARY)") as copy,
    ):
        copy.set_types(_COPY_TYPES)
        for r in rows:
            await copy.write_row(
                (
                    *(r[c] for c in _ARRAY_COLUMNS),
                    Jsonb(r["headers"], dumps=_fast_json),
                    Jsonb(r["body"], dumps=_fast_json),
                )
            )
