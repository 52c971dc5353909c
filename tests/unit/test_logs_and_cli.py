"""Outcome log lines and the `queueing` command's contract (output and exit codes)."""

import json
import logging
import subprocess
import sys
import textwrap

from queueing_core import QueueingApp, QueueMessage
from queueing_core.logs import JsonFormatter, TextFormatter
from queueing_core.testing import in_process, run_until_idle


class Note(QueueMessage):
    text: str


async def test_one_outcome_line_per_message_with_ids(caplog):
    app = QueueingApp()

    @app.handler()
    async def h(msg: Note):
        if msg.text == "bad":
            raise ValueError("nope")

    rt = in_process(app)
    ok = await app.enqueue(Note(text="fine"), correlation_id="corr-7")
    await app.enqueue(Note(text="bad"))
    with caplog.at_level(logging.INFO, logger="queueing.outcome"):
        await run_until_idle(rt, raise_errors=False)
    lines = [r for r in caplog.records if r.name == "queueing.outcome"]
    assert len(lines) == 2
    good = next(r for r in lines if r.status == "Succeeded")
    assert good.message_id == str(ok.message_id)
    assert good.correlation_id == "corr-7"
    assert good.attempt == 1
    failed = next(r for r in lines if r.status == "Failed")
    assert failed.levelno == logging.WARNING
    assert "ValueError: nope" in failed.getMessage()
    doc = json.loads(JsonFormatter().format(good))
    assert doc["message_id"] == str(ok.message_id)
    assert doc["correlation_id"] == "corr-7"
    assert f"message_id={ok.message_id}" in TextFormatter().format(good)


def run_cli(*args, env=None, cwd="."):
    import os

    return subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_version_and_check_lists_the_example_queues():
    v = run_cli("--version")
    assert v.returncode == 0
    assert v.stdout.startswith("queueing-kit ")
    c = run_cli("check", "--app", "queueing_core.examples.orders:app")
    assert c.returncode == 0, c.stderr
    for name in ("order-placed", "generate-invoice", "capture-payment", "send_confirmation", "5 fails/30s"):
        assert name in c.stdout
    s = run_cli("check", "--app", "queueing_core.examples.orders:app", "--transport", "storage_queue")
    assert "storage_queue name" in s.stdout


def test_invalid_setting_exits_2_with_one_line_naming_it():
    r = run_cli("check", env={"QUEUEING_PROVIDER": "kafka"})
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "QUEUEING_PROVIDER" in lines[0]
    assert "'sql'" in lines[0]
    assert "kafka" in lines[0]


def test_unknown_app_exits_2_and_a_duplicate_handler_exits_1(tmp_path):
    r = run_cli("check", "--app", "no.such.module:app")
    assert r.returncode == 2
    assert "cannot import module 'no.such.module'" in r.stderr
    (tmp_path / "dupapp.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage
        class Ping(QueueMessage):
            pass
        app = QueueingApp()
        @app.handler()
        async def one(msg: Ping): ...
        @app.handler()
        async def two(msg: Ping): ...
        """
        )
    )
    d = run_cli("check", "--app", "dupapp:app", cwd=tmp_path)
    assert d.returncode == 1
    assert "dupapp.one" in d.stderr
    assert "dupapp.two" in d.stderr


def test_check_refuses_two_queues_that_collide_after_sanitizing(tmp_path):
    (tmp_path / "clash.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage, queue
        @queue("Orders")
        class A(QueueMessage):
            pass
        @queue("orders")
        class B(QueueMessage):
            pass
        app = QueueingApp()
        app.message(A)
        app.message(B)
        """
        )
    )
    r = run_cli("check", "--app", "clash:app", "--transport", "storage_queue", cwd=tmp_path)
    assert r.returncode == 1
    assert "'orders' is also the name of queue 'Orders' on storage_queue" in r.stderr


def test_help_shows_no_python_type_labels():
    commands = [[], ["serve"], ["check"], ["enqueue"], ["stats"], ["pause"], ["resume"], ["retry"]]
    commands += [["purge"], ["migrate"], ["infra", "params"]]
    for command in commands:
        done = run_cli(*command, "--help")
        assert done.returncode == 0, done.stderr
        for label in ("<bool>", "<str>", "<int>", "<float", "<UUID>", "<list", "<Path>"):
            assert label not in done.stdout, f"queueing {' '.join(command)} --help shows {label}"
    serve = run_cli("serve", "--help").stdout
    assert "--port PORT" in serve
    assert "--app MODULE:ATTR" in serve


def test_counts_in_messages_agree_with_their_number(tmp_path):
    (tmp_path / "one.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage
        class Ping(QueueMessage):
            pass
        app = QueueingApp("one")
        app.message(Ping)
        """
        )
    )
    one = run_cli("check", "--app", "one:app", cwd=tmp_path)
    assert "one: 1 queue on sql" in one.stdout
    three = run_cli("check", "--app", "queueing_core.examples.orders:app", cwd=tmp_path)
    assert "orders: 3 queues on sql" in three.stdout
    env = {"QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db"}
    sent = run_cli(
        "enqueue", "Ping", "--json", "{}", "--count", "2", "--app", "one:app", env=env, cwd=tmp_path
    )
    assert "enqueued 2 Ping messages" in sent.stdout, sent.stderr
    # JSON nested deeper than the interpreter's stack: one line and exit 2, not a traceback
    deep = run_cli(
        "enqueue", "Ping", "--json", "[" * 5000 + "]" * 5000, "--app", "one:app", env=env, cwd=tmp_path
    )
    assert deep.returncode == 2, deep.stderr
    assert "--json is not JSON" in deep.stderr + deep.stdout
    assert "Traceback" not in deep.stderr


def test_migrate_sets_up_the_side_stores_of_rabbitmq_and_sqs(tmp_path):
    """RabbitMQ and SQS keep history, pauses, circuits and delayed messages in QUEUEING_DATABASE_URL:
    with QUEUEING_AUTO_MIGRATE=false the README has them run `queueing migrate`, which must work."""
    import sqlite3

    from queueing_core.providers.sql import LATEST

    for provider in ("rabbitmq", "sqs"):
        db = tmp_path / f"{provider}.db"
        env = {"QUEUEING_PROVIDER": provider, "QUEUEING_DATABASE_URL": f"sqlite:///{db}"}
        done = run_cli("migrate", env=env)
        assert done.returncode == 0, done.stderr
        assert f"schema at version {LATEST}" in done.stdout
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT max(version) FROM queueing_schema").fetchone() == (LATEST,)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"queueing_history", "queueing_delayed", "queueing_circuits", "queueing_pauses"} <= tables


def test_migrate_says_plainly_when_there_is_no_database(tmp_path):
    done = run_cli("migrate", env={"QUEUEING_PROVIDER": "inprocess"})
    assert done.returncode == 2
    assert "keeps nothing in a database" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr
