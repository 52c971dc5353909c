"""The ops API and dashboard take the names apps register.

Registration takes any queue or type name; the API took only `[A-Za-z_][A-Za-z0-9_.]*` types and
queues starting with a letter or digit. A type named `billing-invoice` (kebab-case and CloudEvents-
style names are common) or a queue named `_internal` registered and ran, but could be neither paused,
its circuit reset, nor its messages filtered or purged over HTTP (422 "malformed"). The API now
refuses only what it cannot carry safely (whitespace, control and invisible formatting characters,
a leading '.' or '/', a '/' in a type name); `queueing check` warns about a registered name outside
those rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

ROOT = Path(__file__).resolve().parents[2]


@queue(
    "invoices",
    type_name="billing-invoice",
    circuit_breaker=CircuitBreakerOptions(failure_threshold=2, cooldown=timedelta(seconds=30)),
)
class Invoice(QueueMessage):
    n: int


@queue("_internal")
class Internal(QueueMessage):
    n: int


@queue("team:billing/événements", type_name="com.example.invoice:created-v2")
class Created(QueueMessage):
    n: int


async def test_every_registered_name_is_reachable_and_unsafe_ones_are_still_refused(tmp_path):
    app = QueueingApp("names")
    for mtype in (Invoice, Internal, Created):
        app.message(mtype)
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    try:
        await app.enqueue(Invoice(n=1))
        await app.enqueue(Internal(n=1))
        await app.enqueue(Created(n=1))
        async with ops_client(rt) as client:
            for path in (
                "/types/billing-invoice/pause",
                "/types/billing-invoice/resume",
                "/types/billing-invoice/circuit/reset",
                "/queues/_internal/pause",
                "/queues/_internal/resume",
                "/types/com.example.invoice:created-v2/pause",
                "/queues/team:billing/événements/pause",
            ):
                r = await client.post(path)
                assert r.status_code == 200, (path, r.status_code, r.text[:300])
            for params, expected in (
                ({"type": "billing-invoice"}, "invoices"),
                ({"queue": "_internal"}, "_internal"),
                ({"type": "com.example.invoice:created-v2"}, "team:billing/événements"),
                ({"queue": "team:billing/événements"}, "team:billing/événements"),
            ):
                r = await client.get("/messages", params=params)
                assert r.status_code == 200, (params, r.text[:300])
                assert [m["queue"] for m in r.json()["items"]] == [expected]
                page = await client.get("/ui/messages", params=params)
                assert page.status_code == 200, (params, page.text[:300])
            assert (await client.get("/messages/waiting", params={"queue": "_internal"})).status_code == 200
            assert (await client.get("/ui/enqueue/_internal")).status_code == 200
            purged = await client.delete("/messages", params={"queue": "_internal"})
            assert purged.status_code == 200, purged.text[:300]
            assert purged.json()["deleted"] == 1

            # what the API cannot carry safely is still refused as malformed, not looked up
            for path in (
                "/types/bad%20name/pause",  # whitespace
                "/types/a%E2%80%8Bb/pause",  # a zero-width space
                "/types/a%01b/pause",  # a control character
                "/types/.hidden/pause",
                "/types/%3Cb%3E/pause",  # markup
                '/types/a"b/pause',  # a quote
                "/queues/bad%09name/pause",
                "/queues/%2Fabs/pause",
            ):
                r = await client.post(path)
                assert r.status_code == 422, (path, r.status_code, r.text[:300])
            for params in ({"type": "a/b"}, {"type": "x y"}, {"queue": ".."}, {"queue": "a\nb"}):
                r = await client.get("/messages", params=params)
                assert r.status_code == 422, (params, r.status_code)
    finally:
        await rt.close()


def test_check_warns_about_a_registered_name_the_api_cannot_take(tmp_path):
    (tmp_path / "spacedapp.py").write_text(
        textwrap.dedent(
            """
            from queueing_core import QueueingApp, QueueMessage, queue
            @queue("billing invoices", type_name="billing-invoice")
            class Invoice(QueueMessage):
                n: int
            app = QueueingApp()
            app.message(Invoice)
            """
        )
    )
    r = subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", "check", "--app", "spacedapp:app"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
        check=False,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    said = " ".join((r.stdout + r.stderr).split())
    assert "queue 'billing invoices' cannot be named in the ops API or dashboard" in said, said
    assert "type 'billing-invoice' cannot" not in said
