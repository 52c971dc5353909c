"""Indexing: what `func azure functionapp publish` would index, checked here rather than after a
publish (a host that fails to index reports "0 functions found")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import queueing_core.examples.orders
from functions import build_app
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings

from .conftest import bindings, functions_of

EXAMPLE_QUEUES = {"capture-payment", "generate-invoice", "order-placed"}
STORAGE_ENV = {"QueueingStorage": "UseDevelopmentStorage=true"}
SB_ENV = {**STORAGE_ENV, "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net"}


def test_storage_queue_app_has_one_trigger_per_type_a_timer_and_the_ops_function():
    app = build_app(QueueingSettings(provider="storage_queue"), env=STORAGE_ENV)
    fns = functions_of(app)
    assert set(fns) == {
        "http_app_func",
        "queue_capture_payment",
        "queue_generate_invoice",
        "queue_order_placed",
        "queueing_retention",
    }
    queues = set()
    for name, fn in fns.items():
        [b, *_] = bindings(fn)
        if name.startswith("queue_"):
            assert b["type"] == "queueTrigger"
            assert b["connection"] == "QueueingStorage"
            assert b["name"] == "msg"
            queues.add(b["queueName"])
    assert queues == EXAMPLE_QUEUES
    http = bindings(fns["http_app_func"])[0]
    assert http["authLevel"] == "FUNCTION"
    assert http["route"] == "/{*route}"
    retention = bindings(fns["queueing_retention"])[0]
    assert retention["type"] == "timerTrigger"
    assert len(retention["schedule"].split()) == 6


def test_the_http_function_is_anonymous_only_when_asked_and_only_behind_an_api_key():
    keyed = QueueingSettings(
        provider="storage_queue", functions_http_auth_level="anonymous", api_key="a-key-not-a-secret"
    )
    http = bindings(functions_of(build_app(keyed, env=STORAGE_ENV))["http_app_func"])[0]
    assert http["authLevel"] == "ANONYMOUS"  # a browser reaches the dashboard; the kit's key guards it
    with pytest.raises(ConfigurationError, match="QUEUEING_FUNCTIONS_HTTP_AUTH_LEVEL"):
        build_app(
            QueueingSettings(provider="storage_queue", functions_http_auth_level="anonymous"), env=STORAGE_ENV
        )
    with pytest.raises(ValueError, match="functions_http_auth_level"):
        QueueingSettings(provider="storage_queue", functions_http_auth_level="admin")


def test_servicebus_app_uses_sdk_type_bindings_without_auto_complete():
    # its own app: the prefix is applied to the app's naming, and the example module's app is shared
    own = QueueingApp("prefixed")
    own.include(queueing_core.examples.orders.app)
    app = build_app(QueueingSettings(provider="servicebus", queue_prefix="prod-"), own, env=SB_ENV)
    fns = functions_of(app)
    sb = {n: bindings(f)[0] for n, f in fns.items() if n.startswith("servicebus_")}
    assert {b["queueName"] for b in sb.values()} == {f"prod-{q}" for q in EXAMPLE_QUEUES}
    for b in sb.values():
        assert b["type"] == "serviceBusTrigger"
        assert b["connection"] == "QueueingServiceBus"
        assert b["autoCompleteMessages"] is False
    fn = fns["servicebus_order_placed"].get_user_function()
    assert {p.__name__ for p in fn.__annotations__.values() if p is not None} == {
        "ServiceBusReceivedMessage",
        "ServiceBusMessageActions",
        "Context",  # the invocation's trace context, continued by tracing
    }


def test_sql_app_has_processor_sweeper_and_retention_timers():
    cfg = QueueingSettings(
        provider="sql", database_url="postgresql://h/db", functions_processor_schedule="0 */2 * * * *"
    )
    fns = functions_of(build_app(cfg, env={}))
    timers = {n: bindings(f)[0]["schedule"] for n, f in fns.items() if n.startswith("queueing_")}
    assert timers == {
        "queueing_sql_processor": "0 */2 * * * *",
        "queueing_lease_sweeper": "*/30 * * * * *",
        "queueing_retention": "0 5 * * * *",
    }
    assert not [n for n in fns if n.startswith(("queue_", "servicebus_"))]  # SQL needs no queue triggers


@pytest.mark.parametrize(
    ("settings", "env", "names"),
    [
        (QueueingSettings(provider="storage_queue"), {}, "QueueingStorage: not set"),
        (QueueingSettings(provider="servicebus"), STORAGE_ENV, "QueueingServiceBus: not set"),
        (QueueingSettings(provider="inprocess"), {}, "QUEUEING_PROVIDER: 'inprocess' cannot serve"),
    ],
)
def test_missing_or_wrong_settings_fail_indexing_with_one_line_naming_them(settings, env, names):
    with pytest.raises(ConfigurationError) as info:
        build_app(settings, env=env)
    assert str(info.value).startswith(names)
    assert "\n" not in str(info.value)


def test_a_processor_budget_that_functiontimeout_would_cut_short_fails_indexing(tmp_path):
    """A budget the host's functionTimeout ends before the run can stop and settle (the stop grace, the
    claims, the settlement flush and the close, and opening the runtime: 40 s) would cut every busy run
    short: its messages run again."""
    sql = {"provider": "sql", "database_url": "postgresql://h/db"}
    # this repository's own host.json (10 minutes), found where the host runs the app from
    with pytest.raises(ConfigurationError) as info:
        build_app(QueueingSettings(**sql, functions_processor_budget=3600), env={})
    assert str(info.value).startswith("QUEUEING_FUNCTIONS_PROCESSOR_BUDGET: 3600 s leaves a run no time")
    assert "functionTimeout (00:10:00)" in str(info.value)
    assert "at most 530" in str(info.value)  # (runs are cut a minute before it: see the run bound)
    build_app(QueueingSettings(**sql), env={})  # the default budget, 50 s
    host = tmp_path / "host.json"
    for timeout, budget, refused in [
        ("00:01:00", 50, True),
        ("00:01:00", 20, False),
        ("00:01:00", 21, True),
        ("1.00:00:00", 3600, False),
        ("-1", 3600, False),
    ]:
        host.write_text(json.dumps({"version": "2.0", "functionTimeout": timeout}))
        cfg = QueueingSettings(**sql, functions_processor_budget=budget)
        env = {"AzureWebJobsScriptRoot": str(tmp_path)}
        if refused:
            with pytest.raises(ConfigurationError, match="PROCESSOR_BUDGET"):
                build_app(cfg, env=env)
        else:
            build_app(cfg, env=env)


def test_the_function_timeout_app_setting_and_the_plans_default_are_what_the_budget_is_held_to(tmp_path):
    """An app setting overrides host.json (AzureFunctionsJobHost__functionTimeout): raised to an hour,
    a 20-minute budget is right. Without functionTimeout anywhere the plan's default applies (5 minutes
    on Consumption, 30 elsewhere), not "unbounded" (both found in review)."""
    sql = {"provider": "sql", "database_url": "postgresql://h/db"}
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"version": "2.0", "functionTimeout": "00:10:00"}))
    root = {"AzureWebJobsScriptRoot": str(tmp_path)}
    build_app(
        QueueingSettings(**sql, functions_processor_budget=1200),
        env={**root, "AzureFunctionsJobHost__functionTimeout": "01:00:00"},
    )
    with pytest.raises(ConfigurationError, match="PROCESSOR_BUDGET"):  # lowered by the setting
        build_app(QueueingSettings(**sql), env={**root, "AzureFunctionsJobHost__functionTimeout": "00:01:00"})
    host.write_text(json.dumps({"version": "2.0"}))
    with pytest.raises(ConfigurationError, match="PROCESSOR_BUDGET"):
        build_app(QueueingSettings(**sql, functions_processor_budget=3600), env=root)
    build_app(QueueingSettings(**sql, functions_processor_budget=1200), env=root)  # 30 minutes
    with pytest.raises(ConfigurationError, match="at most 230"):  # Consumption: 5 minutes
        build_app(
            QueueingSettings(**sql, functions_processor_budget=1200), env={**root, "WEBSITE_SKU": "Dynamic"}
        )


def test_a_max_dequeue_count_not_above_every_max_attempts_fails_indexing(tmp_path):
    """The Storage trigger moves a message to -poison itself after maxDequeueCount deliveries. A message
    whose every run died unsettled must reach the kit once more than max_attempts, so that the kit
    dead-letters it with its reason and records it (at max_attempts the host's move left its history
    Pending: a review found it)."""
    storage = QueueingSettings(provider="storage_queue")
    build_app(storage, env=STORAGE_ENV)  # this repository's host.json: 6, above the example's 5
    host = tmp_path / "host.json"
    root = {**STORAGE_ENV, "AzureWebJobsScriptRoot": str(tmp_path)}
    host.write_text(json.dumps({"version": "2.0", "extensions": {"queues": {"maxDequeueCount": 5}}}))
    with pytest.raises(ConfigurationError) as info:
        build_app(storage, env=root)
    assert str(info.value).startswith("extensions.queues.maxDequeueCount (host.json): 5 is not above")
    assert "at least 6" in str(info.value)
    build_app(storage, env={**root, "AzureFunctionsJobHost__extensions__queues__maxDequeueCount": "6"})
    host.write_text(json.dumps({"version": "2.0"}))  # the trigger's default, 5
    with pytest.raises(ConfigurationError, match="maxDequeueCount"):
        build_app(storage, env=root)
    build_app(
        QueueingSettings(provider="servicebus"),
        env={**root, "QueueingServiceBus": "Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey=v"},
    )


@queue("orders-" + "x" * 46)  # 53 characters: a valid Storage queue name alone
class LongNamed(QueueMessage):
    n: int = 0


def test_a_queue_whose_poison_queue_name_storage_would_refuse_fails_indexing():
    """With the deployment's prefix the name is 62 characters, and its host's -poison queue 69 (Storage
    takes 63): indexing passed, then every invocation of every function failed opening the runtime
    (found in review). Service Bus takes the name: that app indexes."""

    def long_app() -> QueueingApp:  # (a fresh one each time: indexing gives an app its prefix)
        app = QueueingApp("long")

        @app.handler()
        async def handle(msg: LongNamed) -> None:
            return None

        return app

    prefixed = QueueingSettings(provider="storage_queue", queue_prefix="prod-weu-")
    with pytest.raises(ConfigurationError) as info:
        build_app(prefixed, long_app(), env=STORAGE_ENV)
    assert str(info.value).startswith(f"queue {'orders-' + 'x' * 46!r}")
    assert "storage_queue" in str(info.value)
    build_app(QueueingSettings(provider="storage_queue"), long_app(), env=STORAGE_ENV)  # 53 + 7: it fits
    build_app(QueueingSettings(provider="servicebus", queue_prefix="prod-weu-"), long_app(), env=SB_ENV)


def run_import(env: dict[str, str], code: str = "import function_app") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("QUEUEING_", "Queueing"))}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=False,
        cwd=os.getcwd(),
    )


def test_a_misspelled_setting_fails_the_import_with_one_line():
    done = run_import({"QUEUEING_PROVIDER": "stroage_queue"})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "QUEUEING_PROVIDER: 'stroage_queue' is not accepted" in last
    assert "'storage_queue'" in last


COLD = """
import builtins, socket, sys
opened = []
real_open = builtins.open
def spy(file, *a, **k):
    opened.append(str(file))
    return real_open(file, *a, **k)
