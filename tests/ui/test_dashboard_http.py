"""The dashboard's rules over plain HTTP (no browser): sessions, anti-forgery, hostile input."""

from __future__ import annotations

import html
import re
from urllib.parse import urlencode
from uuid import UUID

import httpx
import pytest

from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.ops.ui import charts
from queueing_core.ops.ui.session import LIFETIME, Sessions
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.ui.app import ChargeCard, app

KEY = "http-test-key-not-a-secret"
UI = PREFIX + "/ui"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture
async def runtime(tmp_path):
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    await rt.open()
    yield rt
    await rt.close()


def client(rt: Runtime, key: str | None = KEY) -> httpx.AsyncClient:
    api = create_app(OpsService(rt), api_key=key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test")


async def signed_in(c: httpx.AsyncClient) -> str:
    """Sign in; the page's anti-forgery token."""
    r = await c.post(f"{UI}/sign-in", content=f"key={KEY}", headers=FORM)
    assert r.status_code == 303
    page = await c.get(f"{UI}/")
    return re.search(r'"X-CSRF-Token": "([^"]+)"', page.text).group(1)


def run_form(confirmation: str) -> str:
    """The form the confirmation's button sends, as a browser sends it: its hidden fields."""
    fields = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirmation)
    assert ("step", "run") in fields, confirmation
    return urlencode([(k, html.unescape(v)) for k, v in fields])


def test_a_session_is_signed_dated_and_tied_to_the_key():
    now = [1_000_000.0]
    sessions = Sessions("k", clock=lambda: now[0])
    token = sessions.issue()
    assert sessions.valid(token)
    assert "k" not in token.split(".")[0]
    assert not Sessions("other", clock=lambda: now[0]).valid(token)  # a new key signs everyone out
    issued, nonce, signature = token.split(".")
    assert not sessions.valid(f"{int(issued) + 3600}.{nonce}.{signature}")  # a later date is forged
    assert not sessions.valid(f"{issued}.{nonce}.{signature[:-2]}xx")
    assert not sessions.valid("x" * 5000)
    assert sessions.csrf(token) != sessions.csrf(sessions.issue())
    now[0] += LIFETIME
    assert not sessions.valid(token)


def test_charts_say_in_words_what_they_draw():
    svg = charts.bars([1, 2, 0], [0, 1, 0], 'three <b>"quoted"</b>')
    assert 'aria-label="three &lt;b&gt;&#34;quoted&#34;&lt;/b&gt;"' in svg
    assert svg.count('class="ok"') == 2
    assert svg.count('class="bad"') == 1
    line = charts.line([None, 1.0, 2.0, None, 3.0], "latency")
    assert line.count("<polyline") == 1
    assert line.count("<circle") == 1


async def test_sign_in_sets_a_strict_http_only_cookie_and_goes_back_only_within_the_app(runtime):
    async with client(runtime) as c:
        for given, expected in [
            (f"{UI}/messages?status=DeadLettered", f"{UI}/messages?status=DeadLettered"),
            ("//evil.example/", f"{UI}/"),
            ("https://evil.example/", f"{UI}/"),
            (f"{PREFIX}//evil.example", f"{UI}/"),
            ("/elsewhere", f"{UI}/"),
            (f"{UI}/\\evil", f"{UI}/"),
        ]:
            r = await c.post(
                f"{UI}/sign-in", content=httpx.QueryParams(key=KEY, next=given).__str__(), headers=FORM
            )
            assert r.status_code == 303
            assert r.headers["location"] == expected
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie
        assert f"Path={PREFIX}" in cookie
        assert KEY not in cookie


