"""Bodies the stores cannot keep as sent, through the ops API, the dashboard and ``app.enqueue``.

A body nested a few hundred levels deep (far below the JSON parser's limit) in a free-form field
answered 500: pydantic-core gives up writing JSON past about 255 levels with a bare ``ValueError``
(on PostgreSQL the row's ``to_json`` failed a level sooner; at exactly 255 the answer was a 422 for
"text that cannot be encoded as UTF-8", the wrong reason). The kit now bounds a body at
``MAX_BODY_DEPTH`` levels and refuses a deeper one with a 422 naming the limit.

A lone surrogate in a body's dict *key* was written as U+FFFD by pydantic's JSON mode: the message was
accepted (201) and stored with another key. It is refused like one in a value. Both on SQLite and
PostgreSQL; nothing is written.
"""

from __future__ import annotations

from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

MAX_BODY_DEPTH = 128  # the documented limit (queueing_core.messages.MAX_BODY_DEPTH)
PROBLEM = "application/problem+json"
JSON = {"Content-Type": "application/json"}
QUEUE = "deep-or-odd-keys"
TOO_DEEP = f"more than {MAX_BODY_DEPTH} levels deep"
NOT_UTF8 = "cannot be encoded as UTF-8"


@queue(QUEUE)
class Blob(QueueMessage):
    data: dict[str, Any]


def nested_text(depth: int) -> str:
    """A body whose ``data`` holds ``depth`` objects inside one another (the body is one more)."""
    return '{"data": ' + '{"a": ' * depth + "1" + "}" * depth + "}"


def nested(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.fixture
async def runtime(sql_db):
    app = QueueingApp("deep-or-odd-keys")
    app.message(Blob)
    rt = Runtime(app, sql_db.provider(listen=False))
    await rt.open()
    yield rt
    await rt.close()


async def _stored(client) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = (await client.get("/messages", params={"queue": QUEUE})).json()["items"]
    return items


async def test_the_api_refuses_a_body_nested_too_deep_with_a_422(runtime):
    async with ops_client(runtime) as client:
        # (255 was the 422 for the wrong reason; 254 on PostgreSQL and 256 on SQLite were 500s)
        for depth in (MAX_BODY_DEPTH, 200, 254, 255, 256, 300, 900):
            r = await client.post(f"/queues/{QUEUE}/messages", content=nested_text(depth), headers=JSON)
            assert r.status_code == 422, (depth, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith(PROBLEM)
            assert r.json()["type"].endswith(":invalid-argument")
            assert TOO_DEEP in r.json()["detail"], (depth, r.json())
        assert await _stored(client) == []

        # the deepest body allowed is accepted, stored as sent, and shown
        ok = await client.post(
            f"/queues/{QUEUE}/messages", content=nested_text(MAX_BODY_DEPTH - 1), headers=JSON
        )
        assert ok.status_code == 201, ok.text[:300]
        mid = ok.json()["enqueued"][0]["message_id"]
        content = await client.get(f"/messages/{mid}/content")
        assert content.status_code == 200
        assert content.json()["body"] == {"data": nested(MAX_BODY_DEPTH - 1)}
        assert (await client.get(f"/messages/{mid}")).status_code == 200
        assert (await client.get(f"/ui/messages/{mid}")).status_code == 200


async def test_the_api_refuses_a_key_that_is_not_unicode(runtime):
    async with ops_client(runtime) as client:
        for raw in (
            '{"data": {"\\ud800": 1}}',  # written as U+FFFD x3 before, and accepted
            '{"data": {"a": {"\\udbff": {"b": 1}}}}',
            '{"data": {"x": [{"\\udc00": 1}]}}',  # a 500 before
            '{"data": {"a\\ud800b": "value"}}',
        ):
            r = await client.post(f"/queues/{QUEUE}/messages", content=raw, headers=JSON)
            assert r.status_code == 422, (raw, r.status_code, r.text[:300])
            assert r.json()["type"].endswith(":invalid-argument")
            assert f"a key holds text that {NOT_UTF8}" in r.json()["detail"], r.json()
        # U+0000 in a key is refused as in a value
        nul = await client.post(
            f"/queues/{QUEUE}/messages", content='{"data": {"a\\u0000": 1}}', headers=JSON
        )
        assert nul.status_code == 422, nul.text
        assert "U+0000" in nul.json()["detail"], nul.text
        assert await _stored(client) == []

        # a key that really holds U+FFFD is text like any other: accepted and kept as sent
        ok = await client.post(f"/queues/{QUEUE}/messages", json={"data": {"\ufffd\ufffd": 1}})
        assert ok.status_code == 201, ok.text
        mid = ok.json()["enqueued"][0]["message_id"]
        assert (await client.get(f"/messages/{mid}/content")).json()["body"] == {"data": {"\ufffd\ufffd": 1}}


async def test_the_dashboard_enqueue_form_refuses_them_too(runtime):
    async with ops_client(runtime) as client:
        for text, reason in (
            (nested_text(256), TOO_DEEP),  # a 500 before
            (nested_text(MAX_BODY_DEPTH), TOO_DEEP),
            ('{"data": {"\\ud800": 1}}', NOT_UTF8),
        ):
            form = {"body": text, "correlation_id": "", "delay": ""}
            r = await client.post(f"/ui/enqueue/{QUEUE}", data=form)
            assert r.status_code == 422, (reason, r.status_code, r.text[:300])
            assert reason in r.text
        assert await _stored(client) == []


async def test_enqueue_from_code_raises_invalid_argument(runtime):
    app = runtime.app
    for depth in (MAX_BODY_DEPTH, 300):  # 300: past pydantic-core's own limit, its bare ValueError before
        with pytest.raises(InvalidArgument, match=rf"Blob: .*{TOO_DEEP}"):
            await app.enqueue(Blob(data=nested(depth)))
    for data in ({"\ud800": 1}, {"x": [{"\udc00": 1}]}):
        with pytest.raises(InvalidArgument, match=rf"Blob: a key .*{NOT_UTF8}"):
            await app.enqueue(Blob(data=data))
    with pytest.raises(InvalidArgument, match=f"header's name .*{NOT_UTF8}"):
        await app.enqueue(Blob(data={}), headers={"\ud800": "x"})
    async with ops_client(runtime) as client:
        assert await _stored(client) == []
    await app.enqueue(Blob(data=nested(MAX_BODY_DEPTH - 1)))  # the limit itself is allowed
