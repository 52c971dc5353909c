"""The outbox and idempotent types on SQL: a message of an idempotent type written in the caller's
transaction is found, discarded or replaced as ``enqueue`` would (the same plan), and a version that
succeeded is the next version's ``ctx.previous``. SQLite and PostgreSQL."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlOutbox
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle


@queue("rv-prices", idempotent=True, identity="sku")
class Price(QueueMessage):
    sku: str
    cents: int


async def _sql_runtime(sql_db: Any, app: QueueingApp) -> Runtime:
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    return rt


async def _waiting_rows(rt: Runtime) -> list[Any]:
    """The waiting rows of the idempotent type (every identity)."""
    prov: Any = rt.provider
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        rows = await conn.execute(
            sa.select(m.c.message_id, m.c.identity, sa.cast(m.c.body, sa.Text()).label("body")).where(
                m.c.type == "Price", m.c.status == MessageStatus.PENDING.value
            )
        )
        return list(rows)


async def test_outbox_an_idempotent_type_keeps_its_identity_so_the_same_json_is_not_queued_twice(sql_db):
    """docs/concepts/jobs.md (SQL): the identity is looked up in the messages table's ``identity``
    column; an enqueue equal to the waiting message of its identity is discarded. A version written
    through the outbox must be that waiting message as well."""
    app = QueueingApp("rv-outbox-identity")
    app.message(Price)
    rt = await _sql_runtime(sql_db, app)
    try:
        outbox = SqlOutbox(app, schema=sql_db.schema)
        engine = sql_db.sync_engine()
        with Session(engine) as session, session.begin():
            [first] = outbox.enqueue(session, Price(sku="A", cents=1))
        engine.dispose()
        again = await app.enqueue(Price(sku="A", cents=1))
        assert again.outcome == "discarded"
        assert again.message_id == first.message_id
        rows = await _waiting_rows(rt)
        assert len(rows) == 1
        assert rows[0].identity == "A"
    finally:
        await rt.close()


async def test_outbox_a_changed_body_replaces_the_waiting_version_as_enqueue_does(sql_db):
    """The async flavour, the other way round: the waiting version came from ``enqueue``; the outbox's
    changed body replaces it (``outcome="replaced"``, the waiting message's ids), inside the caller's
    transaction, rather than queueing a second version beside it."""
    app = QueueingApp("rv-outbox-replace")
    app.message(Price)
    rt = await _sql_runtime(sql_db, app)
    try:
        first = await app.enqueue(Price(sku="B", cents=1))
        outbox = SqlOutbox(app, schema=sql_db.schema)
        prov: Any = rt.provider
        async with prov.engine.begin() as conn:
            versions = [Price(sku="B", cents=2), Price(sku="C", cents=3)]
            [changed, new_sku] = await outbox.enqueue_async(conn, versions)
        assert (changed.outcome, changed.message_id) == ("replaced", first.message_id)
        assert new_sku.outcome == "enqueued"
        rows = {r.identity: r for r in await _waiting_rows(rt)}
        assert set(rows) == {"B", "C"}
        assert json.loads(rows["B"].body)["cents"] == 2
    finally:
        await rt.close()


async def test_outbox_version_that_succeeded_is_the_next_versions_previous(sql_db):
    """``ctx.previous`` is the last version of the identity that succeeded; on SQL it is found by the
    ``identity`` column. A handler that acts only on what changed compares against it, so a version
    that ran but is not found there makes the next one compare against an older version."""
    app = QueueingApp("rv-outbox-previous")
    previous: list[int | None] = []

    @app.handler()
    async def h(msg: Price, ctx: Any) -> None:
        previous.append(ctx.previous.cents if ctx.previous is not None else None)

    rt = await _sql_runtime(sql_db, app)
    try:
        outbox = SqlOutbox(app, schema=sql_db.schema)
        prov: Any = rt.provider
        async with prov.engine.begin() as conn:
            await outbox.enqueue_async(conn, Price(sku="D", cents=1))
        await run_until_idle(rt)
        await app.enqueue(Price(sku="D", cents=2))
        await run_until_idle(rt)
        assert previous == [None, 1]
    finally:
        await rt.close()
