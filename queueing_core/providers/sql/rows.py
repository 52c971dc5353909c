"""Envelope <-> row mapping for the SQL provider."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

import sqlalchemy as sa
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


def stored_text(column: sa.ColumnElement[Any], backend: str, label: str) -> sa.ColumnElement[Any]:
    """A column of JSON (or text) as the claim and the listings select it, to be read per row: text on
    PostgreSQL, whose text is UTF-8 (the server checks it on the way in); on SQLite the stored bytes,
    decoded by the reader. SQLite keeps whatever bytes another program wrote, and ``sqlite3`` fails the
    whole fetch on one row's text that is not UTF-8: every claim of its queue (taken for the database's
    absence), and every listing that holds the row."""
    if backend != "postgresql":
        return sa.cast(column, sa.LargeBinary()).label(label)
    return (column if isinstance(column.type, sa.Text) else sa.cast(column, sa.Text())).label(label)


def delivery_from_row(row: Mapping[Any, Any]) -> Delivery:
    """Rebuild the envelope from a claimed row. A row that does not decode (a body or headers that are
    not UTF-8 or not JSON objects, JSON nested past what the parser reads, a value of the wrong kind:
    changed outside the kit) becomes a malformed delivery, dead-lettered with its text kept, instead of
    an error that would fail the whole batch after its claim committed (every row of it left leased
    until the sweep counted an attempt on each)."""
    stored: str | bytes | None = row["body_text"]  # (bytes on SQLite: see ``stored_text``)
    lease, until = Lease(row["id"], row["lease_token"]), opt_utc(row["locked_until"])
    attempt = 0  # (a count that does not read: the delivery is its first)
    try:
        attempt = int(row["attempt"])
        body_text = stored.decode() if isinstance(stored, bytes) else stored
        raw = body_text if body_text is not None else (row["raw"] or "")
        body = json_value(body_text) if body_text is not None else None
        headers_text = row["headers_text"]
        if isinstance(headers_text, bytes):
            headers_text = headers_text.decode()
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
                "attempt": attempt,
                "created_at": row["created_at"],
                "not_before": row["not_before"],
                "expires_at": row["expires_at"],
                "headers": headers,
                "body": body,
            }
        )
    except Exception as exc:  # (RecursionError too: a row is data, and one row's fault is its own)
        # the stored bytes as they are: the dead letter keeps them as text, undecodable bytes replaced
        kept = stored if stored is not None else (row["raw"] or "")
        bad = MalformedEnvelope(f"stored row {row['id']} does not decode: {exc}", kept)
        return Delivery(row["queue"], kept, None, bad, attempt + 1, handle=lease, lease_until=until)
    return Delivery(row["queue"], raw, env, None, attempt + 1, handle=lease, lease_until=until)


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
