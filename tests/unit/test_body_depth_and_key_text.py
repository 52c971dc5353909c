"""What a message body may hold for the kit to send it as it is: at most ``MAX_BODY_DEPTH`` levels of
objects and arrays, and keys that are Unicode text (no lone surrogate). Refused with
``InvalidArgument`` (a ``ValueError``) naming the cause, before anything is sent.

Before, pydantic-core's bare ``ValueError: Maximum serialization depth exceeded`` came out of
``QueueMessage.body()`` (past about 255 levels), and a high lone surrogate in a key was written as
U+FFFD and sent.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.naming import Transport
from queueing_core.producer import Producer
from queueing_core.providers.sql.rows import unnest_params
from queueing_core.transport import Capabilities

MAX_BODY_DEPTH = 128  # the documented limit (queueing_core.messages.MAX_BODY_DEPTH)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


class Inner(QueueMessage):
    counts: dict[str, int]


@queue("body-shapes")
class Shape(QueueMessage):
    free: dict[str, Any] = {}
    counts: dict[str, int] = {}
    inner: list[Inner] = []


class RecordingProvider:
    transport = Transport.INPROCESS

    def __init__(self) -> None:
        self.capabilities = Capabilities(max_message_bytes=None)
        self.sends: list[Any] = []

    async def send(self, envelopes, *, wait=False):
        self.sends.append(list(envelopes))


def nested(depth: int, leaf: Any = 1) -> Any:
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def test_the_limit_is_the_documented_one():
    from queueing_core import messages

    assert messages.MAX_BODY_DEPTH == MAX_BODY_DEPTH


def test_a_body_may_nest_up_to_the_limit():
    # the body is the first level: ``free`` and its objects are the rest
    assert Shape(free=nested(MAX_BODY_DEPTH - 1)).body()["free"] == nested(MAX_BODY_DEPTH - 1)
    deep_list: Any = [1]
    for _ in range(MAX_BODY_DEPTH - 3):  # the body, free, then MAX_BODY_DEPTH - 2 arrays
        deep_list = [deep_list]
    Shape(free={"l": deep_list}).body()  # arrays count as objects do: exactly at the limit
    with pytest.raises(InvalidArgument, match=f"Shape: .*more than {MAX_BODY_DEPTH} levels deep"):
        Shape(free={"l": [deep_list]}).body()


@pytest.mark.parametrize("depth", [MAX_BODY_DEPTH, 254, 255, 256, 400])
def test_a_deeper_body_is_refused_with_the_limit_named(depth):
    with pytest.raises(InvalidArgument, match=f"more than {MAX_BODY_DEPTH} levels deep"):
        Shape(free=nested(depth)).body()


@pytest.mark.parametrize(
    "fields",
    [
        {"free": {"\ud800": 1}},  # written as U+FFFD x3 before
        {"free": {"ok": {"x\udbffy": [1]}}},
        {"free": {"x": [{"\udc00": 1}]}},  # pydantic-core's UnicodeEncodeError before
        {"counts": {"\ud800": 1}},  # a typed dict's key
        {"inner": [{"counts": {"\udfff": 2}}]},  # in a nested model
    ],
)
def test_a_key_that_is_not_unicode_is_refused(fields):
    with pytest.raises(InvalidArgument, match="Shape: a key holds text that cannot be encoded as UTF-8"):
        Shape.model_validate(fields).body()


def test_a_key_holding_u_fffd_itself_is_sent_as_it_is():
    fields = {"free": {"\ufffd": {"\ufffd\ufffd\ufffd": 1}}, "counts": {"\ufffd": 2}}
    assert Shape.model_validate(fields).body() == {**fields, "inner": []}


async def test_a_header_name_that_is_not_unicode_is_refused_before_sending():
    prov = RecordingProvider()
    producer = Producer(QueueingApp(), prov, clock=lambda: NOW)
    with pytest.raises(InvalidArgument, match="header's name holds text that cannot be encoded as UTF-8"):
        await producer.enqueue(Shape(), headers={"\ud800": "x"})
    assert prov.sends == []


async def test_a_body_enqueue_middleware_nests_too_deep_is_refused_for_that_reason():
    app = QueueingApp()
    prov = RecordingProvider()
    producer = Producer(app, prov, clock=lambda: NOW)

    @app.use_enqueue_middleware
    async def deepen(env, call_next):
        return await call_next(env.model_copy(update={"body": {"free": nested(300)}}))

    # (before: "holds text that cannot be encoded as UTF-8", the wrong reason)
    with pytest.raises(InvalidArgument, match="levels deep"):
        await producer.enqueue(Shape())
    assert prov.sends == []


def test_the_postgresql_rows_refuse_a_body_too_deep_to_write():
    row = {c: None for c in ("message_id", "tracking_id", "queue", "type", "status", "attempt")}
    row |= {c: None for c in ("correlation_id", "created_at", "updated_at", "not_before")}
    row |= {"available_at": None, "expires_at": None, "headers": {}, "body": {"free": nested(260)}}
    with pytest.raises(InvalidArgument, match="levels deep"):
        unnest_params([row], "chan")
