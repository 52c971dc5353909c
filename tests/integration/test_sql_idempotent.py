"""Idempotent types on SQL: retention keeps each identity's last success (the next handler's
ctx.previous), and a stale run cannot settle over a message cancelled after its lease was taken back."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import HandlerContext, NonRetryableError, QueueingApp, QueueMessage, Retry, queue
from queueing_core.decisions import Complete
from queueing_core.providers.sql.retention import RetentionPolicy
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.transport import Settlement


@queue("catalog", idempotent=True, identity="sku")
class Product(QueueMessage):
    sku: str
    price: int


def catalog_app() -> tuple[QueueingApp, list[tuple[str, int, int | None]]]:
    app = QueueingApp("catalog")
    seen: list[tuple[str, int, int | None]] = []

    @app.handler()
    async def handle(msg: Product, ctx: HandlerContext) -> None:
        seen.append((msg.sku, msg.price, ctx.previous.price if ctx.previous else None))

    return app, seen


async def test_retention_keeps_the_last_success_of_each_identity(sql_db):
    app, seen = catalog_app()
    everything = RetentionPolicy(archive_after=timedelta(0), delete_archived_after=timedelta(0))
    rt = Runtime(app, sql_db.provider(retention=everything))
    await rt.open()
    for price in (1, 2, 3):
        await app.enqueue(Product(sku="A", price=price))
        await app.enqueue(Product(sku="B", price=price * 10))
        await run_until_idle(rt)
    for _ in range(2):  # archive, then delete what is archived
        await rt.provider.maintain(app)
        await asyncio.sleep(0.05)
    m = rt.provider.tables.messages
    async with rt.provider.engine.connect() as conn:
        left = sorted((await conn.execute(sa.select(m.c.identity, m.c.status))).all())
    assert left == [("A", "Succeeded"), ("B", "Succeeded")]  # the earlier versions are gone
    await app.enqueue(Product(sku="A", price=4))
    await run_until_idle(rt)
    assert seen[-1] == ("A", 4, 3)
    await rt.close()


async def test_a_stale_run_cannot_settle_over_a_cancelled_message(sql_db):
    app, seen = catalog_app()
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    r = await app.enqueue(Product(sku="C", price=1))
    sub = app.subscription("Product")
    assert sub is not None
    (stale,) = await rt.provider.receive(sub, 1)
    from queueing_core.ops import OpsService

    await OpsService(rt).release_lease(r.message_id)  # an operator takes the lease back
    assert (await app.cancel(r.tracking_id)).status == "Cancelled"
    await rt.provider.settle([Settlement(stale, Complete({"late": True}))])
    assert stale.refused
    status = await app.status(r.tracking_id)
    assert status.status == "Cancelled"
    assert status.result is None
    assert await run_until_idle(rt) == 0
    assert seen == []
    await rt.close()


async def test_the_job_control_migration_upgrades_a_database_of_the_previous_version(sql_db):
    from queueing_core.providers.sql.schema import MIGRATIONS, migrate

    version = next(n for n, text, _ in MIGRATIONS if text.startswith("job control"))

    prov = sql_db.provider()
    await prov.open()
    t = prov.tables
    m, h, x, v = t.messages.fullname, t.history.fullname, t.cancels.fullname, t.schema_versions.fullname
    prefix = f"{t.metadata.schema}." if t.metadata.schema else ""
    async with prov.engine.begin() as conn:  # back to what the version before it left
        for index in (
            "ix_queueing_messages_tracking",
            "ix_queueing_messages_identity",
            "ix_queueing_history_tracking",
        ):
            await conn.execute(sa.text(f"DROP INDEX {prefix}{index}"))
        await conn.execute(sa.text(f"ALTER TABLE {m} DROP COLUMN progress"))
        await conn.execute(sa.text(f"ALTER TABLE {m} DROP COLUMN identity"))
        await conn.execute(sa.text(f"ALTER TABLE {h} DROP COLUMN progress"))
        await conn.execute(sa.text(f"DROP TABLE {x}"))
        await conn.execute(sa.text(f"DELETE FROM {v} WHERE version = {version}"))
    assert await migrate(prov.engine, t, now=prov.clock) == [version]

    def shape(sync):
        inspect = sa.inspect(sync)
        cols = {c["name"] for c in inspect.get_columns(t.messages.name, schema=t.messages.schema)}
        hist = {c["name"] for c in inspect.get_columns(t.history.name, schema=t.history.schema)}
        idx = {i["name"] for i in inspect.get_indexes(t.messages.name, schema=t.messages.schema)}
        idx |= {i["name"] for i in inspect.get_indexes(t.history.name, schema=t.history.schema)}
        return cols, hist, idx, inspect.has_table(t.cancels.name, schema=t.cancels.schema)

    async with prov.engine.connect() as conn:
        cols, hist, idx, cancels = await conn.run_sync(shape)
    assert {"progress", "identity"} <= cols
    assert "progress" in hist
    assert {
        "ix_queueing_messages_tracking",
        "ix_queueing_messages_identity",
        "ix_queueing_history_tracking",
    } <= idx
    assert cancels


async def test_identity_documents_in_the_database_change_by_compare_and_set(sql_db):
    """The store RabbitMQ and SQS use for their idempotent types (the SQL provider has its own rows)."""
    one, two = sql_db.provider(), sql_db.provider()
    a, b = one.control_store(), two.control_store()
    assert await a.identity_doc("Price", "A") is None
    assert await a.put_identity_doc("Price", "A", {"waiting": ["1"]}, None)
    assert not await b.put_identity_doc("Price", "A", {"waiting": ["2"]}, None)  # created already
    found = await b.identity_doc("Price", "A")
    assert found is not None
    doc, token = found
    assert doc == {"waiting": ["1"]}
    assert await b.put_identity_doc("Price", "A", {"waiting": ["3"]}, token)
    assert not await a.put_identity_doc("Price", "A", {"waiting": ["4"]}, token)  # a stale version
    again = await a.identity_doc("Price", "A")
    assert again is not None
    assert again[0] == {"waiting": ["3"]}
    assert await a.identity_doc("Price", "B") is None


@queue("catalog-cancelled", idempotent=True, identity="sku")
class Listing(QueueMessage):
    sku: str
    price: int


async def test_a_replacing_version_does_not_inherit_a_cancel_request_left_by_the_run_it_replaces(sql_db):
    """A cancel reached the running version only as a request (it was Leased), and the run failed before
    it looked: the row waits for its retry with the request standing. A changed version of the same
    identity then replaces the waiting row in place (same message id): it was settled Cancelled unrun,
    its enqueue told "replaced" (a review found it). The replace withdraws the old run's request."""
    from queueing_core import MessageStatus
    from queueing_core.clock import utcnow
    from queueing_core.errors import Retry

    app = QueueingApp("review-replace-cancel")
    ran: list[int] = []

    @app.handler()
    async def list_it(msg: Listing) -> None:
        if not ran and msg.price == 1:
            ran.append(0)
            raise Retry(after=timedelta(minutes=5))
        ran.append(msg.price)

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        first = await app.enqueue(Listing(sku="a", price=1))
        await run_until_idle(rt, raise_errors=False)
        assert (await rt.tracker.get(first.message_id)).status == MessageStatus.FAILED
        # the request jobs.cancel wrote while the run held the row (Leased), after it had ended
        # (the window test_ops_retry_cancel_request.py makes deterministic the same way)
        await rt.control.set_cancel(first.message_id, True, utcnow())
        rt.control.invalidate()
        assert first.message_id in (await rt.control.state()).cancelled  # the request stands
        second = await app.enqueue(Listing(sku="a", price=2))
        assert second.outcome == "replaced"
        assert second.message_id == first.message_id
        await run_until_idle(rt, raise_errors=False)
        assert ran == [0, 2], ran
        assert (await rt.tracker.get(first.message_id)).status == MessageStatus.SUCCEEDED
    finally:
        await rt.close()


