"""Reading the AMQP properties of a message another client wrote, whatever they hold.

AMQP's short strings (a message id, a header name) are octets, and the broker passes on whatever a
publisher wrote: a Go or Java client may send ones that are not UTF-8, a timestamp in microseconds,
or a header table nested hundreds deep. pamqp, under aiormq and aio-pika, decodes a message's
properties in the connection's frame reader and raises on each of these (``UnicodeDecodeError``,
"year 55840 is out of range", ``RecursionError``): the reader stops, the whole connection closes, the
broker delivers the message again when it reconnects, and so for ever. Its queue stopped behind it,
every run in flight on that connection ran again, and a scan of a dead-letter queue holding one lost
its connection at every read.

So, when the RabbitMQ provider loads, pamqp's decoding of ``Basic.Properties`` (and only that: method
frames and bodies decode as before) is given a second way: properties pamqp decodes keep exactly
pamqp's values, and when it raises they are decoded again, each property on its own, where what cannot
be read becomes ``None`` (a short string that is not UTF-8, a time no ``datetime`` holds), a header name
is read with replacement characters and a table nested deeper than :data:`MAX_DEPTH` gives way to a
note. Such a message is marked, in a header only this decoder writes (:data:`UNREADABLE`), with what
could not be read; the provider then dead-letters it as malformed, its body kept, rather than run it
on values that are not the ones sent. Replaced only on the pamqp versions whose decoding this was
written against (:data:`CHECKED`); on another the provider says once that it is not, and pamqp's own
decoding stays.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pamqp import base, commands, decode

log = logging.getLogger("queueing.rabbitmq")

#: the header the decoder adds to a message whose properties it could not read whole; its value, an
#: :class:`Unreadable`, says what it could not read
UNREADABLE = "x-queueing-unreadable-properties"
#: the deepest a header table is read (AMQP's own ``x-death`` goes three deep); pamqp's recursion
#: ran out of stack some 480 deep, and a table nested deeper reaches no code that walks it recursively
MAX_DEPTH = 32
#: the pamqp versions, from (major, minor) up to before (major, minor), whose ``Basic.Properties``
#: decoding was read: 3.3 (aiormq 6.8, aio-pika 9.4 and later 9.x) to 4.x (aiormq 7, aio-pika 10)
CHECKED = ((3, 3), (5, 0))
#: at most this many bytes of an unreadable short string are quoted in the note
QUOTED = 24

#: pamqp's own decoding of a message's properties, tried first
_pamqp_unmarshal = base.BasicProperties.unmarshal


class Unreadable(str):
    """What the decoder could not read of a message's properties, as the value of :data:`UNREADABLE`.
    Only the decoder makes one: a header of that name that came over the wire is a plain ``str``, so
    no publisher can mark a message, nor unmark one."""

    properties: tuple[str, ...]

    def __new__(cls, problems: list[tuple[str, str]]) -> Unreadable:
        note = super().__new__(cls, "; ".join(why for _, why in problems))
        note.properties = tuple(dict.fromkeys(name for name, _ in problems))
        return note


def unreadable(headers: Mapping[str, Any] | None) -> Unreadable | None:
    """What could not be read of the properties of the message with ``headers``, or None."""
    note = (headers or {}).get(UNREADABLE)
    return note if isinstance(note, Unreadable) else None


def checked(pamqp_version: str) -> bool:
    """Whether this pamqp version's decoding of properties is the one this module was written against."""
    try:
        major, minor = (int(part) for part in pamqp_version.split(".")[:2])
    except ValueError:
        return False
    return CHECKED[0] <= (major, minor) < CHECKED[1]


def install() -> bool:
    """Give pamqp's decoding of message properties its second way (once per process); False, said once
    at WARNING, where this pamqp is not one it was written against."""
    properties = commands.Basic.Properties
    if properties.unmarshal is _tolerant_unmarshal:
        return True
    try:
        found = version("pamqp")
    except PackageNotFoundError:
        found = "unknown"
    if not checked(found) or properties.unmarshal is not _pamqp_unmarshal:
        log.warning(
            "pamqp %s is not a version whose decoding of message properties the kit reads tolerantly "
            "(%d.%d to before %d.%d): a message whose properties it cannot decode (a message id that is "
            "not UTF-8, a timestamp in microseconds) closes the connection that receives it",
            found,
            *CHECKED[0],
            *CHECKED[1],
        )
        return False
    properties.unmarshal = _tolerant_unmarshal  # type: ignore[method-assign]
    return True


