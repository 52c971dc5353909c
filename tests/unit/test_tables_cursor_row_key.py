"""Azure Tables page tokens without a row key.

The service may continue a query with ``x-ms-continuation-NextPartitionKey`` alone ("in some instances
NextRowKey might be null"), for example where a query spanning partitions ends a page at a partition
boundary; Azurite always sends both. azure-data-tables then reports ``{"PartitionKey": pk, "RowKey":
None}``, and that used to become a ``next_cursor`` the next call refused (found in review). Here the
real SDK talks to a stand-in service on 127.0.0.1 that answers the way Azure may.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import pytest
from aiohttp import web
from azure.data.tables._serialize import _add_entity_properties
from azure.data.tables.aio import TableClient

from queueing_core.errors import InvalidArgument
from queueing_core.providers.tables import (
    TablesTracker,
    _decode_cursor,
    _encode_cursor,
    _record_entity,
)
from queueing_core.tracking import MessageQuery, MessageRecord

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
#: Azurite's published development key: the stand-in checks no signature
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
PK = "1!8!cQ--"  # the kind of partition key a page may end at


def rec(i: int, queue: str) -> MessageRecord:
    return MessageRecord(
        message_id=uuid4(),
        tracking_id=uuid4(),
        type="Job",
        queue=queue,
        status="Pending",
        created_at=T0 + timedelta(seconds=i),
        updated_at=T0,
    )


def cursor_of(token: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(token).encode()).decode().rstrip("=")


# -- the cursor on its own ---------------------------------------------------------------------------


@pytest.mark.parametrize("row_key", [None, ""])
def test_a_token_without_a_row_key_makes_a_cursor_that_is_taken_back(row_key):
    cursor = _encode_cursor({"PartitionKey": PK, "RowKey": row_key})
    assert cursor is not None
    # what the SDK is given to continue: the partition key alone, so it sends no NextRowKey
    assert _decode_cursor(cursor) == {"PartitionKey": PK}


def test_a_token_with_both_keys_still_round_trips():
    token = {"PartitionKey": PK, "RowKey": "0000000000000000001_x"}
    assert _decode_cursor(_encode_cursor(token)) == token


def test_a_cursor_issued_with_a_null_row_key_is_taken():
    # what next_cursor carried before such tokens were shortened (a listing paged across an upgrade)
    assert _decode_cursor(cursor_of({"PartitionKey": PK, "RowKey": None})) == {"PartitionKey": PK}


def test_no_continuation_is_no_cursor():
    assert _encode_cursor(None) is None
    assert _encode_cursor({}) is None
    assert _encode_cursor({"PartitionKey": None, "RowKey": None}) is None


@pytest.mark.parametrize(
    "cursor",
    [
        "not a cursor!",
        cursor_of([PK]),
        cursor_of("text"),
        cursor_of({}),
        cursor_of({"RowKey": "x"}),
        cursor_of({"PartitionKey": None}),
        cursor_of({"PartitionKey": None, "RowKey": "x"}),
        cursor_of({"PartitionKey": ""}),
        cursor_of({"PartitionKey": 5}),
        cursor_of({"PartitionKey": PK, "RowKey": ""}),
        cursor_of({"PartitionKey": PK, "RowKey": 7}),
        cursor_of({"PartitionKey": PK, "RowKey": ["x"]}),
        cursor_of({"PartitionKey": PK, "NextTableName": "x"}),
        cursor_of({"PartitionKey": "a\r\nx-ms-injected: 1"}),
        cursor_of({"PartitionKey": "é"}),
        cursor_of({"PartitionKey": "a" * 1025}),
    ],
)
def test_hostile_or_garbage_cursors_are_still_refused(cursor):
    with pytest.raises(InvalidArgument, match="not a cursor from a previous page"):
        _decode_cursor(cursor)


# -- through the SDK ---------------------------------------------------------------------------------


@dataclass
class Service:
    """Answers entity queries with ``pages`` in turn: each page's entities and the continuation
    headers to send with it; records each request's query parameters."""

    pages: list[tuple[list[dict[str, Any]], dict[str, str]]]
    requests: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        params = dict(request.query)
        self.requests.append(params)
        if params.get("NextRowKey") == "" or params.get("NextPartitionKey") == "":
            # as Azure answers an empty continuation part
            return web.json_response({"odata.error": {"code": "InvalidInput"}}, status=400)
        entities, headers = self.pages.pop(0)
        body = {"value": [_add_entity_properties(e) for e in entities]}
        return web.json_response(
            body, headers={"x-ms-version": "2019-02-02", **headers}, content_type="application/json"
        )


@pytest.fixture
async def service() -> AsyncIterator[tuple[Service, TableClient]]:
    svc = Service(pages=[])
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", svc.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={DEV_KEY};"
        f"TableEndpoint=http://127.0.0.1:{port}/devstoreaccount1;"
    )
    client = TableClient.from_connection_string(conn, "history", retry_total=0)
    try:
        yield svc, client
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    "continuation",
    [
        {"x-ms-continuation-NextPartitionKey": PK},
        {"x-ms-continuation-NextPartitionKey": PK, "x-ms-continuation-NextRowKey": ""},
    ],
    ids=["no-row-key", "empty-row-key"],
)
async def test_a_page_continued_without_a_row_key_leads_to_the_next_page(service, continuation):
    svc, client = service
    first = [_record_entity(rec(i, "a")) for i in range(2)]
    last = [_record_entity(rec(9, "q"))]
    svc.pages = [(first, continuation), (last, {})]
    tracker = TablesTracker(client)

    page = await tracker.query(MessageQuery(), limit=2)
    assert [str(r.message_id) for r in page.items] == [e["MessageId"] for e in first]
    assert page.next_cursor is not None

    rest = await tracker.query(MessageQuery(), limit=2, cursor=page.next_cursor)
    assert [str(r.message_id) for r in rest.items] == [e["MessageId"] for e in last]
    assert rest.next_cursor is None
    # the SDK continued at the partition and sent no row key (an empty one would be refused)
    assert svc.requests[1]["NextPartitionKey"] == PK
    assert "NextRowKey" not in svc.requests[1]


async def test_a_short_page_continued_without_a_row_key_is_followed_within_one_call(service):
    """Within one call the tracker hands the SDK's own token back (a page shorter than asked for):
    shortened, it still continues at the partition."""
    svc, client = service
    first = [_record_entity(rec(0, "a"))]
    last = [_record_entity(rec(9, "q"))]
    empty_row_key = {"x-ms-continuation-NextPartitionKey": PK, "x-ms-continuation-NextRowKey": ""}
    svc.pages = [(first, empty_row_key), (last, {})]
    page = await TablesTracker(client).query(MessageQuery(), limit=5)
    assert len(page.items) == 2
    assert page.next_cursor is None
    assert svc.requests[1]["NextPartitionKey"] == PK
    assert "NextRowKey" not in svc.requests[1]
