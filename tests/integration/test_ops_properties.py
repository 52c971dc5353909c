"""Property: whatever a client sends to any route of the ops API (every query and path parameter, the
body, the credentials), the answer is a 2xx, or a 4xx as ``application/problem+json``; never a 5xx.
And a request writes nothing unless its route is meant to write and it succeeded.

Run against the stores the API reads and writes: SQLite, PostgreSQL, and the Tables-backed history of
the Storage Queues provider on Azurite. The routes and their parameters come from the served OpenAPI
document, so a new route or parameter without a strategy here fails the test instead of going unfuzzed.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import timedelta, timezone
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from queueing_core import QueueNaming
from queueing_core.messages import MessageStatus
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.runtime import Runtime
from tests.services import POSTGRES_URL, drop_schema, require

from .test_ops_api import KEY, Email, Report, build_app
from .test_ops_hardening import CRAFTED_CURSORS, b64

T = TypeVar("T")
PROBLEM = "application/problem+json"
#: examples per route and store (18 routes x 3 stores); see the README's test notes for the run time
EXAMPLES = {"sqlite": 60, "postgres": 60, "tables": 25}


async def _no_service() -> OpsService:
    raise AssertionError("only the document is read")


DOC = create_app(_no_service, api_key="k").openapi()
ROUTES = [(method.upper(), path, op) for path, ops in DOC["paths"].items() for method, op in ops.items()]


class LoopThread:
    """One event loop in a thread for a store's whole module: Hypothesis calls the test synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class World:
    """A store holding messages in several states, the API over it, and a way to photograph it."""

    name: str
    runtime: Runtime
    client: httpx.AsyncClient
    snapshot: Callable[[], Awaitable[Any]]
    ids: list[str] = field(default_factory=list)
    cursors: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


async def populate(world: World) -> None:
    """Messages in several states: pending, sleeping, leased, succeeded, dead-lettered, waiting."""
    rt = world.runtime
    app = rt.app
    sent = await app.enqueue_many([Email(to=f"{i}@x.io", subject="s", fail=i % 3 == 0) for i in range(8)])
    await app.enqueue(Report(name="r"))
    await app.enqueue(Email(to="later@x.io", subject="s"), delay=600, correlation_id="corr-1")
    deliveries = await rt.provider.receive(app.subscription("Email"), 4)
    for d in deliveries[:3]:  # settled by the pipeline: succeeded or dead-lettered; the last stays leased
        await rt.process_and_settle(d)
    world.ids[:] = [str(r.message_id) for r in sent]  # in place: the strategies read this list
    if not world.cursors:
        auth = {"X-API-Key": KEY}
        for params in ({"limit": 1}, {"limit": 2, "queue": "emails"}, {"limit": 1, "status": "Pending"}):
            page = (await world.client.get("/messages", params=params, headers=auth)).json()
            if page["next_cursor"]:
                world.cursors.append(page["next_cursor"])
        assert world.cursors, "the world should hold more than one page"


async def refill(world: World) -> None:
    """After a purge took (nearly) everything, messages again: the next examples need some to act on."""
    if sum((await world.runtime.tracker.counts()).values()) < 5:
        await populate(world)


def known_id(world: World) -> st.SearchStrategy[str]:
    # read when drawn, not when built: a refill replaces the ids
    return st.integers(0, 7).map(lambda i: world.ids[i % len(world.ids)])


async def sql_world(name: str) -> World:
    from queueing_core.providers.sql import SqlProvider

    schema = None
    if name == "postgres":
        schema = f"qp_{uuid.uuid4().hex[:10]}"
        url = POSTGRES_URL
    else:
        import tempfile

        url = f"sqlite:///{tempfile.mkdtemp()}/props.db"
    app, _ = build_app()
    provider = SqlProvider(url, schema=schema)
    rt = Runtime(app, provider)
    await rt.open()
    t = provider.tables

    async def snapshot() -> Any:
        async with provider.engine.connect() as conn:
            return [
                sorted(map(tuple, (await conn.execute(sa.select(table))).all()), key=repr)
                for table in (t.messages, t.pauses, t.circuits)
            ]

    world = World(name, rt, api_client(rt), snapshot)
    await populate(world)
    archived = world.ids[1]  # a finished message, archived: the API lists and filters those too
    await world.client.post(f"/messages/{archived}/archive", headers={"X-API-Key": KEY})
    world.cleanup.append(rt.close)
    if schema is not None:
        world.cleanup.append(lambda: drop_schema(schema))
    return world


