"""The outbox and idempotent types on SQL: a message of an idempotent type written in the caller's
transaction is found, discarded or replaced as ``enqueue`` would (the same plan), and a version that
succeeded is the next version's ``ctx.previous``. SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlOutbox, SqlProvider
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


async def test_outbox_a_discard_holds_the_waiting_version_until_the_callers_commit(pg_db):
    """A review found the discard a plain read on PostgreSQL: while the caller's transaction was still
    open, a worker claimed the waiting version and ran it without the caller's change (not committed
    yet), and after the commit nothing was left to run for it. The waiting row is now locked by the
    discard, so a claim (which skips locked rows) waits for the caller's commit."""
    app = QueueingApp("rv-outbox-hold")
    seen: list[int] = []
    engine = pg_db.sync_engine()

    @app.handler()
    async def handle(msg: Price) -> None:
        with engine.connect() as conn:  # what the handler syncs: the committed price
            seen.append(conn.execute(sa.text("SELECT cents FROM prices WHERE sku = 'A'")).scalar_one())

    rt = Runtime(app, pg_db.provider())
    await rt.open()  # (makes the test's schema)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE prices (sku text PRIMARY KEY, cents int)"))
            conn.execute(sa.text("INSERT INTO prices VALUES ('A', 1)"))
        await app.enqueue(Price(sku="A", cents=0))  # an earlier change's sync, waiting
        outbox = SqlOutbox(app, schema=pg_db.schema)
        with Session(engine) as session, session.begin():
            session.execute(sa.text("UPDATE prices SET cents = 2 WHERE sku = 'A'"))
            [again] = outbox.enqueue(session, Price(sku="A", cents=0))
            assert again.outcome == "discarded"
            assert await run_until_idle(rt) == 0  # held: nothing runs before the commit
        assert await run_until_idle(rt) == 1
        assert seen == [2]  # the run the discarded enqueue stands for saw the committed change
    finally:
        await rt.close()
        engine.dispose()


async def test_outbox_two_callers_on_sqlite_leave_one_waiting_version(tmp_path):
    """A review found the identity's lookup made before the caller's driver began its transaction
    (pysqlite begins one only before a write): two callers both found none and both inserted, two
    waiting rows of one identity. The plan now takes SQLite's write lock before it looks, so the
    second caller looks after the first committed. Each caller pauses after its lookup for the other
    to reach its own: with the lock, the other cannot, and the pause gives up."""
    import threading

    url = f"sqlite:///{tmp_path}/q.db"
    app = QueueingApp("rv-outbox-race")
    app.message(Price)
    rt = Runtime(app, SqlProvider(url))
    await rt.open()
    await rt.close()
    both_looked = threading.Barrier(2)

    class PausedAfterLookup:
        """The caller's session, pausing once after the outbox's lookup (its first SELECT)."""

        def __init__(self, session: Session) -> None:
            self.session, self.paused = session, False

        def get_bind(self) -> Any:
            return self.session.get_bind()

        def execute(self, *args: Any) -> Any:
            result = self.session.execute(*args)
            if not self.paused and isinstance(args[0], sa.Select):
                self.paused = True
                with contextlib.suppress(threading.BrokenBarrierError):
                    both_looked.wait(timeout=2)
            return result

    engine = sa.create_engine(url, connect_args={"timeout": 20})
    outbox = SqlOutbox(app)
    outcomes: list[str] = []

    def caller() -> None:
        with Session(engine) as session, session.begin():
            outcomes.append(outbox.enqueue(PausedAfterLookup(session), Price(sku="A", cents=1))[0].outcome)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.text("SELECT count(*) FROM queueing_messages WHERE identity = 'A' AND status = 'Pending'")
        ).scalar_one()
    engine.dispose()
    assert sorted(outcomes) == ["discarded", "enqueued"]
    assert waiting == 1
