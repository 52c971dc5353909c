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


#: the SQLSTATE of a lock not granted within ``lock_timeout``
LOCK_NOT_AVAILABLE = "55P03"

#: the sessions that hold a granted lock on a relation of the schema
_HOLDERS = """
SELECT DISTINCT a.pid, a.state, a.application_name, a.xact_start, left(a.query, 200) AS query
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE n.nspname = :schema AND l.granted AND a.pid <> pg_backend_pid()
"""


async def drop_schema(schema: str, *, lock_timeout: float = 60.0) -> None:
    """Remove a test's PostgreSQL schema and everything in it. A session still in a transaction on
    its tables (a connection the test or the code under it left open) holds locks the drop waits for:
    after ``lock_timeout`` seconds this fails naming those sessions, rather than hanging the test
    until its timeout with nothing to say why."""
    import sqlalchemy as sa

    from queueing_core.providers.sql import create_engine

    engine = create_engine(POSTGRES_URL)
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'"))
            await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    except sa.exc.DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        async with engine.connect() as conn:
            holders = (await conn.execute(sa.text(_HOLDERS), {"schema": schema})).mappings().all()
        raise AssertionError(
            f"schema {schema} not dropped within {lock_timeout:g} s: its tables are locked by "
            + "; ".join(str(dict(h)) for h in holders)
        ) from exc
    finally:
        await engine.dispose()


#: the queue-name prefixes this test session handed out: only these are cleaned up at its end, so
#: sessions running side by side on one broker never delete each other's queues
SESSION_PREFIXES: set[str] = set()


def fresh_prefix() -> str:
    """A fresh ``t<8 hex>-`` prefix for a test's queue names, remembered for the session's clean-up."""
    prefix = f"t{uuid.uuid4().hex[:8]}-"
    SESSION_PREFIXES.add(prefix)
    return prefix