@queue("catalog-scheduled", idempotent=True, identity="sku")
class Restock(QueueMessage):
    sku: str
    units: int


async def test_a_schedules_message_of_an_idempotent_type_goes_through_its_identity(sql_db):
    """A tick's message was written without its identity (a review found it): the next enqueue of the
    same message was not discarded, a changed one did not replace it, and ``ctx.previous`` never saw
    it. It now goes through the identity like any enqueue, in the tick's own transaction."""
    from datetime import UTC, datetime

    from queueing_core.scheduler import Scheduler, tick_store_for

    app = QueueingApp("review-scheduled-identity")
    app.every(timedelta(seconds=1), Restock(sku="a", units=5), name="restock")
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        assert tick_store_for(rt).writes_messages  # the SQL store writes the tick's messages itself
        now = datetime.now(UTC).replace(microsecond=0)
        assert await Scheduler(rt).run_due(now) == 1
        same = await app.enqueue(Restock(sku="a", units=5))
        assert same.outcome == "discarded", same.outcome
        changed = await app.enqueue(Restock(sku="a", units=9))
        assert changed.outcome == "replaced", changed.outcome
        assert changed.message_id == same.message_id  # the tick's message, its body replaced
        m = rt.provider.tables.messages
        async with rt.provider.engine.connect() as conn:
            rows = (await conn.execute(sa.select(m.c.identity).where(m.c.type == "Restock"))).all()
        assert [r[0] for r in rows] == ["a"]
    finally:
        await rt.close()


