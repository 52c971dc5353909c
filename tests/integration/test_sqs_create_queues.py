"""``QUEUEING_SQS_CREATE_QUEUES=false``: a role without ``sqs:CreateQueue`` / ``sqs:SetQueueAttributes``
opens on queues provisioned for it, and a queue that is missing stops the start naming it.

The provider could always be built with ``auto_create=False``, but no setting reached it, so a
least-privilege deployment could not open at all (found in review)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

import tests.contract.harness  # noqa: F401  (first: it imports harness_sqs itself)
from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.errors import ConfigurationError
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from tests.contract.harness import all_have, running, wait_until
from tests.contract.harness_sqs import moto_endpoint, sqs_client
from tests.services import fresh_prefix


@queue("Provisioned.Jobs", lease_duration=timedelta(seconds=20))
class Job(QueueMessage):
    n: int


def _provider(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> tuple[SqsProvider, list[str]]:
    """The provider as a host builds it, from the environment, and the SQS operations it calls."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("QUEUEING_PROVIDER", "sqs")
    monkeypatch.setenv("QUEUEING_SQS_ENDPOINT_URL", moto_endpoint())
    monkeypatch.setenv("QUEUEING_SQS_REGION", "us-east-1")
    monkeypatch.setenv("QUEUEING_SQS_CREATE_QUEUES", "false")
    monkeypatch.setenv("QUEUEING_DATABASE_URL", f"sqlite:///{tmp_path}/side.db")
    settings = QueueingSettings()
    assert settings.sqs_create_queues is False
    provider = SqsProvider.from_settings(settings)
    calls: list[str] = []
    provider.client.meta.events.register(
        "provide-client-params.sqs.*", lambda model, **_: calls.append(model.name)
    )
    return provider, calls


def _app(prefix: str) -> QueueingApp:
    app = QueueingApp("provisioned", naming=QueueNaming(prefix=prefix))

    async def handle(msg: Job, ctx: Any) -> None:
        pass

    app.handler(Job)(handle)
    return app


def _cleanup(client: Any, prefix: str) -> None:
    for url in client.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
        client.delete_queue(QueueUrl=url)


async def test_a_missing_queue_is_named_and_nothing_is_created(monkeypatch, tmp_path) -> None:
    prefix = fresh_prefix()
    client = sqs_client()
    app = _app(prefix)
    provider, calls = _provider(monkeypatch, tmp_path)
    physical = app.naming.physical("Provisioned.Jobs", provider.transport)
    try:
        with pytest.raises(ConfigurationError) as caught:
            await provider.open(app)
        text = str(caught.value)
        assert physical in text, text
        assert f"{physical}-dlq" not in text, text  # the queue itself is the one missing
        assert "QUEUEING_SQS_CREATE_QUEUES" in text, text
        assert "us-east-1" in text, text
        assert {"CreateQueue", "SetQueueAttributes"}.isdisjoint(calls), calls
        assert client.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []) == []
        await provider.close()

        # the queue provisioned, its dead-letter queue not: that one is named (it would fail the
        # first dead letter otherwise)
        client.create_queue(QueueName=physical)
        provider, calls = _provider(monkeypatch, tmp_path)
        with pytest.raises(ConfigurationError) as caught:
            await provider.open(app)
        assert f"{physical}-dlq" in str(caught.value), str(caught.value)
        assert "CreateQueue" not in calls, calls
    finally:
        await provider.close()
        _cleanup(client, prefix)


async def test_provisioned_queues_open_without_creating_or_changing_them(monkeypatch, tmp_path) -> None:
    prefix = fresh_prefix()
    client = sqs_client()
    app = _app(prefix)
    provider, calls = _provider(monkeypatch, tmp_path)
    physical = app.naming.physical("Provisioned.Jobs", provider.transport)
    dlq = client.create_queue(QueueName=f"{physical}-dlq")["QueueUrl"]
    url = client.create_queue(QueueName=physical, Attributes={"VisibilityTimeout": "45"})["QueueUrl"]
    rt = Runtime(app, provider)
    try:
        await rt.open()
        # left as provisioned: the kit did not bring it to its own settings
        attrs = client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        assert attrs["VisibilityTimeout"] == "45"
        assert "RedrivePolicy" not in attrs
        assert {"CreateQueue", "SetQueueAttributes"}.isdisjoint(calls), calls
        assert calls.count("GetQueueUrl") == 2, calls  # the queue and its dead-letter queue
        assert dlq in provider._urls.values()
        # and it works: a message sent, run and deleted, with only the rights a worker needs
        r = await app.enqueue(Job(n=1))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED.value), what="run")
        assert {"CreateQueue", "SetQueueAttributes"}.isdisjoint(calls), calls
    finally:
        await rt.close()
        _cleanup(client, prefix)
