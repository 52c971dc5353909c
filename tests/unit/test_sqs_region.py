"""The SQS region: the kit's own setting, else the standard AWS configuration, else us-east-1.

``QUEUEING_SQS_REGION`` used to default to us-east-1 and be passed to boto3 always, so a deployment in
another region that set only the standard AWS variables (or a profile's region) created and used its
queues, and stored its messages, in us-east-1 (found in review). No server is needed: the client
built by ``from_settings`` says which region it is for."""

from __future__ import annotations

from pathlib import Path

import pytest

from queueing_core.providers.sqs import SqsProvider
from queueing_core.settings import QueueingSettings


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An AWS configuration with nothing in it: no region variables, empty config files (the test's
    own), keys in the environment so building a client never looks further for credentials."""
    for name in (
        "QUEUEING_SQS_REGION",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "aws-config"
    config.write_text("")
    (tmp_path / "aws-credentials").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return config


def _region(tmp_path: Path, **overrides: str) -> str:
    settings = QueueingSettings(provider="sqs", database_url=f"sqlite:///{tmp_path}/side.db", **overrides)
    return str(SqsProvider.from_settings(settings).client.meta.region_name)


def test_the_standard_variables_name_the_region(aws_env: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert _region(tmp_path) == "eu-west-1"


def test_aws_default_region_alone(aws_env: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-north-1")
    assert _region(tmp_path) == "eu-north-1"


def test_aws_region_alone(aws_env: Path, monkeypatch, tmp_path) -> None:
    """What AWS's runtimes set and the other SDKs read; botocore reads only AWS_DEFAULT_REGION."""
    monkeypatch.setenv("AWS_REGION", "ap-southeast-2")
    assert _region(tmp_path) == "ap-southeast-2"


def test_the_profiles_region(aws_env: Path, monkeypatch, tmp_path) -> None:
    aws_env.write_text("[default]\nregion = eu-central-1\n\n[profile other]\nregion = sa-east-1\n")
    assert _region(tmp_path) == "eu-central-1"
    monkeypatch.setenv("AWS_PROFILE", "other")
    assert _region(tmp_path) == "sa-east-1"


def test_us_east_1_when_nothing_names_one(aws_env: Path, monkeypatch, tmp_path) -> None:
    assert _region(tmp_path) == "us-east-1"
    monkeypatch.setenv("QUEUEING_SQS_REGION", "")  # an empty value counts as not set
    assert _region(tmp_path) == "us-east-1"


def test_the_kits_setting_comes_first(aws_env: Path, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.setenv("QUEUEING_SQS_REGION", "us-west-2")
    assert _region(tmp_path) == "us-west-2"
    assert _region(tmp_path, sqs_region="ca-central-1") == "ca-central-1"