def _tolerant_unmarshal(self: base.BasicProperties, flags: int, data: bytes) -> None:
    try:
        _pamqp_unmarshal(self, flags, data)
        return
    except (ValueError, RecursionError, OverflowError, OSError):  # (UnicodeDecodeError is a ValueError)
        pass
    problems: list[tuple[str, str]] = []
    for name in self.__slots__:
        if flags & self.flags[name]:
            kind = getattr(type(self), "_" + name)
            consumed, value = _property(data, kind, name, problems)
            setattr(self, name, value)
            data = data[consumed:]
    if problems:
        headers: dict[str, Any] = dict(getattr(self, "headers", None) or {})
        headers[UNREADABLE] = Unreadable(problems)
        self.headers = headers  # type: ignore[attr-defined]


def _property(data: bytes, kind: str, name: str, problems: list[tuple[str, str]]) -> tuple[int, Any]:
    """One property, as pamqp reads it where it can; raises ``ValueError`` only where the frame itself
    is cut short (the properties after it cannot be found)."""
    if kind == "shortstr":
        raw = _counted(data, 1)
        try:
            return 1 + len(raw), raw.decode("utf-8")
        except UnicodeDecodeError:
            problems.append((name, f"{name} {_quote(raw)} is not UTF-8"))
            return 1 + len(raw), None
    if kind == "timestamp":
        return 8, _timestamp(data, name, name, problems)
    if kind == "table":
        raw = _counted(data, 4)
        try:
            return 4 + len(raw), _table(raw, 1, problems)
        except (ValueError, struct.error) as exc:  # its entries cannot be told apart: none is read
            problems.append((name, f"{name} cannot be read ({exc})"))
            return 4 + len(raw), {}
    return decode.by_type(data, kind)


def _counted(data: bytes, width: int) -> bytes:
    """The bytes of a value that starts with its length (``width`` bytes, big-endian)."""
    if len(data) < width:
        raise ValueError("a property is cut short")
    end = width + int.from_bytes(data[:width], "big")
    if end > len(data):
        raise ValueError("a property is cut short")
    return data[width:end]


def _timestamp(data: bytes, name: str, what: str, problems: list[tuple[str, str]]) -> Any:
    """The time in property ``name`` (``what`` says where), or None where no ``datetime`` holds it."""
    if len(data) < 8:
        raise ValueError("a timestamp is cut short")
    try:
        return decode.timestamp(data[:8])[1]
    except (ValueError, OverflowError, OSError):
        seconds = int.from_bytes(data[:8], "big")
        problems.append((name, f"{what} {seconds} is out of range (not seconds since 1970)"))
        return None


def _table(raw: bytes, depth: int, problems: list[tuple[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    offset = 0
    while offset < len(raw):
        key_bytes = _counted(raw[offset:], 1)
        offset += 1 + len(key_bytes)
        try:
            key = key_bytes.decode("utf-8")
        except UnicodeDecodeError:
            key = key_bytes.decode("utf-8", errors="replace")
            problems.append(("headers", f"header name {_quote(key_bytes)} is not UTF-8"))
        consumed, out[key] = _field(raw[offset:], depth, key, problems)
        offset += consumed
    return out


def _field(raw: bytes, depth: int, key: str, problems: list[tuple[str, str]]) -> tuple[int, Any]:
    """One value of a table or array (its type octet first), with the bytes it took."""
    kind = raw[:1]
    if kind in (b"F", b"A"):
        body = _counted(raw[1:], 4)
        taken = 5 + len(body)
        if depth >= MAX_DEPTH:
            problems.append(("headers", f"header {key!r} is nested deeper than {MAX_DEPTH} tables"))
            return taken, f"(nested deeper than {MAX_DEPTH} tables: not read)"
        if kind == b"F":
            return taken, _table(body, depth + 1, problems)
        items: list[Any] = []
        offset = 0
        while offset < len(body):
            consumed, value = _field(body[offset:], depth + 1, key, problems)
            items.append(value)
            offset += consumed
        return taken, items
    if kind == b"T":
        return 9, _timestamp(raw[1:], "headers", f"header {key!r}", problems)
    return decode.embedded_value(raw)


def _quote(raw: bytes) -> str:
    return repr(raw[:QUOTED]) + ("..." if len(raw) > QUOTED else "")
