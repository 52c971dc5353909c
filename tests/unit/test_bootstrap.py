"""``QUEUEING_PROVIDER`` maps to the right provider, built without connecting to anything."""

from __future__ import annotations

import pytest

from queueing_core.bootstrap import make_provider
from queueing_core.naming import Transport
from queueing_core.settings import QueueingSettings


@pytest.mark.parametrize(
    ("name", "transport"),
    [
        ("inprocess", Transport.INPROCESS),
        ("sql", Transport.SQL),
        ("rabbitmq", Transport.RABBITMQ),
        ("sqs", Transport.SQS),
    ],
)
def test_each_provider_setting_builds_its_provider_offline(name, transport, tmp_path):
    # an unroutable broker/endpoint: building must not touch them (connections open on runtime.open)
    cfg = QueueingSettings(
        provider=name,
        database_url=f"sqlite:///{tmp_path}/kit.db",
        rabbitmq_url="amqp://nobody:secret@192.0.2.1:5672/",
        sqs_endpoint_url="http://192.0.2.1:1",
    )
    provider = make_provider(cfg)
    assert provider.transport is transport
    assert not (tmp_path / "kit.db").exists()  # nothing opened the database either


def test_storage_queues_use_the_sql_delayed_store_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("QueueingStorage", "UseDevelopmentStorage=true")
    plain = make_provider(QueueingSettings(provider="storage_queue"))
    assert plain.delayed is None
    assert plain.background_tasks() == []
    cfg = QueueingSettings(
        provider="storage_queue", storage_delayed_store=True, database_url=f"sqlite:///{tmp_path}/d.db"
    )
    stored = make_provider(cfg)
    assert stored.delayed is not None
    assert len(stored.background_tasks()) == 1
