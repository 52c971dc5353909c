"""Hostile requests against the ops API and the CLI: one named test per hole an abuse session found
(about a thousand crafted requests against `queueing serve`, with and without a key)."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from uuid import uuid4

import httpx
import pytest

from queueing_core import QueueMessage, queue
from queueing_core.errors import InvalidArgument, MissingPermission, ProviderUnavailable
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime

from .served import free_port, served
from .test_ops_api import AUTH, KEY, Email, build_app

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBLEM = "application/problem+json"
JSON = {"Content-Type": "application/json"}


def is_problem(r: httpx.Response, status: int) -> bool:
    return r.status_code == status and r.headers["content-type"] == PROBLEM


def b64(text: str | bytes) -> str:
    return base64.urlsafe_b64encode(text.encode() if isinstance(text, str) else text).decode()


# -- 1. crafted cursors ------------------------------------------------------------------------------
CRAFTED_CURSORS = [
    b64("2026-01-01T00:00:00+00:00|" + "9" * 30),  # a row id beyond 64 bits
    b64("2026-01-01T00:00:00+00:00|9223372036854775808"),  # 2**63: one past BIGINT
    b64("2026-01-01T00:00:00+00:00|-1"),
    b64("2026-01-01T00:00:00+00:00|0"),
    b64("9999-12-31T23:59:59-14:00|5"),  # past the year 9999 once in UTC
    b64("0001-01-01T00:00:00+14:00|5"),  # before the year 1 once in UTC
    b64("2026-01-01T00:00:00|5"),  # no offset: not what the API issues
    b64("2026-13-45T99:99:00+00:00|5"),
    b64("not a date|5"),
    b64("2026-01-01T00:00:00+00:00|5|6"),
    b64(b"\xff\xfe\x00|1"),
    b64('{"PartitionKey": "q", "RowKey": "r"}'),
    "not base64 at all!",
    "====",
    "%00",
    "-5",
]


async def test_crafted_cursors_are_422_problems_never_500(api):
    client, _rt, _ = api
    await client.post("/queues/emails/messages", json=[{"to": f"{i}@x.io", "subject": "s"} for i in range(3)])
    for cursor in CRAFTED_CURSORS:
        r = await client.get("/messages", params={"cursor": cursor})
        assert is_problem(r, 422), (cursor, r.status_code, r.text)
        assert r.json()["detail"].startswith("cursor:"), r.text
    real = (await client.get("/messages", params={"limit": 1})).json()["next_cursor"]
    assert (await client.get("/messages", params={"cursor": real})).status_code == 200


async def test_crafted_cursors_are_refused_by_the_in_memory_history_too():
    app, _ = build_app()
    rt = Runtime(app, InProcessProvider())
    async with rt:
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
            base_url="http://test" + PREFIX,
            headers=AUTH,
        )
        async with client:
            for cursor in [*CRAFTED_CURSORS, "99999999999999999999", "1e3", "٣"]:
                r = await client.get("/messages", params={"cursor": cursor})
                assert is_problem(r, 422), (cursor, r.status_code, r.text)


class Broken(OpsService):
    """A service whose reads fail in ways the API must not pass on to the client."""

    failure: Exception = RuntimeError("connection to db.internal:5432 failed: password=hunter2")

    async def summary(self):  # GET stats
        raise self.failure


async def test_a_server_error_is_logged_once_and_tells_the_client_nothing(tmp_path, caplog):
    app, _ = build_app()
    rt = Runtime(app, InProcessProvider())
    with (
        caplog.at_level(logging.INFO),
        served(create_app(Broken(rt), api_key=KEY), log_config=None) as base,
    ):
        async with httpx.AsyncClient(headers=AUTH) as client:
            r = await client.get(f"{base}{PREFIX}/stats")
    assert is_problem(r, 500)
    assert "hunter2" not in r.text
    assert "db.internal" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]
    assert len(logged) == 1, [(rec.name, rec.getMessage()) for rec in logged]
    assert "hunter2" in "".join(logging.Formatter().formatException(logged[0].exc_info))


# -- 2. repeated credential headers -----------------------------------------------------------------
async def test_every_value_of_a_repeated_credential_header_is_checked(api):
    client, _, _ = api
    bare = httpx.AsyncClient(transport=client._transport, base_url=str(client.base_url))
    async with bare:
        for headers in (
            [("X-API-Key", KEY), ("X-API-Key", "wrong")],
            [("X-API-Key", "wrong"), ("X-API-Key", KEY)],
            [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")],
            [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
            [("Authorization", f"Bearer {KEY}"), ("Authorization", "Basic Zm9vOmJhcg==")],
            [("X-API-Key", KEY), ("Authorization", f"Bearer {KEY}"), ("X-API-Key", "")],
            [("X-API-Key", f"{KEY}, wrong")],  # what a proxy makes of two headers
        ):
            r = await bare.get("/stats", headers=headers)
            assert is_problem(r, 401), headers
            assert r.headers["www-authenticate"].startswith("Bearer")
        for headers in (
            [("X-API-Key", KEY), ("X-API-Key", KEY)],
            [("Authorization", f"Bearer {KEY}"), ("X-API-Key", KEY)],
            [("Authorization", f"bearer {KEY}")],  # the scheme is case-insensitive
        ):
            assert (await bare.get("/stats", headers=headers)).status_code == 200, headers


# -- 3. authentication before anything answers ---------------------------------------------------------
async def test_authentication_comes_before_routing_redirects_404_and_405(api):
    client, rt, _ = api
    bare = httpx.AsyncClient(transport=client._transport, base_url="http://test")
    async with bare:
        for method, path in [
            ("GET", f"{PREFIX}/stats/"),  # a trailing slash: was a 307 naming the client's Host
            ("GET", f"{PREFIX}/no-such-route"),
            ("DELETE", f"{PREFIX}/stats"),  # a wrong method
            ("PUT", f"{PREFIX}/messages"),
            ("PATCH", f"{PREFIX}/queues/emails/pause"),
            ("OPTIONS", f"{PREFIX}/stats"),
            ("HEAD", f"{PREFIX}/stats"),
            ("GET", "/"),
            ("GET", "/api/_system/other"),
            ("POST", f"{PREFIX}/messages/{uuid4()}/retry/"),
        ]:
            r = await bare.request(method, path, headers={"Host": "evil.example"})
            assert r.status_code == 401, (method, path, r.status_code)
            assert "location" not in r.headers
            if method != "HEAD":
                assert r.headers["content-type"] == PROBLEM
        # with the key: still no redirect, and 404/405 are problems too
        slash = await bare.get(f"{PREFIX}/stats/", headers={**AUTH, "Host": "evil.example"})
        assert is_problem(slash, 404)
        assert "location" not in slash.headers
        wrong_method = await bare.delete(f"{PREFIX}/stats", headers=AUTH)
        assert is_problem(wrong_method, 405)
        assert wrong_method.headers["allow"] == "GET"
    assert await rt.tracker.counts() == {}


# -- 4. no key: only this machine, never another site -------------------------------------------------
@pytest.fixture(scope="module")
def keyless_server(tmp_path_factory):
    """`queueing serve` as an operator runs it by default: no key, on loopback, the example app."""
    work = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {
        **os.environ,
        "QUEUEING_DATABASE_URL": f"sqlite:///{work}/q.db",
        "QUEUEING_APP": "queueing_core.examples.orders:app",
        "PYTHONPATH": ROOT,
    }
    env.pop("QUEUEING_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "queueing_core.cli", "serve", "--port", str(port)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}{PREFIX}"
    deadline = time.monotonic() + 90  # generous: a loaded machine starts slowly
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            httpx.get(f"{base}/health", timeout=5)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "queueing serve did not answer"
            time.sleep(0.1)
    yield port
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def paused(port: int) -> bool:
    stats = httpx.get(f"http://127.0.0.1:{port}{PREFIX}/stats", timeout=30).json()
    return next(q for q in stats["queues"] if q["queue"] == "order-placed")["paused"]


def test_without_a_key_requests_from_other_sites_are_refused(keyless_server):
    port = keyless_server
    local = f"http://127.0.0.1:{port}{PREFIX}"
    pause = f"{local}/queues/order-placed/pause"
    resume = f"{local}/queues/order-placed/resume"
    refused = [
        # the issue's own requests: a page of another site pausing a queue, a rebinding Host reading
        ("POST", pause, {"Origin": "http://evil.example", "Host": f"evil.example:{port}"}),
        ("GET", f"{local}/stats", {"Host": f"rebind.evil.example:{port}"}),
        # a foreign Origin with the right Host, and the simple (preflight-free) POSTs a form can send
        ("POST", pause, {"Origin": "http://evil.example"}),
        ("POST", pause, {"Origin": "null", "Content-Type": "application/json"}),
        ("POST", pause, {}),
        ("POST", pause, {"Content-Type": "text/plain"}),
        ("POST", pause, {"Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", pause, {"Content-Type": "multipart/form-data; boundary=x"}),
        ("POST", pause, {"Content-Type": "text/plain; application/json"}),
        ("POST", pause, {"Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"}),
        ("GET", f"{local}/stats", {"Sec-Fetch-Site": "same-site"}),
        ("GET", f"{local}/stats", {"Origin": f"http://localhost:{port + 1}"}),
        ("GET", f"{local}/stats", {"Host": "127.0.0.1"}),  # the right address, another port
        ("GET", f"{local}/stats", {"Host": f"127.0.0.1.nip.io:{port}"}),
    ]
    for method, url, headers in refused:
        r = httpx.request(method, url, headers=headers)
        assert is_problem(r, 403), (method, headers, r.status_code, r.text)
        assert not paused(port), (method, headers)
    # what a local tool sends is accepted: a JSON content type or X-Requested-With, any loopback name
    for headers in (
        {"Content-Type": "application/json"},
        {"X-Requested-With": "curl"},
        {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"},
        {"Content-Type": "application/json", "Host": f"localhost:{port}"},
        {"Content-Type": "application/json", "Host": f"[::1]:{port}", "Sec-Fetch-Site": "same-origin"},
    ):
        r = httpx.post(pause, headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)
        assert paused(port)
        assert httpx.post(resume, headers={"X-Requested-With": "t"}, timeout=30).status_code == 200
        assert not paused(port)


# -- 5. content types, echoes, batch errors ---------------------------------------------------------
async def test_wrong_content_types_get_415_and_errors_never_echo_the_body(api):
    client, rt, _ = api
    body = json.dumps({"to": "a@x.io", "subject": "s"})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/xml", None):
        headers = {"Content-Type": content_type} if content_type else {}
        r = await client.post("/queues/emails/messages", content=body, headers=headers)
        assert is_problem(r, 415), (content_type, r.status_code, r.text)
        assert "application/json" in r.json()["detail"]
    marker = "SECRET-MARKER-" + "x" * 200
    big = [{"to": marker, "subject": 5} for _ in range(900)]  # about 250 KB, every item invalid
    r = await client.post("/queues/emails/messages", json=big)
    assert is_problem(r, 422)
    assert marker not in r.text
    assert len(r.content) < 20_000, len(r.content)
    assert r.json()["error_count"] == 900
    assert await rt.tracker.counts() == {}


async def test_a_batch_over_the_limit_or_with_one_bad_element_is_described(api):
    client, rt, _ = api
    one = {"to": "a@x.io", "subject": "s"}
    too_many = await client.post("/queues/emails/messages", json=[one] * 1001)
    assert is_problem(too_many, 422)
    assert too_many.json()["detail"] == "body: List should have at most 1000 items after validation, not 1001"
    bad_element = await client.post("/queues/emails/messages", json=[one, one, 5, one])
    assert is_problem(bad_element, 422)
    assert bad_element.json()["detail"] == "body.2: Input should be a valid dictionary"
    empty = await client.post("/queues/emails/messages", json=[])
    assert empty.json()["detail"].startswith("body: List should have at least 1 item")
    scalar = await client.post("/queues/emails/messages", json="hello")
    assert scalar.json()["detail"] == "body: Input should be a JSON object or a list of 1 to 1000 objects"
    assert await rt.tracker.counts() == {}


async def test_text_no_store_can_hold_and_odd_base_fields_are_422_not_500(api):
    """Found by the property tests on PostgreSQL: jsonb refuses U+0000, and a JSON body can carry lone
    surrogates, times past the year 9999 and correlation ids no envelope accepts."""
    client, rt, _ = api
    for raw in (
        '{"to": "a\\u0000b", "subject": "s"}',
        '{"to": "\\ud800", "subject": "s"}',
        '[{"to": "a", "subject": "s"}, {"to": "b", "subject": "\\udfff"}]',
        '{"to": "a", "subject": "s", "correlation_id": "\\ud800"}',
        '{"to": "a", "subject": "s", "correlation_id": "%s"}' % ("c" * 300),
        '{"to": "a", "subject": "s", "created_at": "9999-12-31T23:00:00Z"}',
        '{"to": "a", "subject": "s", "created_at": "0001-01-01T00:00:00+14:00"}',
        '{"to": "a", "subject": "s", "properties": {"k": "\\u0000"}}',
    ):
        r = await client.post("/queues/emails/messages", content=raw, headers=JSON)
        assert is_problem(r, 422), (raw, r.status_code, r.text)
    assert await rt.tracker.counts() == {}
    fine = '{"to": "a\\\\u0000 is text", "subject": "s"}'
    r = await client.post("/queues/emails/messages", content=fine, headers=JSON)
    assert r.status_code == 201, r.text


# -- 6. destructive flags ------------------------------------------------------------------------------
async def test_destructive_flags_accept_exactly_true(api):
    client, rt, _ = api
    await client.post("/queues/emails/messages", json=[{"to": f"{i}@x.io", "subject": "s"} for i in range(3)])
    for value in ("yes", "1", "on", "True", "TRUE", "t", "y", ""):
        r = await client.delete("/messages", params={"all": value})
        assert is_problem(r, 422), (value, r.status_code)
        r = await client.delete("/messages", params={"queue": "emails", "archived": value})
        assert is_problem(r, 422), (value, r.status_code)
    r = await client.delete("/messages", params=[("all", "true"), ("all", "true")])  # repeated
    assert is_problem(r, 422)
    r = await client.delete("/messages", params={"queue": "emails", "stauts": "Pending"})  # a typo
    assert is_problem(r, 422)
    assert "stauts" in r.json()["detail"]
    assert sum((await rt.tracker.counts()).values()) == 3
    assert (await client.delete("/messages", params={"all": "true"})).json()["deleted"] == 3


# -- 7. due after expiry ------------------------------------------------------------------------------
@queue("short-lived", expiration=timedelta(hours=4))
class ShortLived(QueueMessage):
    n: int


async def test_an_enqueue_due_at_or_after_its_expiry_is_refused_naming_both(api):
    client, rt, _ = api
    rt.app.message(ShortLived)
    for delay in (86400, 4 * 3600):
        r = await client.post("/queues/short-lived/messages", params={"delay_seconds": delay}, json={"n": 1})
        assert is_problem(r, 422), (delay, r.status_code, r.text)
        assert r.json()["type"] == "urn:queueing-kit:problem:invalid-argument"
        assert "not_before" in r.json()["detail"]
        assert "expires_at" in r.json()["detail"]
    assert await rt.tracker.counts() == {}
    ok = await client.post("/queues/short-lived/messages", params={"delay_seconds": 3 * 3600}, json={"n": 1})
    assert ok.status_code == 201
    # the same rule for code: app.enqueue refuses it before writing anything
    with pytest.raises(InvalidArgument, match="expires_at"):
        await rt.app.enqueue(ShortLived(n=2), delay=timedelta(hours=5))
    assert sum((await rt.tracker.counts()).values()) == 1


# -- 8. no internal text as a 422, a blank key ------------------------------------------------------
async def test_internal_errors_are_500s_without_their_text_and_typed_errors_keep_their_status():
    app, _ = build_app()
    rt = Runtime(app, InProcessProvider())
    ops = Broken(rt)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(ops, api_key=KEY)),
        base_url="http://test" + PREFIX,
        headers=AUTH,
    )
    async with rt, client:
        ops.failure = ValueError("invalid literal for int() with base 10: 'internal detail'")
        r = await client.get("/stats")
        assert is_problem(r, 500)
        assert "internal detail" not in r.text
        ops.failure = ProviderUnavailable("could not connect to server at 10.1.2.3:5432")
        r = await client.get("/stats")
        assert is_problem(r, 503)
        assert "10.1.2.3" not in r.text
        assert r.headers["retry-after"]
        role = "Storage Table Data Contributor"
        ops.failure = MissingPermission(f"grant it '{role}' on the account", right="table data", role=role)
        r = await client.get("/stats")  # a deployment without a role: say which, as a problem
        assert is_problem(r, 503)
        assert role in r.json()["detail"]
        ops.failure = InvalidArgument("status", "'X' is not a status")
        r = await client.get("/stats")
        assert is_problem(r, 422)
        assert r.json()["detail"] == "status: 'X' is not a status"


def test_a_blank_api_key_refuses_to_start_with_one_line(tmp_path):
    port = free_port()
    env = {**os.environ, "QUEUEING_API_KEY": "   ", "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "queueing_core.cli", "serve", "--port", str(port)],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": ROOT},
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the server started with a blank key")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "QUEUEING_API_KEY" in lines[0]
    assert "blank" in lines[0]


# -- 9. status filters --------------------------------------------------------------------------------
async def test_unknown_status_filters_are_422_except_custom_ones_on_sql(api):
    client, rt, _ = api
    await client.post("/queues/emails/messages", json={"to": "a@x.io", "subject": "s"})
    listed = await client.get("/messages", params={"status": "Bogus"})
    assert listed.status_code == 200  # SQL: a custom status an operator may have set
    assert listed.json()["items"] == []
    purge = await client.delete("/messages", params={"status": "Bogus"})
    assert is_problem(purge, 422)  # nothing has it: most likely a misspelling
    assert "Bogus" in purge.json()["detail"]
    assert sum((await rt.tracker.counts()).values()) == 1


async def test_unknown_status_filters_are_422_on_providers_without_custom_statuses():
    app, _ = build_app()
    rt = Runtime(app, InProcessProvider())
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
        base_url="http://test" + PREFIX,
        headers=AUTH,
    )
    async with rt, client:
        await app.enqueue(Email(to="a@x.io", subject="s"))
        for params in ({"status": "Bogus"}, [("status", "Pending"), ("status", "Bogus")]):
            r = await client.get("/messages", params=params)
            assert is_problem(r, 422), params
            assert "Bogus" in r.json()["detail"]
            r = await client.delete("/messages", params=params)
            assert is_problem(r, 422), params
        assert (await client.get("/messages", params={"status": "Pending"})).json()["items"]
        assert (await client.get("/messages", params={"status": "Archived"})).status_code == 200
        assert len(rt.tracker) == 1


# -- 10. malformed messages keep their id: tests/contract/test_contract.py::
#        test_a_malformed_message_is_listed_under_the_id_its_json_carried (every provider)
