"""The `queueing` commands print stored text and the operator's own arguments as they are.

Found in review: rich read square brackets in printed text as markup. A handler's error "unknown sku
[abc-1]" lost its bracketed part in `queueing show`, "[/done]" raised rich's MarkupError (a traceback),
and so did every refusal echoing an argument (`pause '[/x]'`, `enqueue '[/x]'`, `purge --queue '[/x]'`);
a validation error quoting a regex pattern lost the pattern's brackets, and the tables (`check`,
`stats`) lost the bracketed part of a queue's name. The kit's own styling (the red "error:", "ok")
stays.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

APP = """
from pydantic import Field

from queueing_core import QueueingApp, QueueMessage, queue

app = QueueingApp("brackets")


@queue("orders[eu]", example={"sku": "abc-1"})
class Order(QueueMessage):
    sku: str = Field(pattern=r"^[a-z]+-[0-9]$")


@app.handler()
async def order(msg: Order) -> None:
    pass
"""


@pytest.fixture
def run(tmp_path):
    (tmp_path / "bracket_app.py").write_text(textwrap.dedent(APP))
    env = {
        **os.environ,
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
        "QUEUEING_APP": "bracket_app:app",
        "PYTHONPATH": ROOT,
        "QUEUEING_LOG_LEVEL": "WARNING",
    }

    def go(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "queueing_core.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    return go


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def enqueued_id(run) -> str:
    done = run("enqueue", "Order", "--example")
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[2]  # "enqueued Order <id> (Pending)"


def test_refusals_echo_the_arguments_as_typed(run):
    assert "'[/x]'" in one_error_line(run("pause", "[/x]"))
    assert "'[/x]'" in one_error_line(run("resume", "--type", "[/x]"))
    assert "'[/x]'" in one_error_line(run("enqueue", "[/x]", "--example"))
    assert "'[/x]'" in one_error_line(run("purge", "--queue", "[/x]", "--yes"))
    assert "'[/x]'" in one_error_line(run("purge", "--status", "[/x]", "--yes"))
    # a pydantic refusal quoting its pattern (the status names the kit takes)
    line = one_error_line(run("set-status", "orders[eu]", "--where", "sku", "--value", "x", "--to", "[/x]"))
    assert "'^[A-Za-z][A-Za-z0-9_-]{0,63}$'" in line
    # the model's own words, its regex pattern whole
    bad = run("enqueue", "Order", "--json", '{"sku": "ABC"}')
    assert bad.returncode == 2
    assert "^[a-z]+-[0-9]$" in one_error_line(bad)


def test_show_prints_stored_text_whole(run, tmp_path):
    message_id = enqueued_id(run)
    with sqlite3.connect(tmp_path / "q.db") as db:
        db.execute(
            "UPDATE queueing_messages SET status = 'DeadLettered', reason = '[red]non-retryable', "
            "last_error = 'unknown sku [abc-1] in the order [/done]', "
            "description = '[bold]x[/bold] :smile:', "
            "progress = ?, result = ? WHERE message_id = ?",
            ('{"step": 2, "total": 3, "text": "[/step] [b]"}', '{"log": "[/r]"}', uuid.UUID(message_id).hex),
        )
    shown = run("show", message_id)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr
    out = shown.stdout
    assert "queue orders[eu]" in out
    assert "error     unknown sku [abc-1] in the order [/done]" in out
    assert "reason    [red]non-retryable" in out
    assert "detail    [bold]x[/bold] :smile:" in out
    assert "progress  2 of 3: [/step] [b]" in out
    assert '"[/r]"' in out


def test_tables_show_names_whole(run, tmp_path):
    check = run("check")
    assert check.returncode == 0, check.stderr
    assert "orders[eu]" in check.stdout
    assert check.stdout.rstrip().endswith("ok")
    message_id = enqueued_id(run)
    with sqlite3.connect(tmp_path / "q.db") as db:  # a queue the app no longer has, kept by a row
        db.execute(
            "UPDATE queueing_messages SET queue = '[/gone]' WHERE message_id = ?",
            (uuid.UUID(message_id).hex,),
        )
    stats = run("stats")
    assert stats.returncode == 0, stats.stderr
    assert "Traceback" not in stats.stderr
    assert "orders[eu]" in stats.stdout
    assert "[/gone]" in stats.stdout


def test_retry_and_cancel_print_their_answer(run):  # (a guard: these printed their answer before)
    message_id = enqueued_id(run)
    cancelled = run("cancel", message_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"{message_id}: Cancelled" in cancelled.stdout
    retried = run("retry", message_id)
    assert retried.returncode == 0, retried.stderr
    assert retried.stdout.startswith(f"{message_id}: ")
    # `retry --help` says a message held in a custom status is taken: so it is
    held = run("set-status", "orders[eu]", "--where", "sku", "--value", "abc-1", "--to", "OnHold")
    assert held.returncode == 0, held.stderr
    assert "status    OnHold" in run("show", message_id).stdout
    again = run("retry", message_id)
    assert again.returncode == 0, again.stderr
    assert run("retry", message_id).returncode == 1  # now waiting to run: refused