async def test_the_enqueued_hook_is_told_only_of_messages_that_went_in(sql_db):
    """A review found the ``enqueued`` hook told of every tick message and every enqueue, also those
    discarded against the waiting version or replacing its body: a hook counting enqueues counted
    messages that were never added. It is now told of the new messages alone, by enqueues and by
    ticks, which the SQL transport writes in the tick's own transaction."""
    from datetime import UTC, datetime

    from queueing_core import Event
    from queueing_core.hooks import Observation
    from queueing_core.scheduler import Scheduler

    app = QueueingApp("review-enqueued-hook")
    app.every(timedelta(seconds=1), Restock(sku="b", units=5), name="restock-b")
    app.every(timedelta(seconds=1), Restock(sku="t", units=3), name="restock-t")
    told: list[tuple[str, int]] = []

    @app.hooks.on(Event.ENQUEUED)
    def enqueued(obs: Observation) -> None:
        assert obs.envelope is not None
        told.append((obs.envelope.body["sku"], obs.envelope.body["units"]))

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        first = await app.enqueue(Restock(sku="b", units=5))
        assert first.outcome == "enqueued"
        assert told == [("b", 5)]
        # a tick of the same message: discarded against the waiting one, in the tick's transaction;
        # the other schedule's, of an identity with no waiting version, went in and is told
        now = datetime.now(UTC).replace(microsecond=0)
        assert await Scheduler(rt).run_due(now) == 2
        assert told == [("b", 5), ("t", 3)]
        told.clear()
        told.append(("b", 5))
        replaced = await app.enqueue(Restock(sku="b", units=6))
        assert replaced.outcome == "replaced"
        assert (await app.enqueue(Restock(sku="b", units=6))).outcome == "discarded"
        assert told == [("b", 5)]  # (the waiting message's body changed: no message went in)
        other = await app.enqueue(Restock(sku="c", units=1))
        assert other.outcome == "enqueued"
        assert told == [("b", 5), ("c", 1)]
    finally:
        await rt.close()


async def test_batches_of_the_same_identities_in_opposite_orders_do_not_deadlock(pg_db):
    """A review found each identity's lock taken in the batch's order: two ``enqueue_many`` naming the
    same identities in opposite orders each held one and waited for the other, and PostgreSQL failed
    one of them (a deadlock). The batch's identities are now locked together, in one order."""
    app, _ = catalog_app()
    rt = Runtime(app, pg_db.provider())
    await rt.open()
    skus = [f"s{i}" for i in range(8)]
    try:
        for round_ in range(15):
            batches = [
                [Product(sku=s, price=2 * round_ + k) for s in order]
                for k, order in enumerate((skus, skus[::-1]))
            ]
            receipts = await asyncio.gather(*(app.enqueue_many(b) for b in batches))
            assert all(len(r) == len(skus) for r in receipts)
    finally:
        await rt.close()


