"""The deployment files agree with what the app reads."""

from __future__ import annotations

import json
from pathlib import Path

from queueing_core.settings import QueueingSettings

ROOT = Path(__file__).resolve().parents[2]


def test_local_settings_sample_lists_every_setting_and_each_one_parses(monkeypatch):
    values = json.loads((ROOT / "local.settings.sample.json").read_text())["Values"]
    read = {f"QUEUEING_{name.upper()}" for name in QueueingSettings.model_fields}
    assert read <= set(values), sorted(read - set(values))
    assert {
        "QueueingStorage",
        "QueueingServiceBus",
        "AzureWebJobsStorage",
        "FUNCTIONS_WORKER_RUNTIME",
    } <= set(values)
    assert values["QueueingStorage"] == "UseDevelopmentStorage=true"  # Azurite
    for key, value in values.items():  # read as the Functions host provides them: environment variables
        if key.startswith("QUEUEING_") and value != "":
            monkeypatch.setenv(key, value)
    parsed = QueueingSettings()  # every sample value is a valid value
    assert parsed.provider == "storage_queue"


def test_host_json_matches_the_chosen_settlement():
    host = json.loads((ROOT / "host.json").read_text())
    assert host["version"] == "2.0"
    assert host["extensionBundle"] == {
        "id": "Microsoft.Azure.Functions.ExtensionBundle",
        "version": "[4.*, 5.0.0)",
    }
    ext = host["extensions"]
    assert ext["http"]["routePrefix"] == "api"  # the ops routes are /api/_system/queueing/...
    assert ext["serviceBus"]["autoCompleteMessages"] is False  # explicit settlement (dead-letter with reason)
    # the text as it is: the kit reads base64 (what it writes) and another producer's plain text
    assert ext["queues"]["messageEncoding"] == "none"
    # the host's poison only for the kit's own failures: above every queue's max_attempts (the example
    # app's largest is the default, 5), so a message whose runs all died reaches the kit once more
    assert ext["queues"]["maxDequeueCount"] == 6


def test_requirements_cover_every_sdk_the_app_can_load():
    reqs = (ROOT / "requirements.txt").read_text()
    for package in (
        "azure-functions",
        "pydantic",
        "pydantic-settings",
        "azure-storage-queue",
        "azure-data-tables",
        "azure-identity",
        "azure-servicebus",
        "azurefunctions-extensions-bindings-servicebus",
        "sqlalchemy",
        "psycopg",
        "fastapi",
    ):
        assert package in reqs, package
    ignored = (ROOT / ".funcignore").read_text().split()
    assert {"tests", "bench", "infra", ".venv", "local.settings.json"} <= set(ignored)
