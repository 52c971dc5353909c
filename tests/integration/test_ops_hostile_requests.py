"""Hostile requests to the ops API and its dashboard: a malformed htmx header and a query string that
is not UTF-8 get a sign-in or a 400, never a 500; sign-in goes back only within the app; attacker-
controlled fields are escaped wherever the dashboard shows them; no route, method or spelling of a path
answers without a credential."""

from __future__ import annotations

import re
from typing import Any
from uuid import uuid4

import httpx
import pytest
import sqlalchemy as sa

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.ui.app import ChargeCard, app

KEY = "review-test-key-not-a-secret"
UI = PREFIX + "/ui"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
PROBLEM = "application/problem+json"


@pytest.fixture
async def runtime(tmp_path):
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    await rt.open()
    yield rt
    await rt.close()


def client(rt: Runtime, key: str | None = KEY) -> httpx.AsyncClient:
    api = create_app(OpsService(rt), api_key=key)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api, raise_app_exceptions=False), base_url="http://test"
    )


async def signed_in(c: httpx.AsyncClient) -> str:
    """Sign in; the page's anti-forgery token."""
    r = await c.post(f"{UI}/sign-in", content=f"key={KEY}", headers=FORM)
    assert r.status_code == 303
    page = await c.get(f"{UI}/")
    found = re.search(r'"X-CSRF-Token": "([^"]+)"', page.text)
    assert found is not None
    return found.group(1)


async def raw_call(
    api: Any, method: str, path: str, query: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = ()
) -> tuple[int, dict[str, str], bytes]:
    """One request straight into the ASGI app: bytes no HTTP client would send (a lenient server's
    parser, such as httptools, passes a query string's raw bytes on as they came)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"test"), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    await api(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    head = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
    return (
        start["status"],
        head,
        b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"),
    )


# -- 5xx: a malformed HX-Current-URL, before authentication ------------------------------------------
async def test_a_malformed_hx_current_url_is_a_sign_in_not_a_500(runtime):
    """Unauthenticated: an htmx request for a fragment is sent to sign in, back to the page it names
    in HX-Current-URL. `urlsplit` raises ValueError on `http://[`, which became a logged 500."""
    async with client(runtime) as c:
        for current in ["http://[", "http://[::1/x", "http://[not-an-ip]/", "http://a]b/"]:
            r = await c.get(f"{UI}/overview", headers={"HX-Request": "true", "HX-Current-URL": current})
            assert r.status_code == 401, (current, r.status_code, r.text[:200])
            assert r.headers["hx-redirect"] == f"{UI}/sign-in", current


# -- 5xx: a query string that is not UTF-8 -----------------------------------------------------------
async def test_a_query_string_that_is_not_utf8_is_refused_first_then_a_400_never_a_500(runtime):
    """Starlette's `request.url` decodes the query string as UTF-8: the Guard's sign-in redirect (for
    anyone, unauthenticated), the error handlers' `instance` and the pages all read it, so raw bytes
    from a lenient parser were a 500 on every path. Unauthenticated they are refused as before;
    authenticated they are a 400 problem."""
    api = create_app(OpsService(runtime), api_key=KEY)
    key = ((b"x-api-key", KEY.encode()),)
    for path, headers, status in [
        (f"{PREFIX}/stats", (), 401),
        (f"{UI}/", (), 303),  # a page: sent to sign in (without a `next` it cannot carry)
        (f"{UI}/sign-in", (), 400),  # public: no credential to check first
        (f"{PREFIX}/stats", key, 400),
        (f"{PREFIX}/messages", key, 400),
        (f"{PREFIX}/no-such-route", key, 400),
        (f"{UI}/messages", key, 400),
    ]:
        code, head, body = await raw_call(api, "GET", path, b"queue=\xff", headers)
        assert code == status, (path, code, body[:200])
        if status == 303:
            assert head["location"] == f"{UI}/sign-in"
        else:
            assert head["content-type"] == PROBLEM, (path, head)
    code, _, body = await raw_call(
        api, "POST", f"{UI}/sign-in", b"\xff", (*key, (b"content-type", FORM["Content-Type"].encode()))
    )
    assert code == 400, body[:200]
    # a UTF-8 query string (the one a browser sends) is unchanged
    code, _, _ = await raw_call(api, "GET", f"{PREFIX}/stats", "x=é".encode(), key)
    assert code == 422  # an unknown parameter, named


# -- cosmetic: sign-in's `next` left the app by dot segments ----------------------------------------
async def test_sign_in_goes_back_only_within_the_app_even_through_dot_segments(runtime):
    """`next` must be a path of this app; `<prefix>/../../elsewhere` passed the check and the browser
    resolves it to `/elsewhere` (the same origin: not an open redirect, but not the app either)."""
    async with client(runtime) as c:
        for given in [
            f"{PREFIX}/../../elsewhere",
            f"{PREFIX}/./../x",
            f"{UI}/..",
            f"{PREFIX}/%2e%2e/%2E%2E/elsewhere",
            f"{PREFIX}/.%2e/x?next=y",
        ]:
            body = str(httpx.QueryParams(key=KEY, next=given))
            r = await c.post(f"{UI}/sign-in", content=body, headers=FORM)
            assert r.status_code == 303
            assert r.headers["location"] == f"{UI}/", given
        r = await c.get(f"{UI}/sign-in", params={"next": f"{PREFIX}/../../x"})
        assert f'value="{UI}/"' in r.text
        # dots inside a name are fine
        body = str(httpx.QueryParams(key=KEY, next=f"{UI}/messages?queue=a.b"))
        r = await c.post(f"{UI}/sign-in", content=body, headers=FORM)
        assert r.headers["location"] == f"{UI}/messages?queue=a.b"


# -- sweeps that found nothing -----------------------------------------------------------------------
HOSTILE = "\"'><x-evil onmouseover=alert(1)>{{7*7}}</textarea></pre><script>x</script>"


async def test_attacker_controlled_fields_are_escaped_wherever_the_dashboard_shows_them(runtime):
    """Every text a message's sender or handler controls, stored as-is, on every page that shows it."""
    receipts = await runtime.producer.enqueue_many(
        [ChargeCard(order_id=HOSTILE, amount_cents=1), ChargeCard(order_id="other", amount_cents=2)]
    )
    p = runtime.provider
    assert isinstance(p, SqlProvider)
    m = p.tables.messages
    async with p.engine.begin() as conn:
        await conn.execute(
            sa.update(m)
            .where(m.c.message_id == receipts[0].message_id)
            .values(
                status="DeadLettered",
                correlation_id=HOSTILE[:200],
                last_error=HOSTILE,
                description=HOSTILE + " (description)",
                reason=HOSTILE[:120],
                locked_by=HOSTILE[:120],
                headers={HOSTILE: HOSTILE},
                result={"r": HOSTILE},
                progress={"step": 1, "total": 2, "text": HOSTILE},
            )
        )
        # a queue this app does not register (another app's, or a name written from outside)
        await conn.execute(
            sa.update(m).where(m.c.message_id == receipts[1].message_id).values(queue=HOSTILE[:190])
        )
    async with client(runtime) as c:
        await signed_in(c)
        pages = [
            await c.get(f"{UI}/"),
            await c.get(f"{UI}/overview"),
            await c.get(f"{UI}/messages"),
            await c.get(f"{UI}/messages", params={"status": "DeadLettered"}),
            await c.get(f"{UI}/messages/{receipts[0].message_id}"),
            await c.get(f"{UI}/messages/{receipts[1].message_id}"),
            await c.get(f"{UI}/messages", params={"correlation_id": HOSTILE[:200]}),
            await c.get(f"{UI}/sign-in", params={"next": HOSTILE}),
            await c.get(f"{UI}/messages/{HOSTILE}"),
        ]
        for r in pages:
            assert r.status_code in (200, 404, 422), (r.url, r.status_code)
            if r.headers["content-type"] == PROBLEM:  # the path echoed in `instance`: JSON, never sniffed
                assert r.headers["x-content-type-options"] == "nosniff", r.url
                continue
            assert r.headers["content-type"].startswith("text/html"), r.url
            assert "<x-evil" not in r.text, r.url
            assert "<script>x" not in r.text, r.url
            assert "</textarea></pre>" not in r.text, r.url
        detail = pages[4].text
        assert "&lt;x-evil onmouseover=alert(1)&gt;" in detail  # shown, as text
        assert detail.count("&lt;x-evil") >= 6  # body, error, description, reason, header, result...
        metrics = await c.get(f"{PREFIX}/metrics")
        assert metrics.status_code == 200
        for line in metrics.text.splitlines():  # a label value cannot end its line or its quotes
            assert (
                not line
                or line.startswith("#")
                or re.fullmatch(r"[a-z_]+\{.*\} [-+0-9.eE]+|[a-z_]+ .*", line)
            )