async def test_hostile_sign_in_attempts_are_refused_without_a_session(runtime):
    async with client(runtime) as c:
        attempts = [
            ({"content": "key=wrong", "headers": FORM}, 401),
            ({"content": "key=" + "k" * 5000, "headers": FORM}, 401),
            ({"json": {"key": KEY}}, 400),
            ({"content": f"key={KEY}", "headers": {**FORM, "Origin": "http://evil.example"}}, 403),
            ({"content": f"key={KEY}", "headers": {**FORM, "Sec-Fetch-Site": "cross-site"}}, 403),
            # a page of another site, whatever Origin it claims
            (
                {
                    "content": f"key={KEY}",
                    "headers": {**FORM, "Sec-Fetch-Site": "cross-site", "Origin": "http://test"},
                },
                403,
            ),
            (
                {
                    "content": f"key={KEY}",
                    "headers": {**FORM, "Sec-Fetch-Site": "same-site", "Origin": "http://evil.test"},
                },
                403,
            ),
            ({"content": b"key=\xff\xfe", "headers": FORM}, 400),
        ]
        for kwargs, status in attempts:
            r = await c.post(f"{UI}/sign-in", **kwargs)
            assert r.status_code == status, kwargs
            assert "set-cookie" not in r.headers
            assert "text/html" in r.headers["content-type"]


async def test_sign_in_through_a_gateway_that_forwards_under_the_apps_own_host_name(runtime):
    """API Management (and Front Door by default) forward to the Function app under its own host name:
    the browser's Origin is the gateway's, and the form's POST was refused as cross-site although the
    browser said same-origin (review). ``Sec-Fetch-Site`` decides where the browser sends it."""
    behind = {"Host": "func-x.azurewebsites.net", "Origin": "https://gw.example"}
    async with client(runtime) as c:
        r = await c.post(
            f"{UI}/sign-in", content=f"key={KEY}", headers={**FORM, **behind, "Sec-Fetch-Site": "same-origin"}
        )
        assert r.status_code == 303, r.text
        assert "set-cookie" in r.headers
        # a browser that sends no Sec-Fetch-Site: its Origin must be the host it addressed
        r = await c.post(f"{UI}/sign-in", content=f"key={KEY}", headers={**FORM, **behind})
        assert r.status_code == 403


async def test_the_session_opens_the_api_and_changes_need_the_anti_forgery_token(runtime):
    async with client(runtime) as c:
        assert (await c.get(f"{PREFIX}/stats")).status_code == 401
        csrf = await signed_in(c)
        assert (await c.get(f"{PREFIX}/stats")).status_code == 200
        pause = f"{PREFIX}/queues/ui-orders/pause"
        assert (await c.post(pause)).status_code == 401
        # (another first character: a token that began with "x" was sent unchanged, 1 time in 64)
        wrong = ("y" if csrf[0] == "x" else "x") + csrf[1:]
        assert (await c.post(pause, headers={"X-CSRF-Token": wrong})).status_code == 401
        twice = [("X-CSRF-Token", csrf), ("X-CSRF-Token", csrf)]
        assert (await c.post(pause, headers=twice)).status_code == 401
        other = client(runtime)
        async with other:
            stranger = await signed_in(other)  # another browser's token does not fit this session
        assert (await c.post(pause, headers={"X-CSRF-Token": stranger})).status_code == 401
        assert not (await runtime.control.state()).paused_queues
        r = await c.post(pause, headers={"X-CSRF-Token": csrf})
        assert r.status_code == 200
        assert "ui-orders" in (await runtime.control.state()).paused_queues
        # two session cookies at once: refused, whichever is good
        token = c.cookies["queueing_session"]
        both = {"Cookie": f"queueing_session={token}; queueing_session=x"}
        r = await c.get(f"{PREFIX}/stats", headers=both)
        assert r.status_code == 401


async def test_pages_send_the_browser_to_sign_in_and_fragments_say_so_to_htmx(runtime):
    async with client(runtime) as c:
        r = await c.get(f"{UI}/messages?status=DeadLettered")
        assert r.status_code == 303
        back = "%2Fapi%2F_system%2Fqueueing%2Fui%2Fmessages%3Fstatus%3DDeadLettered"
        assert r.headers["location"] == f"{UI}/sign-in?next={back}"
        r = await c.get(
            f"{UI}/overview", headers={"HX-Request": "true", "HX-Current-URL": f"http://test{UI}/messages"}
        )
        assert r.status_code == 401
        assert r.headers["hx-redirect"] == f"{UI}/sign-in?next=%2Fapi%2F_system%2Fqueueing%2Fui%2Fmessages"
        # the API keeps its problem details
        r = await c.get(f"{PREFIX}/stats")
        assert r.headers["content-type"] == "application/problem+json"
        # `/` sends on whoever may see the pages (the session cookie lives under the API's path)
        assert (await c.get("/")).status_code == 401
        key = {"X-API-Key": KEY}
        assert (await c.get("/", headers=key)).headers["location"] == f"{UI}/"
        assert (await c.get("/docs", headers=key)).headers["location"] == f"{PREFIX}/docs"