@queue(
    "kept-briefly", idempotent=True, identity="sku", max_attempts=3, keep_processed_for=timedelta(seconds=1)
)
class Brief(QueueMessage):
    sku: str
    price: int


async def _superseded_while_it_ran(
    rt: Runtime, app: QueueingApp, seen: list[int], gate: asyncio.Event
) -> Any:
    """Version 1 runs; version 2 comes meanwhile (a row of its own) and runs once 1 settled; 1's
    receipt."""
    first = await app.enqueue(Brief(sku="A", price=1))
    run = asyncio.create_task(run_until_idle(rt, raise_errors=False, max_messages=1))
    while not seen:
        await asyncio.sleep(0.01)
    assert (await app.enqueue(Brief(sku="A", price=2))).outcome == "enqueued"
    gate.set()
    await run
    await run_until_idle(rt, raise_errors=False)  # version 2 runs
    assert seen == [1, 2]
    return first


async def _status(rt: Runtime, message_id: Any) -> str:
    """The status of the message's row (which must be there)."""
    rec = await rt.tracker.get(message_id)
    assert rec is not None
    return rec.status


def _brief_app(outcome: str) -> tuple[QueueingApp, list[int], asyncio.Event]:
    app = QueueingApp("brief")
    seen: list[int] = []
    gate = asyncio.Event()

    @app.handler()
    async def handle(msg: Brief) -> None:
        seen.append(msg.price)
        if msg.price == 1 and seen.count(1) == 1:
            await gate.wait()
            if outcome == "retry":
                raise Retry(after=timedelta(seconds=2.5))
            raise NonRetryableError("fails for good")

    return app, seen, gate


async def test_a_superseded_versions_retry_stays_superseded_when_retention_removed_the_newer_row(sql_db):
    """A review found the supersession judged by the newer row, which a queue that keeps its successes
    briefly had deleted by the older version's retry: the stale body ran last. The mark is on the older
    version's own row now."""
    app, seen, gate = _brief_app("retry")
    rt = Runtime(app, sql_db.provider(maintenance_interval=3600))
    await rt.open()
    try:
        first = await _superseded_while_it_ran(rt, app, seen, gate)
        await asyncio.sleep(1.2)
        assert (await rt.provider.maintain(app))["deleted_processed"] == 1  # version 2's row
        await asyncio.sleep(1.5)  # version 1's retry is due
        await run_until_idle(rt, raise_errors=False)
        assert seen == [1, 2]
        assert await _status(rt, first.message_id) == "Cancelled"
    finally:
        await rt.close()


async def test_a_superseded_version_put_back_to_pending_runs(sql_db):
    """A review found a bulk put-back to Pending (which gives attempts back as an operator's retry does)
    settled superseded at once: the operator was told it was updated, and nothing ran."""
    from queueing_core.ops import OpsService
    from queueing_core.ops.models import StatusUpdate, StatusWhere

    app, seen, gate = _brief_app("fail")
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        first = await _superseded_while_it_ran(rt, app, seen, gate)
        change = StatusUpdate(
            where=StatusWhere(path="price", value=1), set="Pending", status=["DeadLettered"]
        )
        assert (await OpsService(rt).update_status_where("kept-briefly", change)).updated == 1
        await run_until_idle(rt, raise_errors=False)
        assert seen == [1, 2, 1]
        assert await _status(rt, first.message_id) == "Succeeded"
    finally:
        await rt.close()


