"""Reading a stored row of the messages (or history) table into the record the operator's views show.

The one place a row becomes a :class:`MessageRecord`. A row damaged outside the kit (an id that is not
a UUID, a time that does not read, headers or a body that are not UTF-8 text or not JSON objects, a
value of the wrong kind) must not take the listing it is in down with it: that listing is the
dead-letter page an operator opens to look at exactly that row. So every field is read on its own; a
field that does not read is left empty (or a stand-in where the record needs a value), its stored text
is kept in ``stored`` and the reason in ``malformed``."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from ...clock import as_utc
from ...tracking.base import UNREADABLE_ID, UNREADABLE_TIME, MessageRecord

#: the most of a damaged value kept for the operator
MAX_STORED = 2000
#: how SQLAlchemy writes a time on SQLite (UTC, no offset), which orders as text in time order: a time
#: stored in any other form (an ISO ``T``, no fraction, an offset) may read, but sorts elsewhere
SQLITE_TIME = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}")


def stored_in_order(value: Any) -> bool:
    """Whether a time as selected (:meth:`SqlRecords.columns`) sorts among the others as the time it
    reads as: always on PostgreSQL (a ``timestamptz``), on SQLite only in the form the kit writes. A page
    cursor may carry such a time; after any other row it names the row alone."""
    return not isinstance(value, str) or SQLITE_TIME.fullmatch(value) is not None


_STAND_INS: dict[str, Any] = {
    "message_id": UNREADABLE_ID,
    "tracking_id": UNREADABLE_ID,
    "created_at": UNREADABLE_TIME,
    "updated_at": UNREADABLE_TIME,
    "type": "",
    "queue": "",
    "status": "",
}
_WHAT = {"message_id": "message id", "tracking_id": "tracking id"}


class _Reading:
    """The fields of one row as far as they read, and what did not."""

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.row = row
        self.problems: list[str] = []
        self.stored: dict[str, str] = {}
        self.unreadable: set[str] = set()

    def bad(self, name: str, value: Any, why: str) -> None:
        self.problems.append(why)
        self.unreadable.add(name)
        if value is not None:
            self.stored[name] = str(value)[:MAX_STORED]

    def uuid(self, name: str) -> UUID | None:
        value = self.row[name]
        if value is None or isinstance(value, UUID):
            return value
        try:
            parsed = UUID(str(value))
        except ValueError:
            self.bad(name, value, f"{_WHAT[name]} is not a UUID")
            return None
        if parsed.hex != value:
            # SQLite keeps the text written, and the kit writes 32 lower-case hex digits: the kit looks a
            # row up by that text, so one stored otherwise (``A1B2…``, dashed) is never the message its
            # id reads as. Shown with that id, an action on it would act on that other message.
            self.bad(name, value, f"{_WHAT[name]} is not stored as the kit writes it")
            return None
        return parsed

    def time(self, name: str) -> datetime | None:
        stored = self.row.get(f"{name}_stored")  # PostgreSQL: a time out of the years 1-9999
        if stored is not None:
            self.bad(name, stored, f"{name} is not a time in the years 1-9999")
            return None
        value = self.row[name]
        try:
            if value is None:
                return None
            return as_utc(value if isinstance(value, datetime) else datetime.fromisoformat(value))
        except (ValueError, TypeError, OverflowError):
            self.bad(name, value, f"{name} does not read as a time")
            return None

    def text(self, name: str, stored: str | bytes | None) -> str | None:
        """A column selected as :func:`rows.stored_text` as text: on SQLite its stored bytes, which
        another program may have written in another encoding (kept with those bytes replaced)."""
        if not isinstance(stored, bytes):
            return stored
        try:
            return stored.decode()
        except UnicodeDecodeError:
            text = stored.decode(errors="replace")
            self.bad(name, text, f"{name} is not UTF-8 text")
            return text

    def json(self, name: str, text: str | None, *, obj: bool, strings: bool = False) -> Any:
        """The parsed JSON; None (with the text kept) when it is not JSON, or not an object (of strings)
        where one is needed, or when its text did not read (:meth:`text`)."""
        if text is None or name in self.unreadable:
            return None
        try:
            value = json.loads(text)
        except Exception as exc:  # (RecursionError too: a row is data, and never fails its listing)
            why = "is nested too deep to read" if isinstance(exc, RecursionError) else "is not JSON"
            self.bad(name, text, f"{name} {why}")
            return None
        if obj and not isinstance(value, dict):
            self.bad(name, text, f"{name} is not a JSON object")
            return None
        if strings and not all(isinstance(v, str) for v in value.values()):
            self.bad(name, text, f"{name} is not a JSON object of strings")
            return None
        return value


def read_record(row: Any) -> MessageRecord:
    """The record of ``row`` (a row of :meth:`SqlRecords.columns`); never raises for what is stored."""
    mapping: Mapping[str, Any] = row._mapping
    r = _Reading(mapping)
    headers = r.json("headers", r.text("headers", mapping["headers_text"]), obj=True, strings=True)
    body_text = r.text("body", mapping["body_text"])
    body = r.json("body", body_text, obj=True)
    values: dict[str, Any] = {
        "message_id": r.uuid("message_id"),
        "tracking_id": r.uuid("tracking_id"),
        "type": mapping["type"],
        "queue": mapping["queue"],
        "status": mapping["status"],
        "attempt": mapping["attempt"],
        "correlation_id": mapping["correlation_id"],
        "created_at": r.time("created_at"),
        "updated_at": r.time("updated_at"),
        "not_before": r.time("not_before"),
        "expires_at": r.time("expires_at"),
        "locked_by": mapping["locked_by"],
        "locked_until": r.time("locked_until"),
        "last_error": mapping["last_error"],
        "reason": mapping["reason"],
        "description": mapping["description"],
        "archived": mapping["archived"],
        "archived_at": r.time("archived_at"),
        "headers": headers or {},
        "body": body,
        # the stored text of a body that is not a JSON object (the kit's own column, else the body's)
        "raw": mapping["raw"] or (body_text if body is None and "body" in r.stored else None),
        "result": r.json("result", r.text("result", mapping["result_text"]), obj=False),
        "progress": r.json("progress", r.text("progress", mapping["progress_text"]), obj=True),
        "duplicates": mapping.get("duplicates"),  # a history column only
    }
    for name, stand_in in _STAND_INS.items():
        if values[name] is None:
            if name not in r.stored:
                r.bad(name, None, f"{name} is empty")
            values[name] = stand_in
    try:
        record = MessageRecord.model_validate(values)
    except ValidationError as exc:  # a value of the wrong kind (SQLite keeps whatever was written)
        for name in {str(e["loc"][0]) for e in exc.errors()}:
            r.bad(name, values[name], f"{name} is not {_KIND.get(name, 'readable')}")
            values[name] = _STAND_INS.get(
                name, MessageRecord.model_fields[name].get_default(call_default_factory=True)
            )
        record = MessageRecord.model_validate(values)
    if r.problems:
        record.malformed = "; ".join(r.problems)
        record.stored = r.stored
        record.unreadable = frozenset(r.unreadable)
    return record


_KIND = {"attempt": "a whole number", "archived": "a boolean", "duplicates": "a whole number"}
