"""Where the real services are, and whether a missing one skips or fails (CI sets
QUEUEING_REQUIRE_SERVICES=1 so nothing is silently skipped there)."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

POSTGRES_URL = os.environ.get("QUEUEING_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RABBITMQ_URL = os.environ.get("QUEUEING_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


def reachable(host: str, port: int) -> bool:
    try:
        # generous: a service that is up but slow to accept on a loaded machine must not skip tests
        with socket.create_connection((host, port), timeout=10):
            return True
    except OSError:
        return False


def require(name: str, host: str, port: int) -> None:
    if reachable(host, port):
        return
    message = f"{name} is not answering on {host}:{port} (scripts/services.sh starts it)"
    if os.environ.get("QUEUEING_REQUIRE_SERVICES") == "1":
        pytest.fail(message)
    pytest.skip(message)


async def drop_schema(schema: str) -> None:
    """Remove a test's PostgreSQL schema and everything in it."""
    import sqlalchemy as sa

    from queueing_core.providers.sql import create_engine

    engine = create_engine(POSTGRES_URL)
    async with engine.begin() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    await engine.dispose()


#: the queue-name prefixes this test session handed out: only these are cleaned up at its end, so
#: sessions running side by side on one broker never delete each other's queues
SESSION_PREFIXES: set[str] = set()


def fresh_prefix() -> str:
    """A fresh ``t<8 hex>-`` prefix for a test's queue names, remembered for the session's clean-up."""
    prefix = f"t{uuid.uuid4().hex[:8]}-"
    SESSION_PREFIXES.add(prefix)
    return prefix