builtins.open = spy
def refuse(*a, **k):
    raise AssertionError(f"network at import: {a}")
socket.socket.connect = refuse
socket.create_connection = refuse
import function_app
heavy = ("azure.servicebus", "azure.storage", "azure.data", "azure.identity", "sqlalchemy", "psycopg",
         "aiosqlite", "fastapi", "starlette", "uvicorn", "aiohttp", "azurefunctions.extensions")
print(sorted({next(h for h in heavy if m.startswith(h)) for m in sys.modules if m.startswith(heavy)}))
print(opened)
print(len(function_app.app.get_functions()))
"""


@pytest.mark.parametrize(
    ("env", "allowed", "functions"),
    [
        ({"QUEUEING_PROVIDER": "storage_queue", **STORAGE_ENV}, set(), 5),
        ({"QUEUEING_PROVIDER": "sql", "QUEUEING_DATABASE_URL": "postgresql://h/db"}, set(), 4),
        ({"QUEUEING_PROVIDER": "servicebus", **SB_ENV}, {"azure.servicebus", "azurefunctions.extensions"}, 5),
    ],
)
def test_import_loads_only_what_the_configuration_needs_and_touches_nothing(env, allowed, functions):
    done = run_import(env, COLD)
    assert done.returncode == 0, done.stderr
    loaded, opened, count = done.stdout.strip().splitlines()
    assert set(eval(loaded)) <= allowed, loaded
    # nothing but the app's own host.json, once (its functionTimeout bounds every run, and holds the SQL
    # processor's budget; its maxDequeueCount on Storage Queues: see the budget and dequeue-count tests)
    assert eval(opened) == [os.path.join(os.getcwd(), "host.json")]
    assert int(count) == functions