async def test_what_a_page_echoes_is_escaped_and_bad_filters_are_named(runtime):
    async with client(runtime) as c:
        await signed_in(c)
        r = await c.get(f"{UI}/messages", params={"correlation_id": "<script>alert(1)</script>"})
        assert r.status_code == 200
        assert "<script>alert" not in r.text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert r.headers["x-frame-options"] == "DENY"
        for params, named in [
            ({"queue": "<b>"}, "queue"),
            ({"status": "Dead Lettered"}, "status"),
            ({"created_from": "1700000000"}, "created_from"),
            ({"stauts": "Pending"}, "stauts: unknown parameter"),
            ({"cursor": "bm90LWEtY3Vyc29y"}, "cursor"),
        ]:
            r = await c.get(f"{UI}/messages", params=params)
            assert r.status_code == 422, params
            assert named in r.text
            assert "<b>" not in r.text


async def test_bulk_actions_state_the_count_and_act_only_on_that_count(runtime):
    await runtime.producer.enqueue_many([ChargeCard(order_id=f"o{i}", amount_cents=1) for i in range(3)])
    async with client(runtime) as c:
        csrf = await signed_in(c)
        headers = {**FORM, "X-CSRF-Token": csrf, "HX-Request": "true"}
        r = await c.post(f"{UI}/bulk", content="action=purge&step=confirm", headers=headers)
        assert "choose at least one filter before purging" in r.text
        r = await c.post(f"{UI}/bulk", content="action=purge&step=confirm&queue=ui-orders", headers=headers)
        assert "Delete <strong>3</strong> message(s)" in r.text
        # the selection grew since the confirmation: asked again, nothing deleted
        await runtime.producer.enqueue(ChargeCard(order_id="late", amount_cents=1))
        r = await c.post(f"{UI}/bulk", content=run_form(r.text), headers=headers)
        assert "The selection changed since you confirmed" in r.text
        assert "3 message(s) then, 4 now; nothing was done." in r.text
        assert "Delete <strong>4</strong> message(s)" in r.text
        assert sum((await runtime.tracker.counts()).values()) == 4
        r = await c.post(f"{UI}/bulk", content=run_form(r.text), headers=headers)
        assert "Deleted 4 message(s)" in r.text
        assert sum((await runtime.tracker.counts()).values()) == 0
        r = await c.post(f"{UI}/bulk", content="action=drop&step=run&queue=ui-orders", headers=headers)
        assert r.status_code == 422


