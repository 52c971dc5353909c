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
    # no default session yet, as in a fresh process (a test before this one that built a client with
    # ``boto3.client`` left one, with the AWS configuration of its time, which the kit would use)
    import boto3

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
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


def test_the_default_session_an_application_set_up_is_used(aws_env: Path, monkeypatch, tmp_path) -> None:
    """``boto3.setup_default_session`` (keys, a profile, an assumed role) is what ``boto3.client``
    uses; the kit's own session ignored it for the environment's credentials (found in review)."""
    import boto3

    boto3.setup_default_session(
        aws_access_key_id="AKIAAPPCONFIGURED", aws_secret_access_key="secret", region_name="eu-west-1"
    )
    settings = QueueingSettings(provider="sqs", database_url=f"sqlite:///{tmp_path}/side.db")
    client = SqsProvider.from_settings(settings).client
    assert client._request_signer._credentials.access_key == "AKIAAPPCONFIGURED"
    assert client.meta.region_name == "eu-west-1"


def test_a_region_from_the_aws_configuration_is_said_at_start(
    aws_env: Path, monkeypatch, tmp_path, caplog
) -> None:
    """Earlier versions used us-east-1 whatever the AWS configuration said: a deployment that relied
    on it would start on empty queues of its region, its messages waiting in us-east-1 (found in
    review). Said at start, until QUEUEING_SQS_REGION says which."""
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    with caplog.at_level("WARNING", logger="queueing.sqs"):
        assert _region(tmp_path) == "eu-west-1"
    assert any("QUEUEING_SQS_REGION is not set" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setenv("QUEUEING_SQS_REGION", "eu-west-1")
    with caplog.at_level("WARNING", logger="queueing.sqs"):
        assert _region(tmp_path) == "eu-west-1"
    assert not caplog.records
