"""The SQL message history of RabbitMQ and SQS deployments (``SideStores``) prunes finished records
past their retention, in batches taken by primary key with their conditions said again, and keeps the
rest, on SQLite and PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from queueing_core.providers.sql.history import SideStores
from queueing_core.tracking import MessageRecord
from tests.services import POSTGRES_URL, drop_schema, require

NOW = datetime(2026, 3, 30, 12, 0, tzinfo=UTC)


def rec(i: int, **fields: Any) -> MessageRecord:
    data: dict[str, Any] = {
        "message_id": uuid.uuid4(),
        "tracking_id": uuid.uuid4(),
        "type": "T",
        "queue": "q",
        "status": "Pending",
        "created_at": NOW - timedelta(days=20, seconds=i),
        "updated_at": NOW,
    }
    data.update(fields)
    return MessageRecord(**data)


@pytest.fixture(params=["sqlite", "postgres"])
async def stores(request, tmp_path):
    if request.param == "sqlite":
        side = SideStores(f"sqlite:///{tmp_path}/side.db", retention=timedelta(days=14))
        yield side
        await side.close()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qp_{uuid.uuid4().hex[:10]}"
    side = SideStores(POSTGRES_URL, schema=schema, retention=timedelta(days=14))
    yield side
    await side.close()
    await drop_schema(schema)


async def test_prune_deletes_old_finished_records_only(stores, monkeypatch):
    old = NOW - timedelta(days=15)
    doomed = [rec(i, status="Succeeded", updated_at=old) for i in range(5)]
    doomed.append(rec(5, status="DeadLettered", updated_at=old, queue="z"))
    kept = [
        rec(6, status="Pending", updated_at=old),  # not finished, however old
        rec(7, status="Succeeded", updated_at=NOW - timedelta(days=13)),  # finished lately
        rec(8, status="Leased", updated_at=old),
    ]
    await stores.open()
    await stores.history.upsert(doomed + kept)
    # batches of 2: the loop goes on while a batch is full, and stops on the first short one
    monkeypatch.setattr("queueing_core.providers.sql.history.PRUNE_CHUNK", 2)
    assert await stores.history.prune(NOW) == len(doomed)
    for r in doomed:
        assert await stores.history.get(r.message_id) is None
    for r in kept:
        assert await stores.history.get(r.message_id) is not None
    assert await stores.history.prune(NOW) == 0


async def test_prune_keeps_the_history_of_letters_the_transport_keeps(stores):
    """RabbitMQ's dead-letter queue never drops a letter: its history stays past the retention (SQS's
    dead-letter queue drops letters after its own retention, so nothing is kept there)."""
    from queueing_core.providers.dead_letters import DEAD_STATES

    old = NOW - timedelta(days=15)
    dead = rec(21, status="DeadLettered", updated_at=old, queue="z")
    expired = rec(22, status="Expired", updated_at=old)
    done = rec(23, status="Succeeded", updated_at=old)
    await stores.open()
    await stores.history.upsert([dead, expired, done])
    assert await stores.history.prune(NOW, DEAD_STATES) == 1
    assert await stores.history.get(dead.message_id) is not None
    assert await stores.history.get(expired.message_id) is not None
    assert await stores.history.prune(NOW) == 2