@pytest.mark.parametrize("price", [3, 1], ids=["changed-body", "same-body"])
async def test_a_version_enqueued_once_the_newer_row_is_gone_runs(sql_db, price):
    """A review found the mark kept when a new version took the marked row (its body replaced, or an
    identical enqueue discarded against it) after retention had removed the row that marked it: the
    new version was told "replaced" or "discarded", and the row was settled superseded unrun."""
    app, seen, gate = _brief_app("retry")
    rt = Runtime(app, sql_db.provider(maintenance_interval=3600))
    await rt.open()
    try:
        first = await _superseded_while_it_ran(rt, app, seen, gate)
        await asyncio.sleep(1.2)
        assert (await rt.provider.maintain(app))["deleted_processed"] == 1  # version 2's row
        receipt = await app.enqueue(Brief(sku="A", price=price))
        assert receipt.outcome == ("replaced" if price != 1 else "discarded")
        assert receipt.message_id == first.message_id
        await asyncio.sleep(2.6)  # (a discard leaves the row its retry time; a replace makes it due now)
        await run_until_idle(rt, raise_errors=False)
        assert seen == [1, 2, price]
        assert await _status(rt, first.message_id) == "Succeeded"
    finally:
        await rt.close()


async def test_a_message_sent_again_with_its_own_id_while_it_runs_is_not_superseded_by_itself(sql_db):
    """A review found a resend (a producer's retry, an outbox replayed) of the running version marking
    its own row superseded by its own id, though no row was added: its retry was settled superseded,
    and nothing ran in its place. Only a row that was added marks the others."""
    app, seen, gate = _brief_app("retry")
    rt = Runtime(app, sql_db.provider(maintenance_interval=3600))
    await rt.open()
    try:
        message = Brief(sku="S", price=1)
        first = await app.enqueue(message)
        run = asyncio.create_task(run_until_idle(rt, raise_errors=False, max_messages=1))
        while not seen:
            await asyncio.sleep(0.01)
        again = await app.enqueue(message)  # the same message, its own id
        assert again.message_id == first.message_id
        gate.set()
        await run
        await asyncio.sleep(2.6)  # its retry is due
        await run_until_idle(rt, raise_errors=False)
        assert seen == [1, 1]
        assert await _status(rt, first.message_id) == "Succeeded"
    finally:
        await rt.close()


@queue("flags", idempotent=True, identity="key")
class Flag(QueueMessage):
    key: str
    value: Any


async def test_a_changed_body_python_takes_for_equal_replaces_the_waiting_one(sql_db):
    """``1`` then ``true`` for one key: another version on every transport (they compare the JSON's
    digest), but SQL compared with Python's ``==`` (``True == 1``) and discarded the new version, whose
    handler then ran with the old value."""
    app = QueueingApp("flags")
    seen: list[Any] = []

    @app.handler()
    async def handle(msg: Flag) -> None:
        seen.append(msg.value)

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        first = await app.enqueue(Flag(key="beta", value=1), delay=timedelta(hours=1))
        second = await app.enqueue(Flag(key="beta", value=True), delay=timedelta(hours=1))
        assert (second.outcome, second.message_id) == ("replaced", first.message_id)
        same = await app.enqueue(Flag(key="beta", value=True), delay=timedelta(hours=1))
        assert same.outcome == "discarded"  # (the same JSON still is)
        await app.enqueue(Flag(key="beta", value=True))  # brought forward: it runs now
        await run_until_idle(rt)
        assert seen == [True]
    finally:
        await rt.close()


@pytest.mark.parametrize("value", [2e16, -0.0, 1.5e300, {"b": [1, 2.5], "a": None}])
async def test_an_unchanged_body_is_discarded_as_the_database_gives_it_back(sql_db, value):
    """PostgreSQL's JSONB gives ``2e16`` back as ``20000000000000000`` and ``-0.0`` as ``0``: compared by
    their text, the repeat of an unchanged request was taken for a changed version, replacing the
    waiting one and moving its due time on every repeat (found in review)."""
    app = QueueingApp("flags")

    @app.handler()
    async def handle(msg: Flag) -> None:
        pass

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        first = await app.enqueue(Flag(key="k", value=value), delay=timedelta(hours=1))
        again = await app.enqueue(Flag(key="k", value=value), delay=timedelta(hours=2))
        assert (again.outcome, again.message_id) == ("discarded", first.message_id)
    finally:
        await rt.close()
