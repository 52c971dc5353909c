"""Settings the kit reads only as it opens (the Tables' endpoint of an identity-based Storage connection,
OpenTelemetry) fail indexing with one line naming them: at the open they failed every invocation, so
the host retried each message into its poison queue / dead-letter unrecorded. And an unresolved Key
Vault reference for the API key, or a key the kit refuses (a secret pasted with its newline), stops
only the ops API, not the triggers, whatever the auth level."""

from __future__ import annotations

import builtins
import json
import sys
from typing import Any

import azure.functions as func
import pytest

from functions import build_app
from queueing_core import QueueingApp
from queueing_core.errors import ConfigurationError
from queueing_core.examples.orders import app as orders
from queueing_core.settings import QueueingSettings

from .conftest import Context, bindings, functions_of, user

IDENTITY = {
    "QueueingStorage__credential": "managedidentity",
    "QueueingStorage__clientId": "00000000-0000-0000-0000-000000000000",
}
QUEUE_URI = "https://acct.queue.core.windows.net"
TABLE_URI = "https://acct.table.core.windows.net"
REFERENCE = "@Microsoft.KeyVault(SecretUri=https://kv-queueing-x.vault.azure.net/secrets/queueing-api-key/)"
STORAGE_ENV = {"QueueingStorage": "UseDevelopmentStorage=true"}
#: apps that served a request, kept to the session's end (see test_timers_and_http._KEPT)
_KEPT: list[Any] = []


@pytest.mark.parametrize("queues", ["QueueingStorage__serviceUri", "QueueingStorage__queueServiceUri"])
@pytest.mark.parametrize("provider", ["storage_queue", "servicebus"])
def test_an_identity_connection_without_the_tables_uri_fails_indexing_naming_it(provider, queues):
    env = {
        **IDENTITY,
        queues: QUEUE_URI,
        "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net",
    }
    with pytest.raises(ConfigurationError) as info:
        build_app(QueueingSettings(provider=provider), env=env)
    assert str(info.value).splitlines() == [str(info.value)]
    assert str(info.value).startswith("QueueingStorage__tableServiceUri: not set")
    # with it (or the account name, which gives both), the app indexes
    for more in ({"QueueingStorage__tableServiceUri": TABLE_URI}, {"QueueingStorage__accountName": "acct"}):
        fns = functions_of(build_app(QueueingSettings(provider=provider), env={**env, **more}))
        assert "queueing_retention" in fns


def test_opentelemetry_asked_for_but_not_installed_fails_indexing_naming_it(monkeypatch):
    real_import = builtins.__import__

    def no_otel(name: str, *args: Any, **kwargs: Any) -> Any:  # Azure installs requirements.txt only
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m.startswith("opentelemetry") or m == "queueing_core.otel"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(ConfigurationError) as info:
        build_app(
            QueueingSettings(provider="storage_queue", opentelemetry=True), QueueingApp("t"), env=STORAGE_ENV
        )
    assert str(info.value).startswith("QUEUEING_OPENTELEMETRY: OpenTelemetry is not installed")


def test_opentelemetry_installed_instruments_the_app_once_at_indexing():
    from queueing_core.otel import _MARK

    app = QueueingApp("traced")
    app.include(orders)
    build_app(QueueingSettings(provider="storage_queue", opentelemetry=True), app, env=STORAGE_ENV)
    inst = getattr(app, _MARK)
    middleware = list(app.handle_middleware)
    build_app(QueueingSettings(provider="storage_queue", opentelemetry=True), app, env=STORAGE_ENV)
    # (and so is the runtime's own call as it opens)
    assert getattr(app, _MARK) is inst
    assert app.handle_middleware == middleware


def _stats(fns: dict[str, Any], headers: dict[str, str]) -> func.HttpResponse:
    import asyncio

    request = func.HttpRequest(
        "GET",
        "http://localhost/api/_system/queueing/stats",
        headers=headers,
        params={},
        route_params={},
        body=b"",
    )
    return asyncio.run(user(fns["http_app_func"])(request, Context()))