async def tables_world(azurite: Any) -> World:
    from azure.data.tables.aio import TableServiceClient
    from azure.storage.queue.aio import QueueServiceClient

    from queueing_core.connections import StorageConnection
    from queueing_core.providers.storage_queue import StorageQueueProvider
    from tests.services import fresh_prefix

    tag = uuid.uuid4().hex[:10]
    prefix = fresh_prefix()
    tables = {"control_table": f"ctl{tag}", "tracker_table": f"hist{tag}"}
    app, _ = build_app()
    app.naming = QueueNaming(prefix=prefix)
    provider = StorageQueueProvider(StorageConnection(azurite.connection_string), **tables)
    rt = Runtime(app, provider)
    await rt.open()
    table_service = TableServiceClient.from_connection_string(azurite.connection_string)
    queue_service = QueueServiceClient.from_connection_string(azurite.connection_string)

    async def snapshot() -> Any:
        state: list[Any] = []
        for table in tables.values():
            client = table_service.get_table_client(table)
            state.append(sorted([(repr(dict(e)), e.metadata["etag"]) async for e in client.list_entities()]))
        queues = [q.name async for q in queue_service.list_queues(name_starts_with=prefix.lower())]
        for name in sorted(queues):
            props = await queue_service.get_queue_client(name).get_queue_properties()
            state.append((name, props.approximate_message_count))
        return state

    world = World("tables", rt, api_client(rt), snapshot)
    await populate(world)

    async def close() -> None:
        await rt.close()
        for table in tables.values():
            await table_service.delete_table(table)
        async for q in queue_service.list_queues(name_starts_with=prefix.lower()):
            await queue_service.delete_queue(q.name)
        await table_service.close()
        await queue_service.close()

    world.cleanup.append(close)
    return world


def api_client(rt: Runtime) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
        base_url="http://test" + PREFIX,
    )


@pytest.fixture(scope="module", params=["sqlite", "postgres", "tables"])
def world(request):
    if request.param == "postgres":
        require("PostgreSQL", "127.0.0.1", 5432)
    azurite = request.getfixturevalue("azurite") if request.param == "tables" else None
    loop = LoopThread()
    made = loop.run(tables_world(azurite) if request.param == "tables" else sql_world(request.param))
    yield loop, made
    for step in made.cleanup:
        loop.run(step())
    loop.close()


# -- strategies ----------------------------------------------------------------------------------------
HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a\x00b",
        "\r\nX-Injected: 1",
        "../../etc/passwd",
        "%00",
        "%2e%2e%2f",
        "' OR 1=1 --",
        '"; DROP TABLE queueing_messages; --',
        "${jndi:ldap://x/a}",
        "{{7*7}}",
        "<script>alert(1)</script>",
        "\u202eevil",
        "\ufeff",
        "😀" * 40,
        "a" * 600,
        "9" * 400,
        "-1",
        "0",
        "1e309",
        "-1e309",
        "nan",
        "NaN",
        "inf",
        "-0",
        "0x10",
        "1_000",
        " 5 ",
        "true",
        "null",
        "[]",
        "{}",
    ]
)
#: any text that can travel in a URL (lone surrogates cannot be encoded as UTF-8 by any client)
TEXT = st.text(st.characters(codec="utf-8"), max_size=80)
ANY_TEXT = st.one_of(HOSTILE, TEXT)
STATUSES = [s.value for s in MessageStatus] + ["Bogus", "Custom_1", "pending"]
#: whole-minute offsets (ISO 8601 has no seconds in an offset), including the extremes of +-14:00
OFFSETS = st.integers(-14 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))
TIMES = st.datetimes(timezones=st.one_of(st.none(), OFFSETS)).map(lambda d: d.isoformat())
ODD_TIMES = st.sampled_from(
    [
        "9999-12-31T23:59:59-14:00",
        "0001-01-01T00:00:00+14:00",
        "2026-02-30T00:00:00Z",
        "2026-01-01",
        "2026-01-01T25:00:00Z",
        "1700000000",
        "now",
    ]
)