async def test_a_bulk_action_acts_only_on_the_messages_confirmed_not_on_as_many_others(runtime):
    """The run checked only the count: the dead letter the operator confirmed (A) was archived by a
    colleague, another (B) came in, the count stayed 1, and the run deleted B, which the operator
    never saw (a review found it). A selection that is not the same messages, in the same states, is
    refused and confirmed again."""
    a, b = await runtime.producer.enqueue_many([ChargeCard(order_id=o, amount_cents=1) for o in "ab"])
    await runtime.app.cancel(a.tracking_id)  # finished (no worker): listed, archivable
    ops = OpsService(runtime)
    selection = "queue=ui-orders&status=Cancelled&archived=false"
    async with client(runtime) as c:
        csrf = await signed_in(c)
        headers = {**FORM, "X-CSRF-Token": csrf, "HX-Request": "true"}
        confirm = await c.post(
            f"{UI}/bulk", content=f"action=purge&step=confirm&{selection}", headers=headers
        )
        assert "Delete <strong>1</strong> message(s)" in confirm.text
        await ops.archive(a.message_id)  # meanwhile, A leaves the selection and B enters it
        await runtime.app.cancel(b.tracking_id)
        r = await c.post(f"{UI}/bulk", content=run_form(confirm.text), headers=headers)
        assert r.status_code == 200, r.text
        assert "The selection changed since you confirmed" in r.text
        assert "still 1 message(s), but not the same ones" in r.text
        assert 'id="bulk-done"' not in r.text
        assert await runtime.tracker.get(a.message_id) is not None
        assert await runtime.tracker.get(b.message_id) is not None
        # confirmed again, the run deletes B, the one now stated, and nothing else
        r = await c.post(f"{UI}/bulk", content=run_form(r.text), headers=headers)
        assert "Deleted 1 message(s)" in r.text
        assert await runtime.tracker.get(b.message_id) is None
        assert (await runtime.tracker.get(a.message_id)).archived

        # the same messages in another state are not what was confirmed either: a retry of the
        # queue's messages confirmed while C waited, run after C was cancelled
        [c_] = await runtime.producer.enqueue_many([ChargeCard(order_id="c", amount_cents=1)])
        confirm = await c.post(
            f"{UI}/bulk", content="action=retry&step=confirm&queue=ui-orders&archived=false", headers=headers
        )
        assert "Retry <strong>1</strong> message(s)" in confirm.text
        await runtime.app.cancel(c_.tracking_id)
        r = await c.post(f"{UI}/bulk", content=run_form(confirm.text), headers=headers)
        assert "still 1 message(s), but not the same ones or not in the same state" in r.text
        assert (await runtime.tracker.get(c_.message_id)).status == "Cancelled"
        # a run without the confirmation's digest (a form from before it carried one) is not run
        r = await c.post(
            f"{UI}/bulk",
            content="action=retry&step=run&expected=1&queue=ui-orders&archived=false",
            headers=headers,
        )
        assert "The selection changed since you confirmed" in r.text
        assert (await runtime.tracker.get(c_.message_id)).status == "Cancelled"


async def test_message_actions_name_the_refusal_and_unknown_ones_are_not_found(runtime):
    [receipt] = await runtime.producer.enqueue_many([ChargeCard(order_id="o", amount_cents=1)])
    async with client(runtime) as c:
        csrf = await signed_in(c)
        headers = {"X-CSRF-Token": csrf, "HX-Request": "true"}
        r = await c.post(f"{UI}/messages/{receipt.message_id}/archive", headers=headers)
        assert "cannot archive message" in r.text
        assert "only finished messages can be archived" in r.text
        r = await c.post(f"{UI}/messages/{receipt.message_id}/explode", headers=headers)
        assert r.status_code == 404
        assert (await c.get(f"{UI}/messages/not-a-uuid")).status_code == 404
        assert (await c.get(f"{UI}/messages/{UUID(int=1)}")).status_code == 404


async def test_with_no_key_and_not_on_loopback_everything_is_refused(runtime):
    async with client(runtime, key=None) as c:
        page = await c.get(f"{UI}/sign-in")
        assert "has no API key configured" in page.text
        assert (await c.post(f"{UI}/sign-in", content="key=", headers=FORM)).status_code == 409
        r = await c.get(f"{UI}/")
        assert r.status_code == 303
        assert r.headers["location"].startswith(f"{UI}/sign-in")


async def test_a_running_message_shows_its_progress_and_can_be_cancelled_from_its_page(tmp_path):
    from datetime import timedelta

    from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
    from tests.contract.harness import running, wait_until

    @queue("ui-exports", cancel_grace=timedelta(seconds=5))
    class Export(QueueMessage):
        rows: int

    jobs = QueueingApp("ui-progress")
    stopped: list[int] = []

    @jobs.handler()
    async def export(msg: Export, ctx) -> None:
        await ctx.report_progress(2, msg.rows, "row 2")
        await ctx.cancelled.wait()  # runs until an operator cancels it
        stopped.append(msg.rows)

    rt = Runtime(jobs, SqlProvider(f"sqlite:///{tmp_path}/p.db"))
    await rt.open()
    try:
        receipt = await rt.producer.enqueue(Export(rows=5))
        async with running(rt), client(rt) as c:
            csrf = await signed_in(c)
            page = f"{UI}/messages/{receipt.message_id}"

            async def shows_progress() -> bool:
                return 'id="progress"' in (await c.get(page)).text

            await wait_until(shows_progress, what="the progress on the message's page")
            detail = (await c.get(page)).text
            assert "2 of 5" in detail
            assert "row 2" in detail
            assert 'id="act-cancel"' in detail
            r = await c.post(f"{page}/cancel", headers={"X-CSRF-Token": csrf, "HX-Request": "true"})
            assert r.status_code == 200
            await wait_until(lambda: stopped == [5], what="the handler told to stop")

            async def cancelled() -> bool:
                got = await rt.tracker.get(receipt.message_id)
                return got is not None and got.status == MessageStatus.CANCELLED

            await wait_until(cancelled, what="the message recorded Cancelled")
            # finished now: a second cancel is refused with the reason, on the page
            r = await c.post(f"{page}/cancel", headers={"X-CSRF-Token": csrf, "HX-Request": "true"})
            assert 'role="alert"' in r.text
    finally:
        await rt.close()


