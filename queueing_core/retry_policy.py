"""How every SDK client retries and waits: short, capped backoff, in one place.

The SDKs' defaults suit a script that calls a service once and may wait minutes for it. A worker
is the opposite: it calls all the time and has its own outer retry (the next poll, the settler's
retries, the history backlog), so a request that fails should fail fast and the next one go out
soon after the service is back. The defaults that hurt most: the Storage Queues SDK waits 15 s, then
18 s, then 24 s between tries (the Storage Queues worker stayed idle 14 s after a 5 s outage), and the
Tables SDK retries ten times with up to 120 s between tries.

Nothing here imports an SDK at module level: a host loads only the SDKs of its transport.
"""

from __future__ import annotations

from typing import Any

#: seconds to wait for a TCP connection (a stopped service answers nothing: do not wait minutes)
CONNECT_TIMEOUT = 5
#: seconds to wait for an answer to one request (no call the kit makes is a long poll over 20 s)
READ_TIMEOUT = 30
#: tries after the first one, in every SDK
RETRIES = 3
#: the first pause between tries and the longest (seconds)
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 4.0


def azure_storage_queue() -> dict[str, Any]:
    """Keyword arguments for ``QueueServiceClient``: exponential 1 s, 3 s, 5 s (base 2), three tries."""
    return {
        "retry_total": RETRIES,
        "initial_backoff": 1,
        "increment_base": 2,
        "random_jitter_range": 1,
        "connection_timeout": CONNECT_TIMEOUT,
        "read_timeout": READ_TIMEOUT,
    }


def azure_tables() -> dict[str, Any]:
    """Keyword arguments for ``TableClient`` (azure-core's retry policy): 0.5 s doubling up to 4 s."""
    return {
        "retry_total": RETRIES,
        "retry_backoff_factor": BACKOFF_FIRST,
        "retry_backoff_max": BACKOFF_MAX,
        "connection_timeout": CONNECT_TIMEOUT,
        "read_timeout": READ_TIMEOUT,
    }


def service_bus() -> dict[str, Any]:
    """Keyword arguments for ``ServiceBusClient`` and its administration client."""
    return {
        "retry_total": RETRIES,
        "retry_backoff_factor": BACKOFF_FIRST,
        "retry_backoff_max": BACKOFF_MAX,
    }


def boto3_config(**more: Any) -> Any:
    """The botocore ``Config`` of the SQS client: standard retry mode (throttling-aware), capped tries."""
    from botocore.config import Config

    return Config(
        retries={"mode": "standard", "total_max_attempts": RETRIES + 1},
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=READ_TIMEOUT,
        **more,
    )


#: RabbitMQ: first wait between reconnect attempts of ``connect_robust`` (seconds)
AMQP_RECONNECT = 1.0
#: PostgreSQL: libpq's connect timeout (seconds) for every new pool connection
PG_CONNECT_TIMEOUT = CONNECT_TIMEOUT
