"""No silent per-instance SQLite on Azure Functions: state every instance must share (the SQL
transport's queues, the Storage Queues delayed-message store) in a SQLite file fails indexing with one
line naming the setting; a single local host may allow it explicitly."""

from __future__ import annotations

import logging

import pytest

from functions import build_app
from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings

from .conftest import functions_of
from .test_indexing import STORAGE_ENV, run_import


@pytest.mark.parametrize(
    ("settings", "env", "says"),
    [
        ({"provider": "sql"}, {}, "is not set (the default is a SQLite file): the SQL transport's queues"),
        (
            {"provider": "sql", "database_url": "sqlite:///./q.db"},
            {},
            "is SQLite: the SQL transport's queues",
        ),
        (
            {"provider": "sql", "database_url": "sqlite+aiosqlite:////home/q.db"},
            {},
            "is SQLite: the SQL transport's queues",
        ),
        (
            {"provider": "storage_queue", "storage_delayed_store": True},
            STORAGE_ENV,
            "is not set (the default is a SQLite file): the delayed-message store",
        ),
    ],
)
def test_shared_state_in_sqlite_fails_indexing_with_one_line(settings, env, says):
    with pytest.raises(ConfigurationError) as caught:
        build_app(QueueingSettings(**settings), env=env)
    text = str(caught.value)
    assert text.startswith("QUEUEING_DATABASE_URL: ")
    assert says in text
    assert "QUEUEING_FUNCTIONS_LOCAL_SQLITE" in text
    assert "\n" not in text


def test_a_shared_database_or_no_shared_state_indexes():
    functions_of(build_app(QueueingSettings(provider="sql", database_url="postgresql://h/db"), env={}))
    functions_of(
        build_app(
            QueueingSettings(
                provider="storage_queue", storage_delayed_store=True, database_url="postgresql://h/d"
            ),
            env=STORAGE_ENV,
        )
    )
    functions_of(build_app(QueueingSettings(provider="storage_queue"), env=STORAGE_ENV))  # no SQL at all


def test_one_local_host_may_allow_sqlite_and_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="queueing.functions"):
        fns = functions_of(build_app(QueueingSettings(provider="sql", functions_local_sqlite=True), env={}))
    assert "queueing_sql_processor" in fns
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "QUEUEING_FUNCTIONS_LOCAL_SQLITE" in warning


@pytest.mark.parametrize("provider", ["rabbitmq", "sqs"])
def test_transports_whose_side_stores_would_be_sqlite_have_no_functions_triggers(provider):
    with pytest.raises(ConfigurationError, match=r"QUEUEING_PROVIDER: .* has no Functions trigger"):
        build_app(QueueingSettings(provider=provider), env={})


def test_the_functions_entry_point_refuses_it_at_import():
    done = run_import({"QUEUEING_PROVIDER": "sql"})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "QUEUEING_DATABASE_URL: is not set (the default is a SQLite file)" in last
    assert "a separate file on every Functions instance" in last