def odd_cursors(world: World) -> st.SearchStrategy[str]:
    real = st.sampled_from(world.cursors)
    flipped = st.tuples(real, st.integers(0, 200), st.characters(codec="ascii")).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1 :]
    )
    return st.one_of(
        flipped,
        st.sampled_from(CRAFTED_CURSORS),
        st.binary(max_size=64).map(b64),
        st.dictionaries(TEXT, st.one_of(TEXT, st.integers(), st.none()), max_size=3).map(
            lambda d: b64(json.dumps(d))
        ),
        st.sampled_from([b64(json.dumps({"PartitionKey": k, "RowKey": "x"})) for k in ("!id", "a'b", "~")]),
    )


def parameter_values(name: str, world: World, *, hostile: bool) -> st.SearchStrategy[str]:
    """Values for one parameter: plausible ones, that get a request past validation to the store (where
    a crafted cursor or an odd time does its damage), or, for the one parameter an example picks to
    attack, anything at all."""
    plausible: dict[str, st.SearchStrategy[str]] = {
        "queue": st.sampled_from(["emails", "reports", "nope", "Emails", "emails-poison"]),
        "queueName": st.sampled_from(["emails", "reports", "nope", "a" * 260]),
        "type": st.sampled_from(["Email", "Report", "Nope", "_x.y"]),
        "name": st.sampled_from(["nightly", "x.y:z-1", "_", "a" * 200]),  # a schedule
        "status": st.sampled_from(STATUSES),
        "created_from": TIMES,
        "created_to": TIMES,
        "archived": st.sampled_from(["true", "false"]),
        "all": st.sampled_from(["true", "false"]),
        "correlation_id": st.sampled_from(["corr-1", "x" * 256, "a b"]),
        "limit": st.integers(1, 500).map(str),
        "take": st.integers(1, 500).map(str),
        "cursor": st.sampled_from(world.cursors),
        "delay_seconds": st.one_of(st.floats(0, 366 * 86400).map(repr), st.integers(0, 20000).map(str)),
        "id": st.one_of(
            known_id(world),
            known_id(world).map(str.upper),
            known_id(world).map(lambda i: "urn:uuid:" + i),
            st.uuids().map(str),
        ),
    }
    assert name in plausible, f"no strategy for the parameter {name!r}: add one"
    if not hostile:
        return plausible[name]
    odd = {
        "cursor": odd_cursors(world),
        "created_from": ODD_TIMES,
        "created_to": ODD_TIMES,
        "archived": st.sampled_from(["yes", "1", "on", "TRUE", "t"]),
        "all": st.sampled_from(["yes", "1", "on", "TRUE", "t"]),
        "correlation_id": st.sampled_from(["x" * 257, "a\tb", "a\x00b", "\x7f"]),
        "limit": st.integers().map(str),
        "take": st.integers().map(str),
        "delay_seconds": st.one_of(st.floats().map(repr), st.integers().map(str)),
        "id": known_id(world).map(lambda i: "{" + i + "}"),
    }.get(name, st.nothing())
    return st.one_of(plausible[name], odd, ANY_TEXT)


VALID_CREDENTIALS = [
    [("X-API-Key", KEY)],
    [("Authorization", f"Bearer {KEY}")],
    [("authorization", f"bearer {KEY}"), ("X-API-Key", KEY)],
]
CREDENTIALS = st.sampled_from(
    [
        *VALID_CREDENTIALS * 4,
        [],
        [("X-API-Key", "wrong")],
        [("X-API-Key", KEY), ("X-API-Key", "wrong")],
        [("Authorization", f"Bearer {KEY}"), ("X-API-Key", "")],
        [("Authorization", KEY)],
    ]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
BODIES = st.one_of(
    st.fixed_dictionaries({"to": TEXT, "subject": TEXT}).map(json.dumps),
    st.lists(st.fixed_dictionaries({"to": TEXT, "subject": TEXT}), min_size=1, max_size=3).map(json.dumps),
    st.sampled_from(['{"name": "r"}', "[]", "{}", "[" * 5000, '{"to": "a", "subject": 1}', "nul\x00l"]),
    # text a store cannot hold: NUL (PostgreSQL), lone surrogates (not Unicode at all)
    st.sampled_from(["\\u0000", "\\ud800", "\\udfff\\ud800", "a\\\\u0000"]).map(
        lambda t: f'{{"to": "{t}", "subject": "s"}}'
    ),
    # the base fields every message has, with values a client should not be able to break things with
    st.fixed_dictionaries(
        {"to": st.just("a@x.io"), "subject": st.just("s")},
        optional={
            "message_id": st.one_of(st.uuids().map(str), TEXT),
            "created_at": st.one_of(TIMES, ODD_TIMES, TEXT),
            "correlation_id": st.one_of(TEXT, st.just("c" * 300), st.none()),
            "properties": st.dictionaries(TEXT, st.one_of(TEXT, st.integers()), max_size=3),
        },
    ).map(json.dumps),
    JSON_VALUES.map(json.dumps),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "application/json; charset=utf-8", "application/problem+json", "text/plain", None]
)


