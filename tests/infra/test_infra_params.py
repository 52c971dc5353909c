"""Code and infrastructure agree: `queueing infra params` generates the queue block from
the registry, and every queue a Functions trigger binds and every connection it reads is in the Bicep."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

from functions import build_app
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ConfigurationError
from queueing_core.infra import iso_duration, render
from queueing_core.settings import QueueingSettings

from ..functions.conftest import bindings, functions_of
from .bicep_tools import ROOT, module_file, read_bicepparam, resources_of

PARAMS = ROOT / "infra" / "main.bicepparam"


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUEUEING_")}
    return subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", "infra", "params", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_committed_parameters_match_the_code():
    done = cli("--app", "queueing_core.examples.orders:app", "--check")
    assert done.returncode == 0, done.stderr


def test_params_rewrites_only_the_generated_block(tmp_path):
    copy = tmp_path / "main.bicepparam"
    shutil.copy(PARAMS, copy)
    text = copy.read_text().replace("maxDeliveryCount: 5", "maxDeliveryCount: 9")  # someone edited it by hand
    copy.write_text(text)
    assert cli("--app", "queueing_core.examples.orders:app", "--file", str(copy), "--check").returncode == 1
    done = cli("--app", "queueing_core.examples.orders:app", "--file", str(copy))
    assert done.returncode == 0
    assert "updated" in done.stdout
    assert copy.read_text() == PARAMS.read_text()


def test_iso_durations():
    assert iso_duration(timedelta(seconds=30)) == "PT30S"
    assert iso_duration(timedelta(minutes=1)) == "PT1M"
    assert iso_duration(timedelta(hours=4, minutes=30)) == "PT4H30M"
    assert iso_duration(timedelta(days=2, seconds=1.5)) == "P2DT1.5S"
    assert iso_duration(timedelta(days=7)) == "P7D"


def test_a_name_or_setting_the_services_would_reject_fails_with_the_rule():
    @queue("x" * 60)  # fits Storage's 63, but '<name>-poison' does not
    class Long(QueueMessage):
        pass

    app = QueueingApp()
    app.message(Long)
    with pytest.raises(ConfigurationError, match="length must be 3-63"):
        render(app)

    @queue("greedy", max_attempts=5000)
    class Greedy(QueueMessage):
        pass

    app2 = QueueingApp()
    app2.message(Greedy)
    with pytest.raises(ConfigurationError, match="max delivery count of 1-2000"):
        render(app2)

    # 2000 attempts would leave the kit no delivery of its own under the limit (a review found it)
    @queue("greedy-by-one", max_attempts=2000)
    class GreedyByOne(QueueMessage):
        pass

    app3 = QueueingApp()
    app3.message(GreedyByOne)
    with pytest.raises(ConfigurationError, match="at most 1999"):
        render(app3)


def test_the_cli_reports_the_rule_with_exit_2(tmp_path):
    (tmp_path / "badapp.py").write_text(
        textwrap.dedent("""
        from queueing_core import QueueingApp, QueueMessage, queue
        @queue("y" * 60)
        class Y(QueueMessage):
            pass
        app = QueueingApp()
        app.message(Y)
    """)
    )
    shutil.copy(PARAMS, tmp_path / "p.bicepparam")
    done = cli("--app", "badapp:app", "--file", str(tmp_path / "p.bicepparam"), cwd=tmp_path)
    assert done.returncode == 2
    assert "length must be 3-63" in done.stderr


@pytest.mark.parametrize("provider", ["storage_queue", "servicebus"])
def test_every_trigger_queue_and_connection_exists_in_the_bicep(provider):
    env = {
        "QueueingStorage": "UseDevelopmentStorage=true",
        "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net",
    }
    fns = functions_of(build_app(QueueingSettings(provider=provider), env=env))
    triggers = [
        b for f in fns.values() for b in bindings(f) if b["type"] in ("queueTrigger", "serviceBusTrigger")
    ]
    assert len(triggers) == 3
    params = read_bicepparam(PARAMS).generated
    sb_names = {q["name"] for q in params["serviceBusQueues"]}
    storage_names = set(params["storageQueues"])
    app_settings = app_setting_names()
    for b in triggers:
        if b["type"] == "serviceBusTrigger":
            assert b["queueName"] in sb_names
        else:
            assert b["queueName"] in storage_names
        # an identity-based connection: <connection>__fullyQualifiedNamespace / __queueServiceUri
        conn = b["connection"]
        assert any(name.startswith(f"{conn}__") for name in app_settings), (conn, sorted(app_settings))
    assert {
        "QueueingStorage__queueServiceUri",
        "QueueingStorage__tableServiceUri",
        "QueueingServiceBus__fullyQualifiedNamespace",
    } <= app_settings
    # every Storage queue also gets its -poison queue in the storage module
    storage = module_file("storage")
    assert resources_of(storage, "Microsoft.Storage/storageAccounts/queueServices/queues")


def app_setting_names() -> set[str]:
    from .test_bicep import _app_settings

    always, conditional_settings = _app_settings()
    return set(always) | set(conditional_settings)
