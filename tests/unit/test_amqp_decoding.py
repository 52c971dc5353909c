"""The RabbitMQ provider's reading of AMQP message properties another client wrote, on content header
frames built here (no broker): what pamqp decodes stays exactly pamqp's; what it raised on (and so closed
the connection that received it) is read with the part that cannot be read marked, and the message
marked with what it was."""

from __future__ import annotations

import struct
from datetime import UTC, datetime
from importlib.metadata import version

import pytest
from pamqp import base, commands, header

from queueing_core.providers import amqp_decoding, rabbitmq  # noqa: F401  (the provider installs it)
from queueing_core.providers.amqp_decoding import MAX_DEPTH, UNREADABLE, checked, unreadable

SENT_ID = "ZZZZ-UNREADABLE-ZZZZ"
SENT_TS = datetime(2001, 9, 9, 1, 46, 40, tzinfo=UTC)  # 1,000,000,000 s


def frame(properties: commands.Basic.Properties, old: bytes = b"", new: bytes = b"") -> bytes:
    """A content header frame's payload with ``properties``, ``old`` replaced by ``new`` (as long)."""
    assert len(old) == len(new)
    payload = header.ContentHeader(0, 10, properties).marshal()
    if old:
        assert payload.count(old) == 1
        payload = payload.replace(old, new)
    return payload


def read(payload: bytes) -> commands.Basic.Properties:
    h = header.ContentHeader()
    h.unmarshal(payload)
    return h.properties


def pamqp_reads(payload: bytes) -> commands.Basic.Properties:
    """What pamqp's own decoding makes of ``payload``."""
    h = header.ContentHeader()
    h.class_id, h.weight, h.body_size = struct.unpack(">HHQ", payload[0:12])
    offset, flags = h._get_flags(payload[12:])
    base.BasicProperties.unmarshal(h.properties, flags, payload[12 + offset :])
    return h.properties


def nested_table(depth: int) -> bytes:
    """The encoding of a header table ``{"k": {"k": ... {"leaf": 1}}}`` ``depth`` tables deep, written
    without recursion (pamqp's own encoder runs out of stack)."""
    leaf = b"\x04leaf" + b"I" + struct.pack(">i", 1)
    table = struct.pack(">I", len(leaf)) + leaf
    for _ in range(depth):
        entry = b"\x01k" + b"F" + table
        table = struct.pack(">I", len(entry)) + entry
    return table


def test_the_provider_installs_the_decoder_on_a_pamqp_it_was_written_against():
    assert checked(version("pamqp")), "a pamqp outside the versions checked: read its decoding again"
    assert commands.Basic.Properties.unmarshal is not base.BasicProperties.unmarshal
    assert amqp_decoding.install()  # (once is enough: a second call changes nothing)


@pytest.mark.parametrize(
    ("found", "ok"),
    [("3.2.1", False), ("3.3.0", True), ("4.0.1", True), ("4.9", True), ("5.0.0", False), ("dev", False)],
)
def test_only_the_pamqp_versions_read_are_checked(found, ok):
    assert checked(found) is ok


def test_properties_pamqp_reads_are_read_exactly_as_pamqp_reads_them():
    props = commands.Basic.Properties(
        content_type="application/json",
        headers={"x-attempt": 2, "nested": {"a": [1, "b", {"c": SENT_TS}]}, "raw": bytearray(b"\xff\xfe")},
        delivery_mode=2,
        message_id=SENT_ID,
        timestamp=SENT_TS,
        message_type="Invoice",
        app_id="billing",
    )
    payload = frame(props)
    got, want = read(payload), pamqp_reads(payload)
    assert list(got) == list(want)
    assert UNREADABLE not in (got.headers or {})


