"""The dashboard in a real Chromium against a real `queueing serve`: what an operator does at 3 a.m.,
and the same things refused to a browser that has not signed in."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.ui.conftest import PREFIX, ROOT, Served, sign_in

pytestmark = pytest.mark.slow


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def card(page, queue: str):
    return page.locator(f"section.card[data-queue='{queue}']")


def dead_letters(server: Served, n: int) -> list[str]:
    server.broken.touch()
    ids = server.enqueue("ui-orders", [{"order_id": f"ord-{i}", "amount_cents": 100 + i} for i in range(n)])
    wait_for(lambda: server.counts("ui-orders").get("DeadLettered") == n, f"{n} dead letters")
    return ids


def test_counts_change_live_as_the_worker_processes_messages(server: Served, page):
    sign_in(page, server)
    orders = card(page, "ui-orders")
    expect(orders).to_contain_text("no messages")
    page.evaluate("window.stillTheSamePage = true")
    server.enqueue("ui-orders", [{"order_id": f"ord-{i}", "amount_cents": 1} for i in range(12)])
    # the poll replaces the cards every few seconds: the count arrives without a reload
    expect(orders.locator("[data-status='Succeeded'] .n")).to_have_text("12", timeout=60_000)
    expect(orders).to_contain_text("12 succeeded, 0 ended otherwise in the last hour")
    assert page.evaluate("window.stillTheSamePage") is True


def test_find_inspect_and_bulk_retry_dead_letters(server: Served, page):
    dead_letters(server, 3)
    server.enqueue("ui-reports", [{"name": "daily"}])
    sign_in(page, server)
    orders = card(page, "ui-orders")
    expect(orders.locator(".badge.health")).to_have_text("Unhealthy")
    orders.get_by_role("link", name="Dead letters (3)").click()
    expect(page).to_have_url(re.compile(r"/ui/messages\?queue=ui-orders&status=DeadLettered&archived=false$"))
    rows = page.locator("table.messages tbody tr")
    expect(rows).to_have_count(3)

    # the filter form: every status but DeadLettered off, any queue
    page.goto(f"{server.ui}messages")
    expect(rows).to_have_count(4)
    page.get_by_role("checkbox", name="DeadLettered").check()
    page.get_by_role("button", name="Apply filters").click()
    expect(page).to_have_url(re.compile(r"status=DeadLettered"))
    expect(rows).to_have_count(3)
    expect(page.locator("table.messages tbody .badge")).to_have_text(["DeadLettered"] * 3)

    rows.first.get_by_role("link").click()
    expect(page.locator("#last-error")).to_contain_text("payment gateway refused order")
    expect(page.locator("#body")).to_contain_text('"amount_cents"')
    expect(page.locator("#status")).to_have_text("DeadLettered")
    page.go_back()

    server.broken.unlink()  # the gateway is fixed: a retry now succeeds
    page.get_by_role("button", name="Retry all…").click()
    expect(page.locator("#confirm-text")).to_contain_text("Retry 3 message(s)")
    page.get_by_role("button", name="Retry 3 message(s)").click()
    expect(page.locator("#bulk-done")).to_have_text("Retried 3 message(s).")
    wait_for(lambda: server.counts("ui-orders").get("Succeeded") == 3, "the retried messages to succeed")
    page.goto(server.ui)
    expect(card(page, "ui-orders").locator("[data-status='Succeeded'] .n")).to_have_text("3")
    expect(card(page, "ui-orders").locator(".badge.health")).to_have_text("Healthy")


def test_retry_one_message_from_its_page(server: Served, page):
    [mid] = dead_letters(server, 1)
    server.broken.unlink()
    sign_in(page, server)
    page.goto(f"{server.ui}messages/{mid}")
    page.get_by_role("button", name="Retry").click()
    expect(page.locator("#action-result")).to_contain_text("retry scheduled with fresh attempts")
    wait_for(lambda: server.counts("ui-orders").get("Succeeded") == 1, "the retried message to succeed")
    page.get_by_role("button", name="Refresh").click()
    expect(page.locator("#status")).to_have_text("Succeeded")
    page.get_by_role("button", name="Retry").click()  # the service's refusal, shown as the API says it
    expect(page.locator("#action-result")).to_contain_text("it already succeeded")


def test_pausing_a_queue_stops_processing_until_resumed(server: Served, page):
    sign_in(page, server)
    orders = card(page, "ui-orders")
    orders.get_by_role("button", name="Pause queue").click()
    expect(orders.locator(".badge.paused")).to_have_text("queue paused")
    expect(page.locator("#overview .flash")).to_have_text("Queue ui-orders paused")
    server.enqueue("ui-orders", [{"order_id": "held", "amount_cents": 1}] * 3)
    server.enqueue("ui-reports", [{"name": "still-running"}])
    wait_for(lambda: server.counts("ui-reports").get("Succeeded") == 1, "the other queue to keep working")
    time.sleep(2)  # the worker polls at most every 0.5 s: it had every chance to take them
    assert server.counts("ui-orders") == {"Pending": 3}
    expect(orders.locator("[data-status='Pending'] .n")).to_have_text("3")
    orders.get_by_role("button", name="Resume queue").click()
    expect(orders.locator(".badge.paused")).to_have_count(0)
    wait_for(lambda: server.counts("ui-orders").get("Succeeded") == 3, "the queue to run again")


def test_enqueue_form_checks_the_body_against_the_schema(server: Served, page):
    sign_in(page, server)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Enqueue").click()
    page.get_by_role("link", name="ChargeCard").click()
    body = page.get_by_label("Body (JSON)")
    expect(body).to_have_value(re.compile(r'"order_id": "ord-1"'))
    body.fill('{"order_id": "x"}')
    page.get_by_role("button", name="Enqueue").click()
    expect(page.locator("#enqueue-errors")).to_contain_text("amount_cents: Field required")
    assert server.counts("ui-orders") == {}
    body.fill("{not json")
    page.get_by_role("button", name="Enqueue").click()
    expect(page.locator("#enqueue-errors")).to_contain_text("not JSON")
    body.fill('{"order_id": "typed-in", "amount_cents": 5}')
    page.get_by_label("Correlation id (optional)").fill("checkout-77")
    page.get_by_role("button", name="Enqueue").click()
    expect(page.locator("#enqueue")).to_contain_text("Enqueued 1 message(s)")
    page.locator("#enqueue a").first.click()
    expect(page.locator("#body")).to_contain_text("typed-in")
    expect(page.locator("dl.facts")).to_contain_text("checkout-77")


def test_sign_in_by_keyboard_and_sign_out(server: Served, page):
    page.goto(server.ui)
    expect(page).to_have_url(re.compile(r"/ui/sign-in\?next="))
    expect(page.get_by_label("API key")).to_be_focused()
    page.keyboard.type(server.key)
    page.keyboard.press("Enter")
    page.wait_for_url(server.ui)
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
    cookie = next(c for c in page.context.cookies() if c["name"] == "queueing_session")
    assert cookie["httpOnly"]
    assert cookie["sameSite"] == "Strict"
    assert server.key not in cookie["value"]
    page.get_by_role("button", name="Sign out").click()
    page.wait_for_url(re.compile(r"/ui/sign-in$"))
    assert not [c for c in page.context.cookies() if c["name"] == "queueing_session"]
    page.goto(server.ui)
    expect(page).to_have_url(re.compile(r"/ui/sign-in"))
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()


def test_the_same_flows_are_refused_without_the_key(server: Served, page):
    dead_letters(server, 1)
    page.goto(server.ui)
    expect(page).to_have_url(re.compile(r"/ui/sign-in"))
    page.get_by_label("API key").fill("not-the-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.locator("#sign-in-error")).to_have_text("That key is not valid.")
    for path in ("messages", "messages?status=DeadLettered", "enqueue/ui-orders"):
        page.goto(server.ui + path)
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.goto(server.url + PREFIX + "/docs")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    ui = server.ui
    form = {"headers": {"Content-Type": "application/x-www-form-urlencoded"}}
    for path, data in [
        ("queues/ui-orders/pause", ""),
        ("bulk", "action=retry&step=run&expected=1&status=DeadLettered"),
        ("enqueue/ui-orders", "body=%7B%7D"),
    ]:
        assert page.request.post(ui + path, data=data, **form).status == 401
    # a made-up session cookie is refused, on the pages and on the API
    forged = {"name": "queueing_session", "value": "1.AAAA.BBBB", "url": server.url + PREFIX}
    page.context.add_cookies([forged])
    page.goto(server.ui)
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.request.get(server.url + PREFIX + "/stats").status == 401
    page.context.clear_cookies()
    # signed in, a change without the page's anti-forgery token is refused: nothing paused
    sign_in(page, server)
    assert page.request.post(ui + "queues/ui-orders/pause", data="", **form).status == 401
    assert (
        page.request.post(
            ui + "queues/ui-orders/pause", data="", headers={**form["headers"], "X-CSRF-Token": "forged"}
        ).status
        == 401
    )
    assert server.paused() == {"ui-orders": False, "ui-reports": False}
    assert server.counts("ui-orders") == {"DeadLettered": 1}


def test_api_docs_render_from_local_files_behind_the_session(server: Served, page):
    sign_in(page, server)
    foreign: list[str] = []
    page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(server.url) else None)
    page.get_by_role("link", name="API").click()
    stats = page.locator(".opblock-summary-path", has_text="/api/_system/queueing/stats")
    expect(stats.first).to_be_visible()
    # "Try it out" on a change goes through with the session and its anti-forgery token
    op = page.locator(".opblock-post", has_text="/queues/{queueName}/pause")
    op.locator(".opblock-summary").click()
    op.get_by_role("button", name="Try it out").click()
    op.locator("input[placeholder='queueName']").fill("ui-reports")
    op.get_by_role("button", name="Execute").click()
    expect(op.locator(".response .response-col_status").first).to_have_text(re.compile("200"))
    assert server.paused() == {"ui-orders": False, "ui-reports": True}
    assert foreign == [], f"requests that left the server: {foreign}"


def test_without_a_key_the_dashboard_is_open_to_this_machine_only(keyless_server: Served, page):
    page.goto(keyless_server.ui)
    expect(page.get_by_role("heading", name="Queues")).to_be_visible()
    expect(page.get_by_text("local, no key")).to_be_visible()
    orders = card(page, "ui-orders")
    orders.get_by_role("button", name="Pause queue").click()
    expect(orders.locator(".badge.paused")).to_have_text("queue paused")
    # the API's rule, unchanged: a change a page of another site asks for is refused
    evil = {"Origin": "http://evil.example", "X-Requested-With": "XMLHttpRequest"}
    assert page.request.post(keyless_server.ui + "queues/ui-orders/resume", headers=evil).status == 403
    # and one without the header a browser cannot send cross-site without asking
    assert page.request.post(keyless_server.ui + "queues/ui-orders/resume").status == 403
    assert keyless_server.counts("ui-orders") == {}
    assert keyless_server.paused() == {"ui-orders": True, "ui-reports": False}


def test_phone_width_has_no_sideways_scrolling(server: Served, browser):
    dead_letters(server, 2)
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        sign_in(page, server)
        for path in ("", "messages?status=DeadLettered", "enqueue/ui-orders"):
            page.goto(server.ui + path)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path or 'overview'} is {width}px wide on a 390px screen"
    finally:
        context.close()


def test_screenshots_of_the_main_pages(server: Served, browser, tmp_path: Path):
    """Writes docs/images/dashboard-*.png when QUEUEING_UPDATE_SCREENSHOTS=1 (commit them)."""
    out = ROOT / "docs" / "images" if os.environ.get("QUEUEING_UPDATE_SCREENSHOTS") == "1" else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    server.enqueue("ui-orders", [{"order_id": f"ord-{i}", "amount_cents": 100 * i} for i in range(30)])
    server.enqueue("ui-reports", [{"name": f"report-{i}"} for i in range(8)])
    wait_for(lambda: server.counts("ui-orders").get("Succeeded") == 30, "the first orders")
    [mid, *_] = dead_letters(server, 4)
    server.broken.unlink()
    shots = {}
    for name, width, height in [("laptop", 1280, 860), ("phone", 390, 844)]:
        context = browser.new_context(viewport={"width": width, "height": height})
        page = context.new_page()
        sign_in(page, server)
        expect(card(page, "ui-orders").locator("[data-status='DeadLettered'] .n")).to_have_text("4")
        pages = (
            [("overview", "")]
            if name == "phone"
            else [
                ("overview", ""),
                ("messages", "messages?queue=ui-orders&status=DeadLettered"),
                ("message", f"messages/{mid}"),
                ("enqueue", "enqueue/ui-orders"),
            ]
        )
        for what, path in pages:
            page.goto(server.ui + path)
            file = out / f"dashboard-{what}{'-phone' if name == 'phone' else ''}.png"
            page.screenshot(path=str(file), full_page=name == "phone")
            shots[file.name] = file.stat().st_size
        if name == "laptop":
            page.goto(server.ui + "messages?queue=ui-orders&status=DeadLettered")
            page.get_by_role("button", name="Retry all…").click()
            expect(page.locator("#confirm-text")).to_contain_text("Retry 4 message(s)")
            page.screenshot(path=str(out / "dashboard-bulk-retry.png"))
            shots["dashboard-bulk-retry.png"] = (out / "dashboard-bulk-retry.png").stat().st_size
        context.close()
    assert len(shots) == 6, shots
    assert all(size > 5000 for size in shots.values()), shots