@pytest.mark.parametrize("level", ["anonymous", "function"])
def test_an_unresolved_key_vault_reference_stops_the_ops_api_not_the_triggers(level, caplog):
    cfg = QueueingSettings(provider="storage_queue", functions_http_auth_level=level, api_key=REFERENCE)
    app = build_app(cfg, env=STORAGE_ENV)
    _KEPT.append(app)
    fns = functions_of(app)
    assert {"queue_order_placed", "queue_capture_payment", "queueing_retention"} <= set(fns)
    assert bindings(fns["http_app_func"])[0]["authLevel"] == level.upper()
    for headers in ({}, {"X-API-Key": REFERENCE}, {"Authorization": f"Bearer {REFERENCE}"}):
        refused = _stats(fns, headers)
        assert refused.status_code == 401, headers
        problem = json.loads(refused.get_body())
        assert "QUEUEING_API_KEY is an unresolved Key Vault reference" in problem["detail"]
        assert "kv-queueing-x" not in refused.get_body().decode()  # the vault's name is not told
    assert any("Key Vault Secrets User" in r.getMessage() for r in caplog.records)


def test_anonymous_without_any_key_still_fails_indexing_saying_it_is_not_set():
    with pytest.raises(ConfigurationError) as info:
        build_app(
            QueueingSettings(provider="storage_queue", functions_http_auth_level="anonymous"), env=STORAGE_ENV
        )
    assert str(info.value).startswith("QUEUEING_FUNCTIONS_HTTP_AUTH_LEVEL:")
    assert "QUEUEING_API_KEY is not set" in str(info.value)


def _from_the_environment(monkeypatch, **settings: str) -> None:
    """The app settings the host hands the worker: exactly these, as build_app reads them at indexing."""
    import os

    for key in list(os.environ):
        if key.startswith("QUEUEING_"):
            monkeypatch.delenv(key)
    for key, value in settings.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("level", ["anonymous", "function"])
@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("a-key-pasted-with-its-newline\n", "starts or ends with whitespace"),
        (" a-key-with-a-leading-space", "starts or ends with whitespace"),
        ("a-key-with\ta-tab", "holds control characters"),
        ("   ", "is blank"),
    ],
    ids=["trailing-newline", "leading-space", "control-character", "blank"],
)
def test_an_unusable_key_stops_the_ops_api_not_the_triggers(monkeypatch, caplog, level, key, says):
    # a key a secret store or a pipeline hands over with its newline failed indexing: no function loaded
    _from_the_environment(
        monkeypatch,
        QUEUEING_PROVIDER="storage_queue",
        QUEUEING_FUNCTIONS_HTTP_AUTH_LEVEL=level,
        QUEUEING_API_KEY=key,
    )
    app = build_app(env=STORAGE_ENV)
    _KEPT.append(app)
    fns = functions_of(app)
    assert {"queue_order_placed", "queue_capture_payment", "queueing_retention"} <= set(fns)
    assert bindings(fns["http_app_func"])[0]["authLevel"] == level.upper()
    [logged] = [r.getMessage() for r in caplog.records if "QUEUEING_API_KEY" in r.getMessage()]
    assert says in logged
    for headers in ({}, {"X-API-Key": key.strip()}, {"Authorization": f"Bearer {key.strip()}"}):
        refused = _stats(fns, headers)
        assert refused.status_code == 401, headers
        problem = json.loads(refused.get_body())
        assert problem["detail"].startswith(f"QUEUEING_API_KEY {says}"), problem
        assert "refuses every request" in problem["detail"]
        if key.strip():
            assert key.strip() not in refused.get_body().decode()  # the key is never told
    assert len([r for r in caplog.records if "QUEUEING_API_KEY" in r.getMessage()]) == 1  # logged once


def test_a_usable_key_from_the_environment_opens_the_ops_api(monkeypatch):
    _from_the_environment(monkeypatch, QUEUEING_PROVIDER="storage_queue", QUEUEING_API_KEY="a-usable-key")
    app = build_app(env=STORAGE_ENV)
    _KEPT.append(app)
    fns = functions_of(app)
    refused = _stats(fns, {"X-API-Key": "a-wrong-key"})
    assert refused.status_code == 401
    assert "QUEUEING_API_KEY" not in json.loads(refused.get_body())["detail"]


def test_another_bad_setting_beside_an_unusable_key_still_fails_indexing_naming_it(monkeypatch):
    _from_the_environment(
        monkeypatch,
        QUEUEING_PROVIDER="storage_queue",
        QUEUEING_API_KEY="a-key-pasted-with-its-newline\n",
        # (declared after the key: the settings name the key first, then this once the key is left out)
        QUEUEING_PAUSE_RECHECK_SECONDS="-1",
    )
    with pytest.raises(ConfigurationError) as info:
        build_app(env=STORAGE_ENV)
    assert str(info.value).startswith("QUEUEING_PAUSE_RECHECK_SECONDS:")
