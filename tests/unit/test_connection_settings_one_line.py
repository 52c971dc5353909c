"""A connection setting the SDK refuses stops start-up with one line naming the setting (exit 2).

Found in review: a malformed ``QueueingServiceBus`` connection string, ``QUEUEING_SQS_REGION='us east 1'``
and ``QUEUEING_SQS_ENDPOINT_URL='not a url'`` stopped `queueing serve` with the SDK's traceback and
exit 1, where the configuration reference promises one line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from queueing_core.connections import ServiceBusConnection
from queueing_core.errors import ConfigurationError
from queueing_core.providers.sqs import SqsProvider
from queueing_core.settings import QueueingSettings

ROOT = Path(__file__).resolve().parents[2]
SECRET = "TOPSECRETKEY123="


@pytest.mark.parametrize(
    "connection_string",
    [
        f"SharedAccessKeyName=RootManageSharedAccessKey;SharedAccessKey={SECRET}",
        "TOPSECRETKEY123",
        f"Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKey={SECRET}",
        f"Endpoint=ns;SharedAccessKeyName=k;SharedAccessKey={SECRET}",
    ],
)
def test_a_malformed_service_bus_connection_string(connection_string: str) -> None:
    connection = ServiceBusConnection.from_environment("QueueingBus", {"QueueingBus": connection_string})
    with pytest.raises(ConfigurationError) as caught:
        connection.clients()
    assert caught.value.setting == "QueueingBus"
    assert "invalid connection string" in str(caught.value)
    assert "TOPSECRETKEY123" not in str(caught.value)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An AWS configuration of the test's own, keys in the environment (no look further for any)."""
    for name in ("QUEUEING_SQS_REGION", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "aws-config").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"sqs_region": "us east 1"}, "QUEUEING_SQS_REGION"),
        ({"sqs_region": "  "}, "QUEUEING_SQS_REGION"),
        ({"sqs_endpoint_url": "not a url"}, "QUEUEING_SQS_ENDPOINT_URL"),
    ],
)
def test_an_sqs_region_or_endpoint_botocore_refuses(
    overrides: dict[str, str], setting: str, aws_env: None, tmp_path: Path
) -> None:
    settings = QueueingSettings(provider="sqs", database_url=f"sqlite:///{tmp_path}/side.db", **overrides)
    with pytest.raises(ConfigurationError) as caught:
        SqsProvider.from_settings(settings)
    assert caught.value.setting == setting


def test_a_region_from_the_aws_configuration_is_named_too(
    aws_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu west 2")
    settings = QueueingSettings(provider="sqs", database_url=f"sqlite:///{tmp_path}/side.db")
    with pytest.raises(ConfigurationError) as caught:
        SqsProvider.from_settings(settings)
    assert caught.value.setting == "QUEUEING_SQS_REGION"
    assert "AWS configuration" in str(caught.value)


def test_serve_says_it_in_one_line_and_exits_2(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "QUEUEING_PROVIDER": "servicebus",
        "QueueingServiceBus": f"Endpoint=ns;SharedAccessKeyName=k;SharedAccessKey={SECRET}",
        "QueueingStorage": "UseDevelopmentStorage=true",
    }
    done = subprocess.run(
        [sys.executable, "-m", "queueing_core.cli", "serve", "--no-api"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "QueueingServiceBus: invalid connection string" in done.stdout + done.stderr
    assert "TOPSECRETKEY123" not in done.stdout + done.stderr
