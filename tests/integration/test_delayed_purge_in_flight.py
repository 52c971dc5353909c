"""A purge by status leaves a delayed message that a dispatcher is forwarding, and says so.

The purge deleted the row and its history and reported the message deleted while the dispatcher's
forward was on its way (a publish waiting for its confirm): the forward landed and the message ran
all the same (found by a review). A row a dispatcher is forwarding now stays, counted as left, and
its history with it; once the forward is done (or its lease ends unforwarded) it is the transport's,
or the store's for the next purge. (A purge of a whole queue still takes such a row: see its docs.)
SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest

from queueing_core.clock import utcnow
from queueing_core.naming import Transport
from queueing_core.providers.delayed import DelayedDispatcher
from queueing_core.providers.sql.history import SideStores
from queueing_core.tracking.base import record_from_envelope
from tests.envelopes import an_envelope
from tests.services import POSTGRES_URL, drop_schema, require
from tests.slow_forward import Slow


@pytest.fixture(params=["sqlite", "postgres"])
async def stores(request, tmp_path):
    if request.param == "sqlite":
        s = SideStores(f"sqlite:///{tmp_path}/side.db")
        yield s
        await s.close()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qp_{uuid.uuid4().hex[:10]}"
    s = SideStores(POSTGRES_URL, schema=schema)
    yield s
    await s.close()
    await drop_schema(schema)


async def test_a_purge_by_status_leaves_a_row_being_forwarded(stores) -> None:
    store = stores.delayed_store(Transport.RABBITMQ)
    now = utcnow()
    env, waiting = an_envelope(created_at=now), an_envelope(created_at=now)
    await store.store(env, "jobs", now - timedelta(seconds=1))
    await store.store(waiting, "jobs", now + timedelta(hours=1))  # not due: purged as before
    await stores.history.upsert([record_from_envelope(e, "Pending", now) for e in (env, waiting)])
    target = Slow()
    forwarding = asyncio.create_task(DelayedDispatcher(store, target, listen=False).dispatch_once())
    await asyncio.wait_for(target.entered.wait(), 30)
    try:
        done = await store.purge("jobs", [env.message_id, waiting.message_id], history_while=("Pending",))
    finally:
        target.go.set()
        await forwarding
    assert target.landed == [env.message_id]  # the forward was under way: it landed
    # so the purge did not report it gone, nor take its history: it runs, as said
    assert done.gone == {waiting.message_id}
    assert done.left == {env.message_id}
    assert done.forgotten == 1
    assert await stores.history.get(env.message_id) is not None
    assert await stores.history.get(waiting.message_id) is None
