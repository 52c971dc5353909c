"""The settings a deployment of infra/main.bicep gives the Function App are the ones the kit needs *in
Functions*, and every value the template accepts is one the kit accepts (both found in review).

- ``QUEUEING_PAUSE_RECHECK_SECONDS``: in Functions every recheck of a paused or held message is a copy
  sent and a new execution. docs/hosts/azure-functions.md says the app uses 60 s there, as
  local.settings.sample.json does; the Bicep set nothing, so a deployed app ran with the library
  default (5 s): twelve executions a minute per paused message instead of one.
- ``trackerRetentionDays``: the template only bounded it below; the kit refuses more than its ``le``
  bound for ``QUEUEING_TRACKER_RETENTION_DAYS`` at indexing, so every function of the app failed to
  load ("0 functions found") after a deployment the template accepted.
- ``apiKey``: the template takes any string (Bicep has no pattern decorator), and Key Vault hands it to
  the app unchanged; a key pasted with its newline failed indexing the same way. Such a key now stops
  only the ops API, and the template refuses what it can: an empty key.
"""

from __future__ import annotations

import json
import os

import pytest

from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings, load_settings
from tests.infra.bicep_tools import (
    API_KEY_VARIABLE,
    MAIN,
    ROOT,
    build_params,
    decorators,
    module_file,
    parsed,
    read_bicepparam,
)
from tests.infra.deployment import DeploymentRefused, deploy
from tests.infra.provisioned import API_KEY, Provisioned

PREFIX = str(QueueingSettings.model_config.get("env_prefix", ""))


def env_name(field: str) -> str:
    return f"{PREFIX}{field}".upper()


def deployed_settings(monkeypatch, **parameters) -> QueueingSettings:
    """The kit's settings as a deployment (main.bicepparam + ``parameters``) hands them to the app."""
    settings = deploy(**build_params(read_bicepparam(), {API_KEY_VARIABLE: API_KEY}, parameters)).app_settings
    for key in list(os.environ):
        if key.startswith(PREFIX):
            monkeypatch.delenv(key)
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    return load_settings()


@pytest.mark.parametrize("provider", ["servicebus", "storage_queue"])
def test_the_deployed_app_rechecks_paused_work_at_the_functions_interval(monkeypatch, provider):
    field = "pause_recheck_seconds"
    sample = json.loads((ROOT / "local.settings.sample.json").read_text())["Values"]
    functions_value = float(sample[env_name(field)])
    library_default = QueueingSettings.model_fields[field].default
    assert functions_value != library_default, "nothing to check: the sample keeps the default"
    assert f"{env_name(field)}={functions_value:g}" in (ROOT / "docs/hosts/azure-functions.md").read_text()

    deployed = deployed_settings(monkeypatch, queueingProvider=provider)
    assert getattr(deployed, field) == functions_value, (
        f"a deployment leaves {env_name(field)} unset, so the app rechecks paused and held messages every "
        f"{getattr(deployed, field):g} s (the library default), each recheck a copy and an execution; "
        f"docs/hosts/azure-functions.md and local.settings.sample.json use {functions_value:g} s in Functions"
    )


def _upper_bound(field: str) -> float:
    bounds = [
        m.le for m in QueueingSettings.model_fields[field].metadata if getattr(m, "le", None) is not None
    ]
    assert bounds, f"{field} has no upper bound in the code"
    return min(bounds)


def test_tracker_retention_days_is_bounded_as_the_kit_bounds_it() -> None:
    limit = _upper_bound("tracker_retention_days")
    for name, doc in (
        ("main.bicep", parsed(MAIN)),
        ("modules/functionapp.bicep", module_file("functionapp")),
    ):
        bound = decorators(doc["parameters"]["trackerRetentionDays"]).get("max_value")
        assert (bound if bound is not None else float("inf")) <= limit, (
            f"{name}: trackerRetentionDays has @maxValue {bound}, but the kit refuses "
            f"{env_name('tracker_retention_days')} above {limit:g}"
        )


def test_a_retention_the_template_accepts_is_one_the_app_starts_with(monkeypatch) -> None:
    too_long = int(_upper_bound("tracker_retention_days")) + 1
    try:
        deployed_settings(monkeypatch, trackerRetentionDays=too_long)
    except DeploymentRefused:
        return  # the template refuses it before anything is deployed: consistent
    except ConfigurationError as exc:
        pytest.fail(
            f"trackerRetentionDays={too_long} deploys, then the app fails indexing (every function): {exc}"
        )


def _shortest_key_the_app_accepts() -> int:
    for length in range(64):
        try:
            QueueingSettings(api_key="k" * length)
        except ValueError:
            continue
        return length
    raise AssertionError("the kit accepts no key of up to 63 characters")


def test_the_template_refuses_the_keys_too_short_for_the_app() -> None:
    shortest = _shortest_key_the_app_accepts()
    assert decorators(parsed(MAIN)["parameters"]["apiKey"]).get("min_length") == shortest
    with pytest.raises(DeploymentRefused, match="apiKey is shorter than its minimum length"):
        deploy(apiKey="k" * (shortest - 1))
    deploy(apiKey="k" * shortest)


@pytest.mark.parametrize("provider", ["servicebus", "storage_queue"])
@pytest.mark.parametrize(
    "key", ["a-key-pasted-with-its-newline\n", " a-key-with-a-leading-space", "a-key-with\ta-tab"]
)
def test_an_api_key_the_template_accepts_stops_no_trigger(monkeypatch, provider, key) -> None:
    from functions import build_app
    from tests.functions.conftest import functions_of

    prov = Provisioned.deploy(queueingProvider=provider, apiKey=key)  # the template has no pattern check
    assert prov.settings["QUEUEING_API_KEY"] == key  # Key Vault hands it over unchanged
    for name in list(os.environ):
        if name.startswith(("QUEUEING_", "Queueing", "AzureWebJobs")):
            monkeypatch.delenv(name)
    for name, value in prov.settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)  # host.json next to function_app.py, as deployed
    names = set(functions_of(build_app(env=dict(prov.settings))))  # as function_app.py builds it
    prefix = "servicebus" if provider == "servicebus" else "queue"
    assert {f"{prefix}_order_placed", "queueing_retention", "http_app_func"} <= names, names
