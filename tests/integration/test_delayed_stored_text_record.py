"""The history of a delayed-store row whose text is not an envelope, dead-lettered as it was stored
(``record_stored_text``): it is written on the message's own record, found by its id, whatever that
record holds. Its queue and creation time are the record's (on Tables, whose keys hold them, a record
of the row's own values was a second entity beside the message's, which stayed listed waiting); a
record damaged outside the kit keeps the stored text its stand-ins stand for (changed in place), and
one that does not read at all is written anew under its id (reading it failed every try, for ever)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from queueing_core.providers.delayed import DelayedMessage, record_stored_text
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.tables import _INDEX_PK, TablesTracker
from queueing_core.tracking import MessageQuery, MessageRecord

from .test_tables import tables_tracker  # noqa: F401  (the fixture)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
LATER = datetime(2026, 3, 1, 13, 0, tzinfo=UTC)


def _record(queue: str) -> MessageRecord:
    return MessageRecord(
        message_id=uuid.uuid4(),
        tracking_id=uuid.uuid4(),
        type="Job",
        queue=queue,
        status="Sleeping",
        created_at=T0,
        updated_at=T0,
        body={"n": 1},
    )


def _row(rec: MessageRecord, destination: str) -> DelayedMessage:
    # (stored later than the message was created, as a retry's row is)
    return DelayedMessage(
        id=uuid.uuid4(),
        message_id=rec.message_id,
        destination=destination,
        due_at=LATER,
        envelope="not an envelope",
        failures=0,
        created_at=LATER,
    )


async def test_a_damaged_sql_record_keeps_its_stored_text(tmp_path: Path) -> None:
    stores = SideStores(f"sqlite:///{tmp_path}/side.db")
    await stores.open()
    try:
        history = stores.history
        rec = _record("q")
        await history.upsert([rec])
        async with stores.sql.engine.begin() as conn:  # damaged outside the kit: its tracking id and time
            await conn.execute(
                sa.text(f"UPDATE {history._m.name} SET tracking_id='TID-DAMAGED', created_at='not a time'")
            )
        await record_stored_text(history, _row(rec, "q"), "q", "malformed-envelope", "not an envelope", LATER)
        after = await history.get(rec.message_id)
        assert after is not None
        assert after.status == "DeadLettered"
        assert after.reason == "malformed-envelope"
        # the stand-ins a damaged row reads with were not written as the message's values
        assert after.stored == {"tracking_id": "TID-DAMAGED", "created_at": "not a time"}
    finally:
        await stores.close()


async def test_a_tables_record_that_does_not_read_is_written_over(tables_tracker: TablesTracker) -> None:  # noqa: F811
    rec = _record("q")
    await tables_tracker.upsert([rec])
    client = await tables_tracker._table.ready()
    index = await client.get_entity(_INDEX_PK, str(rec.message_id))
    entity = await client.get_entity(index["Pk"], index["Rk"])
    entity["TrackingId"] = "damaged"  # (no record reads it: its read raises)
    await client.update_entity(entity)
    tables_tracker._written.clear()  # (the dispatcher runs on another host than the producer)
    # (its read raised, so did this, every try: the row never left the delayed store)
    await record_stored_text(
        tables_tracker, _row(rec, "q"), "q", "malformed-envelope", "not an envelope", LATER
    )
    after = await tables_tracker.get(rec.message_id)  # (its id now names the record just written)
    assert after is not None
    assert (after.status, after.reason) == ("DeadLettered", "malformed-envelope")


async def test_the_record_keeps_its_queue_and_creation_time(tables_tracker: TablesTracker) -> None:  # noqa: F811
    # the dispatcher's host names the queue from the row's destination, which is the physical name
    # where its app does not register the queue; and the row was stored later than the message
    rec = _record("Orders")
    await tables_tracker.upsert([rec])
    tables_tracker._written.clear()  # (the dispatcher runs on another host than the producer)
    await record_stored_text(
        tables_tracker, _row(rec, "pfx-orders"), "pfx-orders", "malformed-envelope", "not an envelope", LATER
    )
    listed = (await tables_tracker.query(MessageQuery(queue="Orders"))).items
    assert [(r.message_id, r.status) for r in listed] == [(rec.message_id, "DeadLettered")]
    assert (await tables_tracker.query(MessageQuery(queue="pfx-orders"))).items == []
    after = await tables_tracker.get(rec.message_id)
    assert after is not None
    assert after.created_at == T0
