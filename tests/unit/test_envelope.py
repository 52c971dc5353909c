"""The wire envelope: round trips, and strict decoding with typed errors."""

import contextlib
import json
from datetime import UTC, datetime, timedelta, timezone
from uuid import uuid4

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queueing_core.envelope import Envelope
from queueing_core.errors import MalformedEnvelope, UnsupportedEnvelopeVersion


def make(**kw):
    base = dict(
        type="OrderPlaced",
        queue="orders",
        message_id=uuid4(),
        tracking_id=uuid4(),
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        body={"order_id": "1"},
    )
    return Envelope(**{**base, **kw})


def test_round_trip_keeps_every_field():
    env = make(
        correlation_id="c-1",
        attempt=2,
        headers={"tenant": "t1"},
        not_before=datetime(2026, 1, 3, tzinfo=UTC),
        expires_at=datetime(2026, 1, 4, tzinfo=UTC),
    )
    assert Envelope.decode(env.encode()) == env
    assert Envelope.decode(env.encode_text()) == env
    doc = json.loads(env.encode())
    assert doc["v"] == 1
    assert doc["body"] == {"order_id": "1"}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"not json at all", "Invalid JSON"),
        (b"[1, 2]", "(document)"),
        (b"{}", "type: Field required"),
        (json.dumps({"v": 1, "type": "T"}).encode(), "Field required"),
        (b"\xff\xfe\x00", "(document)"),
    ],
)
def test_malformed_input_gives_a_typed_error_with_the_raw_kept(raw, fragment):
    with pytest.raises(MalformedEnvelope) as info:
        Envelope.decode(raw)
    assert fragment in info.value.reason
    assert info.value.raw == raw
    assert info.value.reason_code == "malformed-envelope"


def test_unknown_fields_are_refused():
    doc = json.loads(make().encode())
    doc["surprise"] = True
    with pytest.raises(MalformedEnvelope, match="surprise"):
        Envelope.decode(json.dumps(doc))


def test_another_version_is_its_own_error():
    doc = json.loads(make().encode())
    doc["v"] = 2
    with pytest.raises(UnsupportedEnvelopeVersion, match="version 2"):
        Envelope.decode(json.dumps(doc))


def test_naive_datetimes_are_read_as_utc():
    doc = json.loads(make().encode())
    doc["created_at"] = "2026-01-02T03:04:05"
    env = Envelope.decode(json.dumps(doc))
    assert env.created_at.tzinfo is not None
    assert env.created_at.utcoffset().total_seconds() == 0


def test_every_time_of_the_envelope_is_held_in_utc_and_an_absent_one_stays_absent():
    # (the conversion sits on the times' type: the optional ones get it as well, None passes by)
    naive, offset = (
        datetime(2026, 1, 2, 3, 4, 5),
        datetime(2026, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2))),
    )
    for value in (naive, offset):
        env = make(created_at=value, not_before=value, expires_at=value)
        for got in (env.created_at, env.not_before, env.expires_at):
            assert got == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
            assert got.tzinfo is UTC
    env = make(not_before=None, expires_at=None)
    assert env.not_before is None
    assert env.expires_at is None


@pytest.mark.parametrize("field", ["created_at", "not_before", "expires_at"])
@pytest.mark.parametrize("value", ["0001-01-01T00:00:00+05:00", "9999-12-31T23:00:00-05:00"])
def test_a_time_out_of_range_once_in_utc_is_a_malformed_envelope(field, value):
    # valid as written, out of datetime's years in UTC: the message is malformed (dead-lettered with
    # its reason), not an OverflowError that fails the whole receive of its queue on every poll
    doc = json.loads(make().encode())
    doc[field] = value
    with pytest.raises(MalformedEnvelope, match=field):
        Envelope.decode(json.dumps(doc))


@given(st.binary(max_size=300))
def test_any_bytes_either_decode_or_raise_malformed(raw):
    with contextlib.suppress(MalformedEnvelope):
        Envelope.decode(raw)


def test_json_nested_deeper_than_the_stack_is_malformed_not_a_crash():
    """About 2 KB of brackets nest deeper than ``json``'s recursion allows: a RecursionError out of the
    decode failed every receive batch it came in (and made a Functions trigger raise on every try)."""
    from queueing_core.envelope import malformed_identity

    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(MalformedEnvelope):
        Envelope.decode(deep)
    with pytest.raises(MalformedEnvelope):
        Envelope.decode('{"v": ' + deep + "}")
    message_id, tracking_id, type_name = malformed_identity(deep)
    assert message_id == tracking_id
    assert type_name == "(unknown)"
