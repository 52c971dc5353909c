"""Reading a stored SQL row into a record: a field that does not read (empty included) holds a stand-in
the views never show as the message's own value."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from uuid import uuid4

from queueing_core.ops.service import summary_of
from queueing_core.providers.sql.records import read_record, stored_in_order


def row(**changes: Any) -> SimpleNamespace:
    """A row as :meth:`SqlRecords.columns` selects it on SQLite (ids and times as their stored text)."""
    values: dict[str, Any] = {
        "message_id": uuid4().hex,
        "tracking_id": uuid4().hex,
        "type": "Email",
        "queue": "emails",
        "status": "Pending",
        "attempt": 0,
        "correlation_id": None,
        "created_at": "2026-01-02 03:04:05.000000",
        "updated_at": "2026-01-02 03:04:05.000000",
        "not_before": None,
        "expires_at": None,
        "locked_by": None,
        "locked_until": None,
        "last_error": None,
        "reason": None,
        "description": None,
        "archived": False,
        "archived_at": None,
        "raw": None,
        "headers_text": "{}",
        "body_text": '{"to": "a@x.io"}',
        "result_text": None,
        "progress_text": None,
    }
    return SimpleNamespace(_mapping=values | changes)


def test_an_empty_field_is_not_readable_though_it_has_no_stored_text():
    r = read_record(row(tracking_id=None, created_at=None))
    assert r.malformed == "tracking_id is empty; created_at is empty"
    assert r.stored == {}
    assert not r.readable("tracking_id")
    assert not r.readable("created_at")
    assert r.readable("message_id")
    shown = summary_of(r)
    assert (shown.tracking_id, shown.created_at) == (None, None)
    assert shown.message_id is not None


def test_an_id_is_read_only_in_the_form_the_kit_writes_on_sqlite():
    good = uuid4()
    assert read_record(row(message_id=good.hex)).message_id == good
    for text in (good.hex.upper(), str(good), "{" + str(good) + "}"):
        r = read_record(row(message_id=text))
        assert not r.readable("message_id"), text
        assert r.malformed == "message id is not stored as the kit writes it"
        assert r.stored == {"message_id": text}
    assert read_record(row(message_id=good)).readable("message_id")  # PostgreSQL: the driver's UUID


def test_only_the_kits_own_time_text_orders_as_its_time():
    assert stored_in_order("2026-01-02 03:04:05.000000")
    for text in ("2026-01-02T03:04:05", "2026-01-02 03:04:05", "2026-01-02 05:00:00+05:00", "garbage"):
        assert not stored_in_order(text), text
    assert stored_in_order(None)  # PostgreSQL: a timestamptz, or NULL for one that does not read


def test_json_nested_past_what_the_parser_reads_is_a_damaged_field_not_a_failed_read():
    """A body (or result, progress) another program wrote nested deeper than Python's recursion limit:
    ``json.loads`` raises RecursionError, which failed the read of the message and its listing."""
    deep = '{"x": ' + "[" * 5000 + "]" * 5000 + "}"
    r = read_record(row(body_text=deep, result_text=deep))
    assert r.malformed == "body is nested too deep to read; result is nested too deep to read"
    assert (r.body, r.result) == (None, None)
    assert r.raw == deep
    assert r.stored["body"] == deep[:2000]


def test_a_json_column_not_utf8_is_a_damaged_field_with_its_text_kept():
    """On SQLite the JSON columns come as their stored bytes, which another program may have written in
    another encoding."""
    r = read_record(row(body_text=b'{"to": "\xe9"}', headers_text=b'{"h": "\xe9"}'))
    assert r.malformed == "headers is not UTF-8 text; body is not UTF-8 text"
    assert (r.body, r.headers) == (None, {})
    assert r.raw == '{"to": "\ufffd"}'
    assert r.stored == {"headers": '{"h": "\ufffd"}', "body": '{"to": "\ufffd"}'}
    assert read_record(row(body_text=b'{"to": "a@x.io"}')).body == {"to": "a@x.io"}
