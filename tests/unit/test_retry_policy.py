"""Every SDK client the kit builds retries the worker's way (short, capped backoff), not the SDKs'
defaults (Storage Queues: 15 s, 18 s, 24 s between tries, which kept a worker idle 14 s after a 5 s
outage). The recovery itself is measured by bench/outage_recovery.py."""

from __future__ import annotations

from queueing_core import retry_policy
from queueing_core.connections import ServiceBusConnection, StorageConnection
from queueing_core.providers.storage_queue import StorageQueueProvider

AZURITE = "UseDevelopmentStorage=true"


def test_storage_queues_and_tables_retry_briefly():
    provider = StorageQueueProvider(StorageConnection.from_environment(env={"QueueingStorage": AZURITE}))
    queue_policy = provider._service._config.retry_policy
    assert queue_policy.initial_backoff == 1
    assert queue_policy.increment_base == 2
    assert queue_policy.total_retries == retry_policy.RETRIES
    table_policy = provider.tracker()._table.client._client._config.retry_policy
    assert table_policy.backoff_max == retry_policy.BACKOFF_MAX
    assert table_policy.total_retries == retry_policy.RETRIES


def test_service_bus_retries_briefly():
    conn = ServiceBusConnection(
        "Endpoint=sb://kit.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=c2VjcmV0"
    )
    client, _admin, _ = conn.clients()
    assert client._config.retry_total == retry_policy.RETRIES
    assert client._config.retry_backoff_max == retry_policy.BACKOFF_MAX


def test_sqs_retries_briefly():
    config = retry_policy.boto3_config()
    assert config.retries == {"mode": "standard", "total_max_attempts": retry_policy.RETRIES + 1}
    assert config.connect_timeout == retry_policy.CONNECT_TIMEOUT