async def test_a_bulk_retry_the_store_stops_part_way_says_how_far_it_got(runtime, monkeypatch):
    """The store went away at the third of four retries: the page said only "503" and the operator
    could not tell that two had been retried (a review found it). It now says so, and how many were
    not tried."""
    from queueing_core.errors import ProviderUnavailable
    from queueing_core.ops.service import OpsService

    receipts = await runtime.producer.enqueue_many(
        [ChargeCard(order_id=f"r{i}", amount_cents=1) for i in range(4)]
    )
    for r in receipts:
        await runtime.app.cancel(r.tracking_id)  # no worker: Cancelled, retryable
    real_retry = OpsService.retry
    calls: list[int] = []

    async def store_goes_away(self, message_id):
        calls.append(1)
        if len(calls) == 3:
            raise ProviderUnavailable("database: connection refused")
        return await real_retry(self, message_id)

    monkeypatch.setattr(OpsService, "retry", store_goes_away)
    async with client(runtime) as c:
        csrf = await signed_in(c)
        headers = {**FORM, "X-CSRF-Token": csrf, "HX-Request": "true"}
        form = "action=retry&step=confirm&queue=ui-orders&status=Cancelled"
        confirm = await c.post(f"{UI}/bulk", content=form, headers=headers)
        r = await c.post(f"{UI}/bulk", content=run_form(confirm.text), headers=headers)
        assert r.status_code == 200, r.text
        assert "Retried 2 message(s); stopped with 2 not tried" in r.text
        assert "run it again for the rest" in r.text
    statuses = [(await runtime.tracker.get(x.message_id)).status for x in receipts]
    assert sorted(statuses) == ["Cancelled", "Cancelled", "Pending", "Pending"]


async def test_a_queue_whose_name_holds_a_slash_is_paused_and_enqueued_to_from_its_buttons(tmp_path):
    """The overview's buttons and the enqueue page post to '/queues/<name>/pause' and
    '/enqueue/<name>' with the name's '/' as it is: they reached no route (a review found it)."""
    from queueing_core import QueueingApp, QueueMessage, queue

    @queue("billing/invoices")
    class InvoiceDue(QueueMessage):
        invoice: str

    slashed = QueueingApp("ui-slashes")

    @slashed.handler()
    async def due(msg: InvoiceDue) -> None: ...

    rt = Runtime(slashed, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
    await rt.open()
    try:
        await rt.producer.enqueue(InvoiceDue(invoice="i-0"))
        async with client(rt) as c:
            csrf = await signed_in(c)
            headers = {"X-CSRF-Token": csrf, "HX-Request": "true"}
            overview = (await c.get(f"{UI}/overview", headers=headers)).text
            pause = re.search(r'hx-post="([^"]+/queues/[^"]+/pause)"', overview).group(1)
            assert pause.endswith("/queues/billing/invoices/pause")
            r = await c.post(pause, headers=headers)
            assert r.status_code == 200, r.text
            assert "Resume queue" in r.text
            assert "billing/invoices" in (await rt.control.state()).paused_queues
            page = await c.get(f"{UI}/enqueue/billing/invoices")
            assert page.status_code == 200, page.text
    finally:
        await rt.close()
