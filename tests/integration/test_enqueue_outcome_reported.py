"""`queueing enqueue` and the dashboard's enqueue form say what each enqueue did.

An idempotent type's enqueue may write nothing (``discarded``: the waiting message of its identity
has the same content) or change the waiting message (``replaced``); the producer's receipt and the
HTTP API's ``outcome`` say so. The CLI and the dashboard said "enqueued" whatever happened:
`--count 3` of one identity claimed three messages where one existed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

ROOT = Path(__file__).resolve().parents[2]

APP = """
from queueing_core import QueueingApp, QueueMessage, queue

@queue("outcome-sync", idempotent=True, identity="account")
class SyncAccount(QueueMessage):
    account: str
    plan: str = "basic"


@queue("outcome-notes")
class Note(QueueMessage):
    text: str

app = QueueingApp("outcome")
app.message(SyncAccount)
app.message(Note)
"""


@queue("outcome-sync", idempotent=True, identity="account")
class SyncAccount(QueueMessage):
    account: str
    plan: str = "basic"


def _cli(tmp_path: Path) -> Callable[..., str]:
    """`queueing` on a SQLite file with the app above: its output on one line (exit 0 expected, or
    ``code=``: then its output and errors)."""
    (tmp_path / "outcomeapp.py").write_text(textwrap.dedent(APP))
    env = {
        **os.environ,
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
        "QUEUEING_APP": "outcomeapp:app",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
    }

    def cli(*args: str, code: int = 0) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "queueing_core.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == code, (done.stdout, done.stderr)
        return " ".join((done.stdout + (done.stderr if code else "")).split())  # rich may wrap a long line

    return cli


def test_the_cli_reports_each_outcome(tmp_path):
    cli = _cli(tmp_path)

    first = cli("enqueue", "SyncAccount", "--json", '{"account": "acme"}')
    assert first.startswith("enqueued SyncAccount "), first
    message_id = first.split()[2]

    again = cli("enqueue", "SyncAccount", "--json", '{"account": "acme"}')
    assert not again.startswith("enqueued"), again
    assert "discarded" in again, again
    assert "nothing was written" in again, again
    assert message_id in again  # the waiting message it was discarded against

    many = cli("enqueue", "SyncAccount", "--json", '{"account": "acme"}', "--count", "3")
    assert many.startswith("enqueued 0 SyncAccount messages; 3 discarded"), many

    changed = cli("enqueue", "SyncAccount", "--json", '{"account": "acme", "plan": "pro"}')
    assert "replaced" in changed, changed
    assert message_id in changed, changed

    mixed = cli("enqueue", "SyncAccount", "--json", '{"account": "globex"}', "--count", "2")
    assert mixed.startswith("enqueued 1 SyncAccount message; 1 discarded"), mixed

    plain = cli("stats", "--json")
    assert '"Pending": 2' in plain, plain  # acme (replaced once) and globex: two messages in all


def test_the_cli_reports_a_stored_message_id_and_refuses_copies_of_one(tmp_path):
    """A message id given in --json: sent again, nothing is written (the CLI said "enqueued"); with
    --count 3 every copy carried it, and "enqueued 3" stood for one message."""
    cli = _cli(tmp_path)
    body = '{"text": "hi", "message_id": "6f1c1b9e-8f1e-4f55-9a51-0d1c9d7e2a10"}'
    assert cli("enqueue", "Note", "--json", body).startswith("enqueued Note 6f1c1b9e-")
    again = cli("enqueue", "Note", "--json", body)
    assert again.startswith("Note 6f1c1b9e-8f1e-4f55-9a51-0d1c9d7e2a10 duplicate:"), again
    assert "nothing was written" in again, again
    refused = cli("enqueue", "Note", "--json", body, "--count", "3", code=2)
    assert "--json gives a message_id, so --count must be 1" in refused, refused
    assert '"Pending": 1' in cli("stats", "--json")


async def test_the_dashboard_reports_each_outcome(tmp_path):
    app = QueueingApp("outcome")
    app.message(SyncAccount)
    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    try:
        async with ops_client(rt) as client:

            async def send(body: str) -> str:
                form = {"body": body, "correlation_id": "", "delay": ""}
                r = await client.post("/ui/enqueue/outcome-sync", data=form)
                assert r.status_code == 200, r.text[:300]
                return r.text

            first = await send('{"account": "acme"}')
            assert "Enqueued 1 message(s):" in first
            second = await send('{"account": "acme"}')
            assert "Enqueued 0 message(s), discarded 1:" in second, second
            assert "discarded: a message of the same identity and content was already waiting" in second
            third = await send('{"account": "acme", "plan": "pro"}')
            assert "Enqueued 0 message(s), replaced 1:" in third, third
            assert "replaced: the waiting message of the same identity took this body" in third
            batch = await send('[{"account": "acme", "plan": "pro"}, {"account": "globex"}]')
            assert "Enqueued 1 message(s), discarded 1:" in batch, batch
            stats = (await client.get("/messages/stats")).json()
        assert stats["by_status"] == {"Pending": 2}
    finally:
        await rt.close()
