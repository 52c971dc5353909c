"""First-use mistakes at the command line: one line naming the setting, exit 2, and no secret printed.

Found in review: ``queueing migrate`` signed in differently from the hosts (it ignored
``QUEUEING_DATABASE_AUTH``, ``_CLIENT_ID`` and ``_PREPARED_STATEMENTS``); a RabbitMQ URL whose password
held '/' ended in a traceback that printed the password; ``QUEUEING_ARCHIVE_STATUSES=a,b`` (and any
misspelt status) and ``enqueue`` of a message over the transport's limit gave tracebacks too.
"""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from tests.unit.test_logs_and_cli import run_cli

ENTRA_WITH_PASSWORD = {
    "QUEUEING_DATABASE_URL": "postgresql://app:not-a-token@127.0.0.1:5432/test",
    "QUEUEING_DATABASE_AUTH": "entra",
}


def test_migrate_signs_in_as_the_hosts_do(tmp_path):
    # the hosts refuse a password beside entra sign-in; migrate used to sign in with the password
    stats = run_cli("stats", env=ENTRA_WITH_PASSWORD, cwd=tmp_path)
    migrate = run_cli("migrate", env=ENTRA_WITH_PASSWORD, cwd=tmp_path)
    assert stats.returncode == migrate.returncode == 2, migrate.stdout + migrate.stderr
    assert "QUEUEING_DATABASE_AUTH=entra" in migrate.stderr
    assert migrate.stderr == stats.stderr
    assert "Traceback" not in migrate.stderr


@pytest.mark.parametrize("provider", ["sql", "rabbitmq"])
def test_migrate_passes_the_sign_in_settings_to_the_provider(monkeypatch, tmp_path, provider):
    import queueing_core.providers.sql as sql
    from queueing_core.cli import cli

    made: list[dict[str, object]] = []

    class Recorded:
        def __init__(self, url: str, **kwargs: object) -> None:
            made.append({"url": url, **kwargs})

        async def open(self) -> None:
            pass

        async def close(self) -> None:
            pass

    monkeypatch.setattr(sql, "SqlProvider", Recorded)
    env = {
        "QUEUEING_PROVIDER": provider,
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/kit.db",
        "QUEUEING_DATABASE_AUTH": "password",
        "QUEUEING_DATABASE_CLIENT_ID": "11111111-2222-3333-4444-555555555555",
        "QUEUEING_DATABASE_PREPARED_STATEMENTS": "false",
        "QUEUEING_AUTO_MIGRATE": "false",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    done = CliRunner().invoke(cli, ["migrate"])
    assert done.exit_code == 0, done.output
    [kwargs] = made
    assert kwargs["database_auth"] == "password"
    assert kwargs["client_id"] == "11111111-2222-3333-4444-555555555555"
    assert kwargs["prepared_statements"] is False
    assert kwargs["auto_migrate"] is True  # what migrate is for, whatever QUEUEING_AUTO_MIGRATE says
    assert kwargs["listen"] is False


def _quiet(done) -> str:
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:S3cr3t/Tail#x@127.0.0.1:5672/",
        "amqp://guest:S3cr3t#Tail@127.0.0.1:5672/",
        "amqp://guest:S3cr3t?Tail@127.0.0.1:5672/",
        "amqp://guest:S3cr3t",
    ],
)
def test_a_rabbitmq_password_to_percent_encode_is_named_and_never_printed(tmp_path, url):
    env = {
        "QUEUEING_PROVIDER": "rabbitmq",
        "QUEUEING_RABBITMQ_URL": url,
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/side.db",
    }
    done = run_cli("stats", env=env, cwd=tmp_path)
    assert done.returncode == 2, _quiet(done)
    assert "S3cr3t" not in _quiet(done)
    assert "Tail" not in _quiet(done)
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "QUEUEING_RABBITMQ_URL" in line
    assert "percent-encode" in line


def test_a_database_password_holding_at_signs_is_named_and_never_printed(tmp_path):
    env = {"QUEUEING_DATABASE_URL": "postgresql://app:S3cr3t:P@rt@127.0.0.1:5432/test"}
    done = run_cli("stats", env=env, cwd=tmp_path)
    assert done.returncode == 2, _quiet(done)
    assert "S3cr3t" not in _quiet(done)
    assert "rt@" not in _quiet(done)
    [line] = done.stderr.splitlines()
    assert "QUEUEING_DATABASE_URL" in line
    assert "percent-encode" in line


def test_archive_statuses_take_the_comma_form_and_refuse_unknown_ones(tmp_path):
    ok = run_cli("check", env={"QUEUEING_ARCHIVE_STATUSES": "Succeeded, DeadLettered"}, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    as_json = run_cli("check", env={"QUEUEING_ARCHIVE_STATUSES": '["Succeeded"]'}, cwd=tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    bad = run_cli("check", env={"QUEUEING_ARCHIVE_STATUSES": "Succeded,DeadLettered"}, cwd=tmp_path)
    assert bad.returncode == 2, _quiet(bad)
    assert "Traceback" not in bad.stderr
    [line] = bad.stderr.splitlines()
    assert "QUEUEING_ARCHIVE_STATUSES" in line
    assert "'Succeded'" in line
    for status in ("Succeeded", "DeadLettered", "Expired", "Cancelled", "Abandoned"):
        assert status in line
    broken = run_cli("check", env={"QUEUEING_ARCHIVE_STATUSES": '["Succeeded",'}, cwd=tmp_path)
    assert broken.returncode == 2, _quiet(broken)
    assert "QUEUEING_ARCHIVE_STATUSES" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_enqueue_of_a_message_over_the_limit_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bigapp.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage, queue
        @queue("first-use-big", example={"blob": "x" * (1024 * 1024 + 10)})
        class Blob(QueueMessage):
            blob: str
        app = QueueingApp("big")
        app.message(Blob)
        """
        )
    )
    env = {
        "QUEUEING_DATABASE_URL": f"sqlite:///{tmp_path}/q.db",
        "QUEUEING_HISTORY_JOURNAL": "off",
        "QUEUEING_LOG_LEVEL": "WARNING",  # (not the migration's lines)
    }
    done = run_cli("enqueue", "Blob", "--example", "--app", "bigapp:app", env=env, cwd=tmp_path)
    assert done.returncode == 2, _quiet(done)
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert "bytes encoded; sql accepts at most 1048576" in line


def test_a_worker_id_too_long_for_the_lease_column_stops_start_up(tmp_path):
    done = run_cli("check", env={"QUEUEING_WORKER_ID": "w" * 129}, cwd=tmp_path)
    assert done.returncode == 2, _quiet(done)
    [line] = done.stderr.splitlines()
    assert "QUEUEING_WORKER_ID" in line
    assert "at most 128" in line
