"""checkov over infra/: no failed checks, and the kit's own checks (infra/checks) really fire.

checkov lives in its own virtual environment (it pins an old pycep-parser and boto3):
``scripts/checkov.sh`` creates ``.checkov-venv`` on first use. These tests only run once it exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.infra.bicep_tools import INFRA, ROOT

CHECKOV = ROOT / ".checkov-venv" / "bin" / "checkov"
SCRIPT = ROOT / "scripts" / "checkov.sh"
CUSTOM_CHECKS = {"CKV_QK_1", "CKV_QK_2", "CKV_QK_3"}

pytestmark = pytest.mark.skipif(
    not CHECKOV.exists(),
    reason="checkov is not installed: run scripts/checkov.sh once to create .checkov-venv",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    return env


def _checkov_json(directory: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [
            str(CHECKOV),
            "-d",
            str(directory),
            "--framework",
            "bicep",
            "--skip-download",
            "--compact",
            "--external-checks-dir",
            str(directory / "checks"),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        check=False,
    )
    report = json.loads(proc.stdout)
    if isinstance(report, list):  # one entry per framework
        report = next(r for r in report if r.get("check_type") == "bicep")
    return proc.returncode, report


def test_script_passes_on_the_real_infra() -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(), check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Failed checks: 0" in proc.stdout, proc.stdout


def test_report_parses_every_file_and_justifies_every_suppression() -> None:
    code, report = _checkov_json(INFRA)
    assert code == 0
    summary = report["summary"]
    assert summary["failed"] == 0
    assert summary["parsing_errors"] == 0, "checkov's own pycep could not parse a file: it would go unchecked"
    passed = {c["check_id"] for c in report["results"]["passed_checks"]}
    assert {"CKV_QK_1", "CKV_QK_3"} <= passed, "the kit's checks did not run"
    for skipped in report["results"]["skipped_checks"]:
        comment = skipped.get("check_result", {}).get("suppress_comment", "")
        assert len(comment.strip()) > 20, f"{skipped['check_id']} is suppressed without a justification"


def test_custom_checks_fire_on_a_violating_copy(tmp_path: Path) -> None:
    infra = tmp_path / "infra"
    shutil.copytree(INFRA, infra, ignore=shutil.ignore_patterns("__pycache__"))

    servicebus = infra / "modules" / "servicebus.bicep"
    text = servicebus.read_text(encoding="utf-8")
    # the looped queue stops dead-lettering expired messages ...
    text = text.replace("deadLetteringOnMessageExpiration: true", "deadLetteringOnMessageExpiration: false")
    assert "deadLetteringOnMessageExpiration: false" in text
    # ... and two literal queues break the delivery-count rule (out of range, missing).
    text += """
resource zeroDeliveries 'Microsoft.ServiceBus/namespaces/queues@2024-01-01' = {
  parent: namespace
  name: 'zero-deliveries'
  properties: {
    maxDeliveryCount: 0
    deadLetteringOnMessageExpiration: true
  }
}

resource noDeliveryCount 'Microsoft.ServiceBus/namespaces/queues@2024-01-01' = {
  parent: namespace
  name: 'no-delivery-count'
  properties: {
    deadLetteringOnMessageExpiration: true
  }
}
"""
    servicebus.write_text(text, encoding="utf-8")
    storage = infra / "modules" / "storage.bicep"
    storage.write_text(
        storage.read_text(encoding="utf-8").replace(
            "minimumTlsVersion: 'TLS1_2'", "minimumTlsVersion: 'TLS1_0'"
        ),
        encoding="utf-8",
    )

    code, report = _checkov_json(infra)

    assert code == 1
    failed = {(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]}
    assert ("CKV_QK_1", "Microsoft.ServiceBus/namespaces/queues.queue") in failed
    assert ("CKV_QK_2", "Microsoft.ServiceBus/namespaces/queues.zeroDeliveries") in failed
    assert ("CKV_QK_2", "Microsoft.ServiceBus/namespaces/queues.noDeliveryCount") in failed
    assert ("CKV_QK_3", "Microsoft.Storage/storageAccounts.account") in failed
    passed = {(c["check_id"], c["resource"]) for c in report["results"]["passed_checks"]}
    assert ("CKV_QK_1", "Microsoft.ServiceBus/namespaces/queues.zeroDeliveries") in passed
    assert {check for check, _ in failed} >= CUSTOM_CHECKS
