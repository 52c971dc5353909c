"""OpenTelemetry: a trace that crosses a process boundary through the envelope, messaging attributes,
metrics, the Functions host's trace continued, and nothing imported when it is off."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(role: str, url: str, out: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.otel_proc", role, url, str(out)],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("QUEUEING_")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_producer_span_and_the_handler_span_in_another_process_share_one_trace(tmp_path):
    url = f"sqlite:///{tmp_path}/q.db"
    run("produce", url, tmp_path / "produced.json")
    run("consume", url, tmp_path / "consumed.json")
    [create] = json.loads((tmp_path / "produced.json").read_text())
    [process] = json.loads((tmp_path / "consumed.json").read_text())
    assert create["kind"] == "PRODUCER"
    assert create["name"] == "create traced"
    assert process["kind"] == "CONSUMER"
    assert process["name"] == "process traced"
    assert process["trace_id"] == create["trace_id"]
    assert process["parent_id"] == create["span_id"]
    for span in (create, process):
        assert span["attributes"]["messaging.system"] == "sql"
        assert span["attributes"]["messaging.destination.name"] == "traced"
    assert process["attributes"]["messaging.message.id"] == create["attributes"]["messaging.message.id"]
    assert process["attributes"]["queueing.attempt"] == 1
    assert process["attributes"]["queueing.outcome"] == "succeeded"


def test_without_opentelemetry_switched_on_nothing_of_it_is_imported(tmp_path):
    assert (
        importlib.util.find_spec("opentelemetry") is not None
    )  # installed here, so the check means something
    loaded = json.loads(run("plain", f"sqlite:///{tmp_path}/q.db", tmp_path / "unused.json"))
    assert loaded == []
