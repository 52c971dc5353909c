"""SQL enqueue, read again: a message id the table holds already is told ``duplicate`` (nothing is
written, announced or recorded), on every way of inserting (SQLite's executemany, PostgreSQL's unnest
INSERT and its COPY for big batches, the outbox); times "for ever" (``datetime.max``) are kept no later
than ``decisions.LATEST``, so they read back in a session whose time zone is ahead of UTC; enqueue
middleware's changes are checked before the outbox writes them. SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import LATEST
from queueing_core.errors import InvalidArgument
from queueing_core.hooks import Event
from queueing_core.providers.sql import SqlOutbox, SqlProvider
from queueing_core.providers.sql.provider import COPY_FROM
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

NEVER = datetime.max.replace(tzinfo=UTC)


@queue("stored-recalc")
class Recalc(QueueMessage):
    account: str


@queue("far-parked", expiration=None)
class Parked(QueueMessage):
    user: str


@queue("far-profiles", idempotent=True, identity="user")
class RebuildProfile(QueueMessage):
    user: str


async def _rows(rt: Runtime, queue_name: str) -> int:
    prov: Any = rt.provider
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        return int(
            (await conn.execute(sa.select(sa.func.count()).where(m.c.queue == queue_name))).scalar_one()
        )


async def test_an_enqueue_of_a_stored_message_id_is_told_duplicate_and_not_announced(sql_db):
    """The insert skips a message id the table holds (a producer's retry adds nothing); the receipt said
    ``enqueued``/Pending and the ENQUEUED hook fired for a message that was never written (it had
    finished: the work asked for again did not run)."""
    app = QueueingApp("stored-id")
    runs: list[str] = []

    @app.handler()
    async def recalc(m: Recalc) -> None:
        runs.append(m.account)

    announced: list[Any] = []
    app.hooks.on(Event.ENQUEUED)(lambda obs: announced.append(obs.envelope.message_id))
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        msg = Recalc(account="a-1")
        assert (await app.enqueue(msg)).outcome == "enqueued"
        await run_until_idle(rt)
        again = await app.enqueue(msg)
        assert (again.outcome, again.message_id) == ("duplicate", msg.message_id)
        assert announced == [msg.message_id]
        assert await run_until_idle(rt) == 0
        assert runs == ["a-1"]
        assert (await rt.tracker.get(msg.message_id)).status == "Succeeded"

        # a batch: only the stored id (and an id twice in the batch, after its first) is a duplicate
        fresh, twice = Recalc(account="b"), Recalc(account="c")
        receipts = await app.enqueue_many([fresh, msg, twice, twice])
        assert [r.outcome for r in receipts] == ["enqueued", "duplicate", "enqueued", "duplicate"]
        assert announced[1:] == [fresh.message_id, twice.message_id]

        # PostgreSQL sends a big batch by COPY, which cannot skip a stored id: it goes again through the
        # INSERT that does, and that says which went in
        big = [Recalc(account=str(i)) for i in range(COPY_FROM + 1)]
        receipts = await app.enqueue_many([*big[:-1], fresh])
        assert [r.outcome for r in receipts] == ["enqueued"] * COPY_FROM + ["duplicate"]
        receipts = await app.enqueue_many(big)  # all stored but the last
        assert [r.outcome for r in receipts] == ["duplicate"] * COPY_FROM + ["enqueued"]
        assert await _rows(rt, "stored-recalc") == 3 + len(big)
    finally:
        await rt.close()


async def test_the_outbox_tells_a_stored_message_id_duplicate(sql_db):
    app = QueueingApp("stored-id-outbox")
    app.message(Recalc)
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    engine = sql_db.sync_engine()
    try:
        msg = Recalc(account="a")
        outbox = SqlOutbox(app, schema=sql_db.schema)
        with Session(engine) as session, session.begin():
            assert [r.outcome for r in outbox.enqueue(session, msg)] == ["enqueued"]
        new = Recalc(account="b")
        with engine.begin() as conn:
            receipts = outbox.enqueue(conn, [msg, new])
        assert [r.outcome for r in receipts] == ["duplicate", "enqueued"]
        prov: Any = rt.provider
        async with prov.engine.begin() as aconn:
            receipts = await outbox.enqueue_async(aconn, [new, Recalc(account="c")])
        assert [r.outcome for r in receipts] == ["duplicate", "enqueued"]
        assert await _rows(rt, "stored-recalc") == 3
    finally:
        engine.dispose()
        await rt.close()


async def test_enqueue_middleware_that_leaves_a_header_not_text_is_refused_before_the_outbox_writes(sql_db):
    """``envelope.model_copy(update=...)`` skips validation: a header of None went into the row, and the
    claim dead-lettered it as a malformed envelope, never run."""
    app = QueueingApp("outbox-middleware")
    app.message(Recalc)

    @app.use_enqueue_middleware
    async def stamp(envelope: Any, call_next: Any) -> Any:
        return await call_next(envelope.model_copy(update={"headers": {**envelope.headers, "tenant": None}}))

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        with pytest.raises(InvalidArgument, match=r"headers\.tenant"):
            await app.enqueue(Recalc(account="a"))
        prov: Any = rt.provider
        async with prov.engine.begin() as conn:
            with pytest.raises(InvalidArgument, match=r"headers\.tenant"):
                await SqlOutbox(app, schema=sql_db.schema).enqueue_async(conn, Recalc(account="b"))
        assert await _rows(rt, "stored-recalc") == 0
    finally:
        await rt.close()


async def test_times_for_ever_read_back_in_a_time_zone_ahead_of_utc(sql_db):
    """PostgreSQL gives a timestamp as text in its session's time zone: one late on 9999-12-31 UTC is a
    year 10000 in Tokyo, which no reader takes, and every read of the row failed (its history, its
    queue's listing, the next enqueue of its identity). Enqueue keeps such times as a deferral does."""
    url = sql_db.url
    if sql_db.backend == "postgresql":
        url = f"{url}?options=-c%20timezone%3DAsia/Tokyo"  # this test's sessions only
    app = QueueingApp("far-times")
    app.message(Parked)
    app.message(RebuildProfile)
    rt = Runtime(app, SqlProvider(url, schema=sql_db.schema, listen=False))
    await rt.open()
    try:
        parked = await app.enqueue(Parked(user="u1"), not_before=NEVER - timedelta(hours=1))
        lasting = await app.enqueue(RebuildProfile(user="u1"), expires_at=NEVER)
        stored = [await rt.tracker.get(r.message_id) for r in (parked, lasting)]
        listed = await rt.tracker.query(MessageQuery(queue="far-parked"), limit=10)
        assert len(listed.items) == 1
        again = await app.enqueue(RebuildProfile(user="u1"), expires_at=NEVER)
        assert again.outcome == "discarded"
        assert (parked.not_before, lasting.expires_at) == (LATEST, LATEST)
        assert [(r.not_before, r.expires_at) for r in stored if r is not None] == [
            (LATEST, None),
            (None, LATEST),
        ]
    finally:
        await rt.close()


@queue("stored-profiles", idempotent=True, identity="user")
class Profile(QueueMessage):
    user: str
    version: int


async def test_a_resent_old_version_of_an_identity_is_a_duplicate_and_the_newer_one_runs(sql_db):
    """A producer's retry (an outbox replayed) of an idempotent version that ran long ago, while a newer
    version of its identity waits: its older body was written over the newer one's, the receipt said
    ``replaced`` and the newer content never ran (found in review). A stored id of an idempotent type,
    finished or of another type's row, was told ``enqueued`` and announced with nothing written."""
    app = QueueingApp("stored-profiles")
    seen: list[int] = []
    told: list[Any] = []

    @app.handler()
    async def handle(msg: Profile) -> None:
        seen.append(msg.version)

    @app.hooks.on(Event.ENQUEUED)
    async def enqueued(observation: Any) -> None:
        told.append(observation.envelope.message_id)

    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        v1 = Profile(user="u1", version=1)
        await app.enqueue(v1)
        await run_until_idle(rt)
        v2 = Profile(user="u1", version=2)
        waiting = await app.enqueue(v2, delay=timedelta(hours=1))
        assert waiting.outcome == "enqueued"
        again = await app.enqueue(v1)
        assert (again.outcome, again.message_id) == ("duplicate", v1.message_id)
        assert told == [v1.message_id, v2.message_id]  # (the duplicate was not announced)
        # another type's stored row under the id: nothing written either, and said so
        stray = await app.enqueue(Recalc(account="a"))
        other = await app.enqueue(Profile(user="u2", version=1, message_id=stray.message_id))
        assert other.outcome == "duplicate"
        # the newer version, brought forward, runs with its own content
        await app.enqueue(v2)
        await run_until_idle(rt)
        assert seen == [1, 2]
    finally:
        await rt.close()
