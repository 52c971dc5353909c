"""A claimed row's JSON (its body, its headers) is read with pydantic-core's parser: held here against
``json.loads``, which read it before, on every JSON text ``json.dumps`` writes (what the SQL provider
stores through SQLAlchemy's JSON type): the same values, and for text that is not JSON the same
refusal, so a damaged row is still dead-lettered alone as malformed."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queueing_core.providers.sql.rows import delivery_from_row, json_value

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(_values, st.booleans())
def test_every_text_json_dumps_writes_reads_as_json_loads_reads_it(value: Any, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json_value(text) == json.loads(text)


def test_what_pydantic_core_refuses_json_reads_and_nan_and_large_numbers_alike() -> None:
    lone = json.dumps({"s": "\ud800"})  # (json.dumps escapes a lone surrogate; pydantic-core refuses it)
    assert json_value(lone) == {"s": "\ud800"}
    assert math.isnan(json_value('{"x": NaN}')["x"])
    assert json_value('{"x": 1e400, "n": 123456789012345678901234567890}') == {
        "x": math.inf,
        "n": 123456789012345678901234567890,
    }
    for broken in ("{", '{"a": }', "not json", ""):
        with pytest.raises(json.JSONDecodeError):  # (json's own error, as before)
            json_value(broken)


def _row(**columns: Any) -> dict[str, Any]:
    """A claimed row as the claim's statement returns it, ``columns`` changed."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return {
        "id": 7,
        "lease_token": 1,
        "locked_until": now,
        "attempt": 0,
        "type": "Job",
        "queue": "jobs",
        "message_id": "0" * 32,
        "tracking_id": "1" * 32,
        "correlation_id": None,
        "created_at": now,
        "not_before": None,
        "expires_at": None,
        "raw": None,
        **columns,
    }


def test_a_row_whose_body_is_not_json_is_a_malformed_delivery() -> None:
    row = _row(headers_text="{}", body_text='{"n": 1')
    bad = delivery_from_row(row)
    assert bad.envelope is None
    assert bad.malformed is not None
    assert "stored row 7 does not decode" in str(bad.malformed)
    good = delivery_from_row({**row, "body_text": '{"n": 1}', "headers_text": '{"h": "v"}'})
    assert good.envelope is not None
    assert (good.envelope.body, good.envelope.headers) == ({"n": 1}, {"h": "v"})


DEEP = '{"n": 1, "x": ' + "[" * 5000 + "]" * 5000 + "}"  # deeper than Python's recursion limit


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"body_text": DEEP}, "recursion"),  # json's fallback raises RecursionError
        ({"headers_text": '{"h": ' + "[" * 5000 + "]" * 5000 + "}"}, "recursion"),
        ({"attempt": "x"}, "invalid literal"),  # SQLite keeps any value in an INTEGER column
        ({"body_text": b'{"n": "\xe9"}'}, "utf-8"),  # SQLite's stored bytes, in Latin-1
        ({"headers_text": b'{"h": "\xe9"}'}, "utf-8"),
    ],
)
def test_a_row_that_does_not_decode_for_any_reason_is_a_malformed_delivery_of_its_own(changes, why) -> None:
    """Raised out of the batch instead, after its claim committed, it left every row of the batch leased
    until the sweep, which counted an attempt on each: healthy messages were dead-lettered unrun."""
    row = _row(headers_text=b"{}", body_text=b'{"n": 1}')  # (SQLite's: the stored bytes)
    good = delivery_from_row(row)
    assert good.envelope is not None
    assert (good.envelope.body, good.raw) == ({"n": 1}, '{"n": 1}')
    bad = delivery_from_row({**row, **changes})
    assert bad.envelope is None
    assert bad.malformed is not None
    assert why in str(bad.malformed).lower(), bad.malformed
    assert bad.attempt == 1
    if isinstance(changes.get("body_text"), bytes):
        assert bad.text() == '{"n": "\ufffd"}'  # what its dead letter keeps