@st.composite
def requests(draw: st.DrawFn, method: str, path: str, op: dict[str, Any], world: World) -> dict[str, Any]:
    params = op.get("parameters", [])
    # one parameter (or none) gets anything at all; the others stay plausible, so that the odd one
    # reaches as deep as it can instead of a neighbour's 422 stopping the request at the door
    attacked = draw(st.sampled_from([None, *(p["name"] for p in params)]))
    url = path
    query: list[tuple[str, str]] = []
    for param in params:
        values = parameter_values(param["name"], world, hostile=param["name"] == attacked)
        if param["in"] == "path":
            url = url.replace("{" + param["name"] + "}", quote(draw(values), safe=""))
        elif param["name"] == attacked or draw(st.integers(0, 2)) == 0:
            repeat = param["name"] == attacked and draw(st.integers(0, 4)) == 0
            query += [(param["name"], draw(values)) for _ in range(2 if repeat else 1)]
    if attacked is None and draw(st.integers(0, 9)) == 0:  # now and then a parameter no route takes
        query.append((draw(st.sampled_from(["stauts", "code", "q", "all"])), draw(ANY_TEXT)))
    credentials = draw(CREDENTIALS)
    headers = list(credentials)
    body = None
    if "requestBody" in op or draw(st.integers(0, 5)) == 0:
        body = draw(BODIES).encode()
        content_type = draw(CONTENT_TYPES)
        if content_type:
            headers.append(("Content-Type", content_type))
    return {
        "method": method,
        "url": url.removeprefix(PREFIX),
        "params": query,
        "headers": headers,
        "body": body,
        "authorized": credentials in VALID_CREDENTIALS,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "path", "op"), ROUTES, ids=[f"{m} {p.removeprefix(PREFIX)}" for m, p, _ in ROUTES]
)
def test_any_input_is_a_2xx_or_a_4xx_problem_and_refused_requests_write_nothing(world, method, path, op):
    loop, w = world

    async def exchange(req: dict[str, Any]) -> tuple[httpx.Response, Any, Any]:
        await refill(w)
        before = await w.snapshot()
        r = await w.client.request(
            req["method"], req["url"], params=req["params"], headers=req["headers"], content=req["body"]
        )
        return r, before, await w.snapshot()

    @settings(
        max_examples=EXAMPLES[w.name],
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(req=requests(method, path, op, w))
    def check(req: dict[str, Any]) -> None:
        r, before, after = loop.run(exchange(req))
        event(f"status {r.status_code}")  # --hypothesis-show-statistics: what the examples reached
        assert r.status_code < 500, (req, r.status_code, r.text)
        if not req["authorized"]:
            assert r.status_code == 401, (req, r.status_code)
        if r.status_code >= 400:
            assert r.headers["content-type"] == PROBLEM, (req, r.status_code, r.text)
            assert r.json()["status"] == r.status_code
        else:
            assert 200 <= r.status_code < 300, (req, r.status_code)
            documented = op["responses"][str(r.status_code)].get("content", {"application/json": {}})
            assert r.headers["content-type"] in documented, (req, r.status_code)
            if r.headers["content-type"] == "application/json":
                r.json()
        if method == "GET" or r.status_code >= 400:
            assert before == after, (req, r.status_code, r.text)

    check()