def test_a_message_id_that_is_not_utf8_is_none_and_the_message_marked():
    props = commands.Basic.Properties(message_id=SENT_ID, timestamp=SENT_TS, app_id="billing")
    got = read(frame(props, SENT_ID.encode(), b"\xff" * len(SENT_ID)))
    assert got.message_id is None  # never a value that is not the one sent
    assert got.timestamp == SENT_TS  # the properties after it are read
    assert got.app_id == "billing"
    why = unreadable(got.headers)
    assert why is not None
    assert why.properties == ("message_id",)
    assert "message_id" in why
    assert "not UTF-8" in why


def test_a_timestamp_in_microseconds_is_none_and_the_message_marked():
    props = commands.Basic.Properties(timestamp=SENT_TS, message_type="Invoice")
    got = read(frame(props, struct.pack(">Q", 1_000_000_000), struct.pack(">Q", 1_700_000_000_000_000)))
    assert got.timestamp is None
    assert got.message_type == "Invoice"
    why = unreadable(got.headers)
    assert why is not None
    assert why.properties == ("timestamp",)
    assert "1700000000000000" in why


def test_a_header_timestamp_in_microseconds_is_none_and_the_message_marked():
    props = commands.Basic.Properties(headers={"sent": SENT_TS, "x-attempt": 3})
    got = read(frame(props, struct.pack(">Q", 1_000_000_000), struct.pack(">Q", 1_700_000_000_000_000)))
    assert got.headers is not None
    assert got.headers["sent"] is None
    assert got.headers["x-attempt"] == 3
    why = unreadable(got.headers)
    assert why is not None
    assert why.properties == ("headers",)
    assert "header 'sent'" in why


def test_a_header_name_that_is_not_utf8_is_read_with_replacement_characters_and_the_message_marked():
    props = commands.Basic.Properties(headers={SENT_ID: 1, "x-attempt": 3}, message_id="m-1")
    got = read(frame(props, SENT_ID.encode(), b"\xfe" * len(SENT_ID)))
    assert got.headers is not None
    assert got.headers["\ufffd" * len(SENT_ID)] == 1
    assert got.headers["x-attempt"] == 3
    assert got.message_id == "m-1"
    why = unreadable(got.headers)
    assert why is not None
    assert why.properties == ("headers",)
    assert "header name" in why


def test_a_header_table_nested_too_deep_is_replaced_by_a_note_and_the_message_marked():
    table = nested_table(600)
    props = commands.Basic.Properties(headers={"deep": "PLACEHOLDER"}, message_id="m-1")
    payload = frame(props)
    # the headers property as pamqp wrote it, swapped for one holding the deep table
    written = commands.Basic.Properties(headers={"deep": "PLACEHOLDER"}).marshal()[2:]
    entry = b"\x04deep" + b"F" + table
    payload = payload.replace(written, struct.pack(">I", len(entry)) + entry)
    with pytest.raises(RecursionError):
        pamqp_reads(payload)  # (what closed the connection)
    got = read(payload)
    assert got.message_id == "m-1"
    assert got.headers is not None
    level = got.headers["deep"]  # (the headers are the first of the MAX_DEPTH tables read)
    for _ in range(MAX_DEPTH - 2):
        level = level["k"]
    assert isinstance(level["k"], str)
    assert "nested deeper" in level["k"]
    why = unreadable(got.headers)
    assert why is not None
    assert "nested deeper" in why


def test_a_header_table_that_cannot_be_read_is_left_out_and_the_properties_after_it_are_read():
    props = commands.Basic.Properties(headers={"x-kind": 1}, message_id="m-1")
    # an int field's type octet changed to one AMQP does not define
    got = read(frame(props, b"\x06x-kindb", b"\x06x-kind?"))
    assert got.headers is not None
    assert set(got.headers) == {UNREADABLE}
    assert got.message_id == "m-1"
    why = unreadable(got.headers)
    assert why is not None
    assert why.properties == ("headers",)


def test_a_header_of_the_markers_name_from_the_wire_marks_nothing():
    props = commands.Basic.Properties(headers={UNREADABLE: "forged"})
    got = read(frame(props))
    assert got.headers == {UNREADABLE: "forged"}
    assert unreadable(got.headers) is None
