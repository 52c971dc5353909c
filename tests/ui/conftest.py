"""A real `queueing serve` (worker and ops API in one process) on a free port and a fresh SQLite file,
and Debian's chromium driven by Playwright."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect

from tests.integration.served import free_port

# a shared machine under load: wait generously for what must happen (nothing here asserts speed)
expect.set_options(timeout=30_000)  # generous: a loaded machine renders slowly
ROOT = Path(__file__).resolve().parents[2]
KEY = "ui-test-key-not-a-secret"
PREFIX = "/api/_system/queueing"
CHROMIUM = os.environ.get("QUEUEING_TEST_CHROMIUM", "/usr/bin/chromium")


@dataclass
class Served:
    url: str  # http://127.0.0.1:<port>
    key: str | None
    broken: Path  # while this file exists, ChargeCard dead-letters
    log: Path

    @property
    def ui(self) -> str:
        return f"{self.url}{PREFIX}/ui/"

    def api(self) -> httpx.Client:
        headers = {"X-API-Key": self.key} if self.key else {}
        return httpx.Client(base_url=self.url + PREFIX, headers=headers, timeout=30)

    def enqueue(self, queue: str, bodies: list[dict]) -> list[str]:
        with self.api() as client:
            r = client.post(f"/queues/{queue}/messages", json=bodies)
            assert r.status_code == 201, r.text
            return [m["message_id"] for m in r.json()["enqueued"]]

    def paused(self) -> dict[str, bool]:
        with self.api() as client:
            return {q["queue"]: q["paused"] for q in client.get("/stats").json()["queues"]}

    def counts(self, queue: str) -> dict[str, int]:
        with self.api() as client:
            stats = client.get("/stats").json()
        return next(q["counts"] for q in stats["queues"] if q["queue"] == queue)


def serve(tmp_path: Path, key: str | None) -> Iterator[Served]:
    port = free_port()
    log = tmp_path / "serve.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("QUEUEING_")},
        "QUEUEING_APP": "tests.ui.app:app",
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/ui.db",
        "QUEUEING_POLL_MAX": "0.5",
        "UI_TEST_BROKEN_FILE": str(tmp_path / "broken"),
    }
    if key:
        env["QUEUEING_API_KEY"] = key
    cmd = [str(Path(sys.executable).parent / "queueing"), "serve", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    served = Served(f"http://127.0.0.1:{port}", key, tmp_path / "broken", log)
    try:
        deadline = time.monotonic() + 120  # generous: a loaded machine starts slowly
        while True:
            try:
                httpx.get(served.url + PREFIX + "/ui/static/ui.css", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                assert proc.poll() is None, f"queueing serve exited: {log.read_text()}"
                assert time.monotonic() < deadline, f"queueing serve did not answer: {log.read_text()}"
                time.sleep(0.2)
        yield served
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path, KEY)


@pytest.fixture
def keyless_server(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path, None)


@pytest.fixture
def browser():
    """A browser per test: Playwright's sync API keeps an event loop running while it is open, which
    the async tests after it in the session must not find."""
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        message = f"{CHROMIUM} is missing (scripts/chromium.sh installs Debian's chromium)"
        if os.environ.get("QUEUEING_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(30_000)
    page = context.new_page()
    yield page
    context.close()


def sign_in(page, served: Served, key: str | None = None) -> None:
    page.goto(served.ui)
    page.get_by_label("API key").fill(key or served.key or "")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(served.ui)
