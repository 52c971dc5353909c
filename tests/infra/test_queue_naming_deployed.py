"""The queues a deployment provisions are the queues its Function App binds, with and without a queue
prefix or suffix.

``build_app`` composes ``QUEUEING_QUEUE_PREFIX`` / ``QUEUEING_QUEUE_SUFFIX`` into every trigger's queue
name; the queues come from ``serviceBusQueues`` / ``storageQueues``, the block `queueing infra params`
generates. The template took ``queuePrefix`` / ``queueSuffix`` as parameters of their own, which nothing
tied to the lists: deploying with ``queuePrefix=dev-`` provisioned ``capture-payment`` while the
triggers bound ``dev-capture-payment`` (found in review). The generated block now writes both with the
lists, from the same settings, so a deployment of what the generator wrote always agrees."""

from __future__ import annotations

import shutil

import pytest

from functions import build_app
from queueing_core.settings import load_settings
from tests.functions.conftest import bindings, functions_of
from tests.infra.bicep_tools import API_KEY_VARIABLE, PARAMS, build_params, read_bicepparam
from tests.infra.deployment import deploy

TRIGGERS = {"serviceBusTrigger": "serviceBus", "queueTrigger": "storage"}


def _provisioned_queue_names(deployment, module: str) -> set[str]:
    queues = deployment.scope_of(module).lookup("queues")
    return {q["name"] if isinstance(q, dict) else q for q in queues}


def _bound_queue_names(monkeypatch, settings: dict[str, str]) -> dict[str, set[str]]:
    """What function_app.py binds when the host hands it exactly these app settings."""
    import os

    for key in list(os.environ):
        if key.startswith(("QUEUEING_", "Queueing", "AzureWebJobs")):
            monkeypatch.delenv(key)
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    from queueing_core.examples import orders

    saved = orders.app.naming  # build_app names the app's queues with the prefix: put it back after
    try:
        app = build_app(load_settings(), env=dict(settings))
    finally:
        orders.app.naming = saved
    bound: dict[str, set[str]] = {}
    for fn in functions_of(app).values():
        for b in bindings(fn):
            if b["type"] in TRIGGERS:
                bound.setdefault(TRIGGERS[b["type"]], set()).add(b["queueName"])
    return bound


def _generated(tmp_path, prefix: str, suffix: str) -> dict:
    """The parameters file as `queueing infra params` writes it with this prefix and suffix set."""
    from queueing_core.examples.orders import app
    from queueing_core.infra import render, update
    from queueing_core.naming import QueueNaming

    params = tmp_path / "main.bicepparam"
    shutil.copy(PARAMS, params)
    saved = app.naming
    app.naming = QueueNaming(prefix, suffix)  # what the CLI does with QUEUEING_QUEUE_PREFIX/SUFFIX set
    try:
        update(params, render(app))
    finally:
        app.naming = saved
    return build_params(read_bicepparam(params), {API_KEY_VARIABLE: "test-ops-key"})


@pytest.mark.parametrize("provider", ["servicebus", "storage_queue"])
@pytest.mark.parametrize(
    ("prefix", "suffix"), [("", ""), ("dev-", ""), ("", "-blue")], ids=["no-prefix", "prefix", "suffix"]
)
def test_every_trigger_binds_a_queue_the_deployment_provisions(
    monkeypatch, tmp_path, provider, prefix, suffix
):
    parameters = {**_generated(tmp_path, prefix, suffix), "queueingProvider": provider}
    deployment = deploy(**parameters)
    settings = deployment.app_settings
    assert (settings.get("QUEUEING_QUEUE_PREFIX", ""), settings.get("QUEUEING_QUEUE_SUFFIX", "")) == (
        prefix,
        suffix,
    )
    bound = _bound_queue_names(monkeypatch, settings)
    assert bound, "no queue trigger was registered"
    for module, names in bound.items():
        provisioned = _provisioned_queue_names(deployment, module)
        missing = names - provisioned
        assert not missing, (
            f"queueingProvider={provider} prefix={prefix!r} suffix={suffix!r}: the app binds "
            f"{sorted(missing)} but the {module} module provisions only {sorted(provisioned)}"
        )