async def test_no_dashboard_route_or_variant_answers_without_a_credential(runtime):
    """Every dashboard route, by every method and by the spellings a router might treat alike, is
    refused (401, or a redirect to sign in) without the key or a session; the static files and the
    sign-in page are the only public paths, and traversal out of them is not found."""
    mid = uuid4()
    paths = [
        "/",
        "/docs",
        f"{PREFIX}/docs",
        f"{PREFIX}/openapi.json",
        f"{PREFIX}/metrics",
        f"{PREFIX}/health",
        f"{UI}/",
        f"{UI}/overview",
        f"{UI}/messages",
        f"{UI}/messages/{mid}",
        f"{UI}/messages/{mid}/retry",
        f"{UI}/bulk",
        f"{UI}/enqueue",
        f"{UI}/enqueue/ui-orders",
        f"{UI}/queues/ui-orders/pause",
        f"{UI}/types/ChargeCard/pause",
        f"{UI}/types/ChargeCard/circuit/reset",
        f"{UI}/sign-out",
        f"{UI}/swagger/index.html",
        f"{UI}/swagger/oauth2-redirect.html",
        f"{UI}/static",
        f"{UI}/static/../overview",
        f"{UI}/static/%2e%2e/overview",
        f"{UI}/static/..%2foverview",
    ]
    variants = [
        lambda p: p,
        lambda p: p + "/",
        lambda p: p.upper(),
        lambda p: p.replace("/ui/", "/UI/"),
        lambda p: p.replace("/ui", "/%75i"),
        lambda p: p.replace("_system", "%5fsystem"),
        lambda p: "/" + p,
    ]
    async with client(runtime) as c:
        for path in paths:
            for variant in variants:
                target = variant(path)
                for method in ["GET", "HEAD", "OPTIONS", "POST", "PUT", "DELETE", "PATCH"]:
                    r = await c.request(method, target)
                    assert r.status_code in (401, 303, 404, 405), (method, target, r.status_code)
                    if r.status_code == 303:
                        assert r.headers["location"].startswith(f"{UI}/sign-in"), (method, target)
                    if r.status_code in (404, 405):  # only the public static files (traversal out of them)
                        assert "/static/" in target, (method, target, r.status_code)
        assert (await c.get(f"{UI}/static/ui.css")).status_code == 200
        assert (await c.get(f"{UI}/sign-in")).status_code == 200
    assert not (await runtime.control.state()).paused_queues
