"""`queueing` and configuration: secrets kept out of what it prints, bad configuration said at once.

Found in review: a PostgreSQL password given in the URL's query string (``?password=``) was printed
by `queueing migrate`, the `serve` banner and the provider's log lines; a SQLite path that cannot be
opened (its directory missing) was retried for a minute as if a server were down, sometimes with
"Event loop is closed" tracebacks from aiosqlite's thread, and exited 1, not 2; ``QUEUEING_APP=garbage``
was reported as ``--app``; `retry --help` named fewer statuses than `retry` takes.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from queueing_core.errors import ConfigurationError
from queueing_core.ops.service import RETRYABLE
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.engine import create_engine, redact, sqlite_cannot_open
from tests.services import POSTGRES_URL, drop_schema, require

ROOT = Path(__file__).resolve().parents[2]


def aiosqlite_threads() -> set[threading.Thread]:
    """aiosqlite's connection threads now running."""
    return {t for t in threading.enumerate() if "_connection_worker_thread" in t.name and t.is_alive()}


SECRET = "S3CRETqs"


def run_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"postgresql://u@h/db?password={SECRET}", "postgresql://u@h/db?password=***"),
        (f"postgresql://u@h/db?sslmode=require&PassWord={SECRET}", "PassWord=***"),
        (f"postgresql://u:{SECRET}@h/db?sslpassword={SECRET}&sslkey=/k/key.pem", "sslpassword=***"),
        (f"postgresql+psycopg://u@h/db?password={SECRET}&password=again{SECRET}", "password=***"),
    ],
)
def test_redact_hides_a_password_in_the_query_string(url, shown):
    text = redact(url)
    assert SECRET not in text
    assert shown in text
    assert redact(sa.engine.make_url(url)) == text
    if "sslkey" in url:
        assert "sslkey=" in text  # a path, not a secret
        assert "key.pem" in text


def test_redact_leaves_a_url_without_secrets_as_it_is():
    assert redact("postgresql://u@h:5432/db?sslmode=require") == "postgresql://u@h:5432/db?sslmode=require"
    assert redact("sqlite:////var/q.db") == "sqlite:////var/q.db"


def test_serve_banner_log_and_error_hide_the_query_string_password(tmp_path):
    # nothing listens on port 1: the banner, the retry's log line and the unreachable error all name it
    done = run_cli(
        "serve",
        "--no-api",
        env={
            "QUEUEING_DATABASE_URL": f"postgresql://app@127.0.0.1:1/db?password={SECRET}&sslpassword={SECRET}",
            "QUEUEING_CONNECT_RETRIES": "1",
        },
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "password=***" in done.stdout  # the banner
    assert "retry 1/1" in done.stderr  # the provider's log line
    assert "unreachable after 2 tries" in done.stderr  # the error
    assert SECRET not in done.stdout + done.stderr


async def test_migrate_hides_the_query_string_password(tmp_path):
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qi_{uuid.uuid4().hex[:10]}"
    url = sa.engine.make_url(POSTGRES_URL).update_query_dict({"password": SECRET})
    try:
        done = await asyncio.to_thread(
            run_cli,
            "migrate",
            env={
                "QUEUEING_DATABASE_URL": url.render_as_string(hide_password=False),
                "QUEUEING_DATABASE_SCHEMA": schema,
                "QUEUEING_LOG_LEVEL": "INFO",
            },
            cwd=tmp_path,
        )
    finally:
        await drop_schema(schema)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "schema at version" in done.stdout
    assert "password=***" in done.stdout
    assert SECRET not in done.stdout + done.stderr


def test_a_sqlite_file_in_a_missing_directory_is_bad_configuration(tmp_path):
    missing = tmp_path / "no-such-dir" / "q.db"
    started = time.monotonic()
    done = run_cli("stats", env={"QUEUEING_DATABASE_URL": f"sqlite:///{missing}"}, cwd=tmp_path)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr  # no retries logged, no thread's traceback
    assert "QUEUEING_DATABASE_URL" in lines[0]
    assert str(missing) in lines[0]
    assert "does not exist" in lines[0]
    assert took < 20, f"took {took:.1f}s: retried as if a server were down"


def test_the_cause_is_named(tmp_path, monkeypatch):
    def said(path: Path) -> str:
        return str(sqlite_cannot_open(sa.engine.make_url(f"sqlite:///{path}")))

    assert f"the directory {str(tmp_path / 'nope')!r} does not exist" in said(tmp_path / "nope" / "q.db")
    assert "it is a directory" in said(tmp_path)
    # (as root every access is allowed: the refusal is the file system's answer, faked here)
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)
    assert "may not write in the directory" in said(tmp_path / "q.db")
    (tmp_path / "q.db").touch()
    assert "may not read and write the file" in said(tmp_path / "q.db")


async def test_the_provider_raises_at_once_and_leaves_no_thread_behind(tmp_path):
    before = aiosqlite_threads()
    provider = SqlProvider(f"sqlite:///{tmp_path}/missing/q.db")
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="does not exist"):
        await provider.open()
    assert time.monotonic() - started < 5
    assert not aiosqlite_threads() - before
    await provider.close()


async def test_a_failed_sqlite_open_waits_for_aiosqlites_thread(tmp_path):
    # aiosqlite's thread answers the stop on the caller's loop: left running past the failure, it
    # may answer a closed loop and print "Event loop is closed" from the thread
    engine = create_engine(f"sqlite:///{tmp_path}/missing/q.db")
    before = aiosqlite_threads()
    try:
        for _ in range(5):
            with pytest.raises(sa.exc.OperationalError):
                async with engine.connect() as conn:
                    await conn.execute(sa.text("SELECT 1"))
            assert not aiosqlite_threads() - before
    finally:
        await engine.dispose()


def test_a_bad_queueing_app_is_named_as_the_setting(tmp_path):
    from_setting = run_cli("stats", env={"QUEUEING_APP": "garbage"}, cwd=tmp_path)
    assert from_setting.returncode == 2
    assert "QUEUEING_APP: 'garbage' is not MODULE:ATTR" in from_setting.stderr
    assert "--app" not in from_setting.stderr
    missing = run_cli("check", env={"QUEUEING_APP": "no_such_module_s59:app"}, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: QUEUEING_APP: cannot import module 'no_such_module_s59'")
    from_option = run_cli("stats", "--app", "garbage", env={"QUEUEING_APP": "x:y"}, cwd=tmp_path)
    assert from_option.returncode == 2
    assert "--app: 'garbage' is not MODULE:ATTR" in from_option.stderr


#: how the help and the docs say each status retry takes
RETRY_WORDS = {
    "DeadLettered": "dead-lettered",
    "Failed": "failed",
    "Expired": "expired",
    "Abandoned": "abandoned",
    "Cancelled": "cancelled",
    "Sleeping": "sleeping",
}


def test_retry_help_and_docs_name_what_retry_takes(tmp_path):
    assert {s.value for s in RETRYABLE} == set(RETRY_WORDS), "a status retry takes is not described"
    shown = run_cli("retry", "--help", env={}, cwd=tmp_path)
    assert shown.returncode == 0
    help_text = " ".join(shown.stdout.split())
    row = next(
        line
        for line in (ROOT / "docs/operations/cli.md").read_text().splitlines()
        if line.startswith("| `retry ")
    )
    for text in (help_text, row):
        for word in RETRY_WORDS.values():
            assert re.search(rf"\b{word}\b", text), (word, text)
        assert "custom status" in text  # an operator's own status (set-status) is retried too
