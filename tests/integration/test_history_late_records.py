"""Late records of the history kept apart from the transport (Storage Queues, Service Bus, RabbitMQ,
SQS): an older record (a producer's "Pending", a stale run's outcome) never replaces a newer one in the
writer's backlog, in its on-disk journal (across processes), or in the store's late write; a producer's
record never replaces an outcome there whatever its clock says; and a run's record after which the
message runs again at once (a release, a retry by copy), written directly but landing after the next
run's outcome, does not replace it either (the late write's rule, by ``updated_at``).
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from queueing_core.clock import utcnow
from queueing_core.tracking import MemoryTracker, MessageQuery, MessageRecord, Tracker
from queueing_core.tracking.backlog import HistoryWriter, Journal
from tests.contract.harness import wait_until

from .flaky_history import T0, FlakyTracker, record


def dead_letter(mid: uuid.UUID, seconds: float) -> MessageRecord:
    return record(mid, "DeadLettered", seconds, attempt=1, reason="NonRetryable", description="declined")


class FlakyStore(FlakyTracker):
    """The flaky tracker of test_history_converges, naming its store (so the writer keeps a journal)."""

    @property
    def store_id(self) -> str:
        return "review:flaky"


@contextlib.asynccontextmanager
async def _store_down(tmp_path: Path) -> AsyncIterator[tuple[FlakyStore, HistoryWriter]]:
    """A history writer with its journal, open, before a store whose writes fail (until ``down`` is
    cleared)."""
    store = FlakyStore()
    writer = HistoryWriter(store, journal_dir=tmp_path)
    writer.open()
    store.down = True
    try:
        yield store, writer
    finally:
        await writer.close()


def _gone_owner() -> str:
    """The owner mark of a process that has exited (its journal rows are anyone's to write)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return f"{proc.pid}:gone"


# -- the writer's backlog and journal ----------------------------------------------------------------


async def test_an_older_record_queued_later_does_not_replace_a_waiting_dead_letter(tmp_path: Path):
    """While the store is down a dead letter waits in the backlog; the producer's "Pending" of the same
    message (its send returned before the worker's outcome, its write failed after it) is queued after
    it. Before: ``_keep`` and ``Journal.add`` replaced the dead letter with the older "Pending", which
    then landed: the dead letter never showed (so it could not be retried from the dashboard)."""
    mid = uuid.uuid4()
    async with _store_down(tmp_path) as (store, writer):
        assert not await writer.write([dead_letter(mid, 2)])  # the worker's outcome
        assert not await writer.write([record(mid, "Pending", 0, body={"n": 1})])  # the producer's, older
        # the journal (what a restart would write) holds the dead letter too
        rows = writer.journal._db.execute("SELECT record FROM pending").fetchall()  # type: ignore[union-attr]
        assert [MessageRecord.model_validate_json(r).status for (r,) in rows] == ["DeadLettered"]
        store.down = False
        assert await writer.settle(10)
        got = await store.get(mid)
        assert got is not None
        assert got.status == "DeadLettered"
        assert got.body == {"n": 1}  # what the older record knew and the newer did not is kept


async def test_a_waiting_record_replaced_by_a_newer_one_keeps_the_original_its_copy_left_behind(
    tmp_path: Path,
):
    """A Service Bus run sent its retry's copy but could not complete the original: its record names
    that original (``copied_from``), whose return is then completed as a known duplicate. The store is
    down; the copy's own newer record queues behind it. The newer one is kept, and the mark with it
    (found in review: only the body and raw text were carried over, and the original ran again)."""
    mid = uuid.uuid4()
    async with _store_down(tmp_path) as (store, writer):
        left = record(mid, "Failed", 1, attempt=1, last_error="gateway down", copied_from="42")
        assert not await writer.write([left])
        assert not await writer.write([record(mid, "Succeeded", 2, attempt=2)])  # the copy's run
        store.down = False
        assert await writer.settle(10)
        got = await store.get(mid)
        assert got is not None
        assert (got.status, got.copied_from) == ("Succeeded", "42")


async def test_a_record_written_directly_does_not_drop_a_newer_outcome_waiting_in_the_backlog(tmp_path: Path):
    """A waiting outcome is forgotten only when what was written is at least as new, and the outcome is
    never forgotten for a producer's record (which the store does not let replace an outcome)."""
    mid = uuid.uuid4()
    async with _store_down(tmp_path) as (store, writer):
        assert not await writer.write([dead_letter(mid, 2)])
        writer._task.cancel()  # type: ignore[union-attr]  # (the drain is held back: a write gets there first)
        store.down = False
        writer._down = False  # a drain of another chunk succeeded meanwhile
        assert await writer.write([record(mid, "Pending", 3)])  # a producer whose clock runs ahead
        assert writer.backlog == 1  # the dead letter still waits
        assert writer.journal is not None
        assert writer.journal.count() == 1


async def test_a_journal_row_is_not_replaced_by_an_older_record_from_another_process(tmp_path: Path):
    """Two processes on one machine share the journal of one store. The worker kept a dead letter and
    died before the store came back; a producer process journaled its older "Pending" of the same
    message meanwhile. Before: the "Pending" replaced the row, the heir wrote it, and the dead letter was
    gone from the history for good."""
    worker = Journal(tmp_path / "j.sqlite3")
    producer = Journal(tmp_path / "j.sqlite3")
    mid = uuid.uuid4()
    worker.add([dead_letter(mid, 2)])
    assert producer.add([record(mid, "Pending", 0)]) == {}  # not kept: a newer record waits
    worker._db.execute("UPDATE pending SET owner = ?", (_gone_owner(),))  # the worker died
    worker.close()
    producer.close()
    heir = Journal(tmp_path / "j.sqlite3")
    try:
        assert [r.status for _, r in heir.take_over()] == ["DeadLettered"]
    finally:
        heir.close()


async def test_a_newer_record_still_replaces_the_journal_row(tmp_path: Path):
    """The rule cuts one way only: the next outcome of the message replaces its earlier row, and a
    journal of an earlier version (no time column) takes records as before."""
    journal = Journal(tmp_path / "j.sqlite3")
    mid = uuid.uuid4()
    first = journal.add([record(mid, "Failed", 1, last_error="boom")])
    second = journal.add([record(mid, "Succeeded", 5)])
    assert second[mid] != first[mid]
    journal._db.execute("UPDATE pending SET updated = 0")  # a row an earlier version left
    assert mid in journal.add([record(mid, "Succeeded", 4)])
    journal.close()


async def test_a_waiting_producers_record_does_not_hold_back_a_runs_record(tmp_path: Path):
    """A producer reads its clock after the send; a worker that ran the message at once read an earlier
    time for its "Failed". The producer's "Pending" waits in the journal: the run's record replaces it
    (found in review: the time rule alone kept the "Pending", and the "Failed" was never written)."""
    journal = Journal(tmp_path / "j.sqlite3")
    mid = uuid.uuid4()
    journal.add([record(mid, "Pending", 5, body={"n": 1})])
    assert mid in journal.add([record(mid, "Failed", 3, attempt=1, last_error="boom")])
    assert mid not in journal.add([record(mid, "Pending", 6)])  # and no producer's over the outcome
    journal.close()


async def test_a_journal_of_an_earlier_version_knows_its_producers_rows(tmp_path: Path):
    """A journal file written before the rows said whose record they keep: opening it reads that from
    the records, so a waiting producer's row does not hold back a run's record there either (found in
    review: the new column's default read every such row as a run's)."""
    path = tmp_path / "j.sqlite3"
    mid = uuid.uuid4()
    old = sqlite3.connect(path)
    old.execute(  # the journal's table as the version before kept it
        "CREATE TABLE pending (seq INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL UNIQUE,"
        " record TEXT NOT NULL, added REAL NOT NULL, owner TEXT NOT NULL, settled INTEGER NOT NULL DEFAULT 1,"
        " updated REAL NOT NULL DEFAULT 0, outcome INTEGER NOT NULL DEFAULT 0)"
    )
    producers = record(mid, "Pending", 5, body={"n": 1})
    old.execute(
        "INSERT INTO pending (message_id, record, added, owner, updated) VALUES (?, ?, 0, 'gone', ?)",
        (str(mid), producers.model_dump_json(), producers.updated_at.timestamp()),
    )
    old.commit()
    old.close()
    journal = Journal(path)
    try:
        assert mid in journal.add([record(mid, "Failed", 3, attempt=1, last_error="boom")])
    finally:
        journal.close()


class CountingTracker(MemoryTracker):
    """A memory tracker that says which records went by the late write's rule."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: list[str] = []

    async def upsert_newer(self, records):  # type: ignore[no-untyped-def]
        self.checked += [r.status for r in records]
        await super().upsert_newer(records)


async def test_only_records_whose_message_runs_again_take_the_checked_write():
    """The checked write costs Azure Tables a read and two writes a record where a batch costs one
    write: it is taken only where a next run's record can land first, which is after every record but
    an outcome and a producer's (a review found a retry due 30 s later written plainly: one Tables write
    can take longer than that, and it put "Failed" over the retry's "Succeeded")."""
    store = CountingTracker()
    due = T0 + timedelta(seconds=10)  # (the records' time)
    writer = HistoryWriter(store, clock=lambda: due)
    records = [
        record(uuid.uuid4(), "Succeeded", 10),
        record(uuid.uuid4(), "Pending", 10, reason="Released: host shutting down"),
        # released early (its not_before, the producer's, still ahead): claimable again at once all the same
        record(
            uuid.uuid4(), "Pending", 10, reason="Released: host shutting down", not_before=due + timedelta(60)
        ),
        record(uuid.uuid4(), "Failed", 10, last_error="boom", not_before=due + timedelta(seconds=1)),
        record(uuid.uuid4(), "Failed", 10, last_error="boom", not_before=due + timedelta(seconds=30)),
        record(uuid.uuid4(), "Paused", 10, reason="queue paused", not_before=due + timedelta(seconds=5)),
        record(uuid.uuid4(), "Pending", 10, body={"n": 1}),  # a producer's
    ]
    assert await writer.write(records)
    await writer.close()
    assert sorted(store.checked) == ["Failed", "Failed", "Paused", "Pending", "Pending"], store.checked
    for rec in records:
        got = await store.get(rec.message_id)
        assert got is not None
        assert got.status == rec.status


# -- the stores' late-write rule (their fix belongs to the trackers) -------------------------------


@pytest.fixture(params=["memory", "tables", "sql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tracker]:
    if request.param == "memory":
        yield MemoryTracker()
        return
    if request.param == "tables":
        from azure.data.tables.aio import TableClient

        from queueing_core.providers.tables import TablesTracker

        azurite = request.getfixturevalue("azurite")
        name = "review" + uuid.uuid4().hex[:12]
        tr = TablesTracker(
            TableClient.from_connection_string(azurite.connection_string, name), create_table=True
        )
        yield tr
        await tr.aclose()
        return
    from queueing_core.providers.sql.history import SideStores

    stores = SideStores(f"sqlite:///{tmp_path}/history.db")
    await stores.open()
    yield stores.history
    await stores.close()


async def test_a_late_pending_with_a_later_clock_never_replaces_a_dead_letter(store: Tracker):
    """The worker recorded the dead letter directly; the producer's "Pending" waited in its backlog (its
    write failed) and is written late. The producer's host clock runs 1 s ahead of the worker's."""
    mid = uuid.uuid4()
    await store.upsert([dead_letter(mid, 2)])
    writer = HistoryWriter(store)
    writer._down = True  # the producer's direct write failed: its record goes to the backlog
    await writer.write([record(mid, "Pending", 3, body={"n": 1})])
    await wait_until(lambda: writer.backlog == 0, timeout=10)
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "DeadLettered"


async def test_a_stale_runs_record_written_late_never_replaces_the_next_runs_outcome(store: Tracker):
    """Worker A released the message at shutdown (its history write slow); worker B took it at once and
    dead-lettered it, and its record landed first."""
    mid = uuid.uuid4()
    await store.upsert([dead_letter(mid, 2)])  # worker B
    writer = HistoryWriter(store)
    await writer.write([record(mid, "Pending", 1, reason="Released: shutdown")])  # worker A
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "DeadLettered"


async def test_a_retry_record_written_late_never_replaces_the_copys_outcome(store: Tracker):
    """Worker A failed the message and sent its retry copy, due at once; worker B ran the copy and
    succeeded, and B's record landed before A's "Failed"."""
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Succeeded", 2, attempt=2)])  # worker B
    writer = HistoryWriter(store)
    await writer.write([record(mid, "Failed", 1, attempt=1, last_error="boom")])  # worker A
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "Succeeded"


async def test_a_retry_record_whose_settlement_took_seconds_never_replaces_the_copys_outcome(store: Tracker):
    """Worker A retried the message 3 s later and sent the copy; its settlement's later part failed for
    seconds and its record is written only when the settler gave the batch up, 6 s after it was made.
    Worker B ran the copy meanwhile and its "Succeeded" landed first. Found in review: the record was
    judged by when it was made (due 3 s after it, so no run could have overtaken it) and replaced B's."""
    mid = uuid.uuid4()
    made = utcnow() - timedelta(seconds=6)
    await store.upsert(
        [
            record(mid, "Succeeded", 0, attempt=2).model_copy(
                update={"updated_at": made + timedelta(seconds=4)}
            )
        ]
    )
    late = record(mid, "Failed", 0, attempt=1, last_error="boom").model_copy(
        update={"updated_at": made, "not_before": made + timedelta(seconds=3)}
    )
    writer = HistoryWriter(store)
    await writer.write([late])  # worker A, at the give-up
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "Succeeded"


async def test_a_retry_due_later_whose_write_is_slow_never_replaces_the_retrys_outcome(store: Tracker):
    """Worker A failed the message, its retry due 30 s later; its history write was slow (an SDK's tries
    and timeouts on a throttled store: minutes at worst), and worker B ran the retry and recorded
    "Succeeded" first. Found in review: a record due seconds later was written plainly, and landed
    over B's."""
    mid = uuid.uuid4()
    now = utcnow()
    await store.upsert([record(mid, "Succeeded", 0, attempt=2).model_copy(update={"updated_at": now})])
    slow = record(mid, "Failed", 0, attempt=1, last_error="boom").model_copy(
        update={"updated_at": now - timedelta(seconds=40), "not_before": now - timedelta(seconds=10)}
    )
    writer = HistoryWriter(store, clock=lambda: now - timedelta(seconds=40))  # (when A's write began)
    await writer.write([slow])
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "Succeeded"


async def test_a_runs_record_older_than_an_operators_retry_never_replaces_the_reopened_record(store: Tracker):
    """The worker dead-lettered the message and its record waited (the store was down); the history
    still said "Pending" (the producer's), the operator retried it (the letter was found and held),
    the copy went out, and the record was reopened. Then the dead letter's record landed. Found in
    review: the reopened record looked like a producer's, which a run's record replaces whatever its
    time: history said "DeadLettered" while the copy waited, and a second retry sent a second copy."""
    from queueing_core.tracking.base import RETRIED_BY_OPERATOR, reopened

    mid = uuid.uuid4()
    await store.upsert([record(mid, "Pending", 0, body={"n": 1})])  # the producer's
    seen = await store.get(mid)
    assert seen is not None
    await store.reopen(reopened(seen, T0 + timedelta(seconds=10), None))  # the operator's retry
    await store.upsert_newer([dead_letter(mid, 5)])  # the worker's record, late
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.reason) == ("Pending", RETRIED_BY_OPERATOR)
    await store.upsert_newer([record(mid, "Succeeded", 12, attempt=1)])  # the copy's run: newer
    got = await store.get(mid)
    assert got is not None
    assert got.status == "Succeeded"


async def test_a_late_record_that_names_the_original_a_copy_left_behind_keeps_that_mark(store: Tracker):
    """The run's record naming the original its copy left behind lands after the copy's own newer
    outcome: the outcome stays, and the mark is kept with it."""
    if type(store).__name__ == "SideStoreHistory" or not hasattr(store, "note_copied"):
        pytest.skip("only Service Bus leaves an original behind, and its history is in Tables")
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Succeeded", 2, attempt=2, body={"n": 1})])
    await store.upsert_newer(  # type: ignore[attr-defined]
        [record(mid, "Failed", 1, attempt=1, last_error="gateway down", copied_from="42")]
    )
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.copied_from) == ("Succeeded", "42")


async def test_a_runs_newer_record_written_directly_still_replaces_the_stored_one(store: Tracker):
    """The rule drops only older records: a release, a retry and an outcome in turn each land."""
    mid = uuid.uuid4()
    writer = HistoryWriter(store)
    await store.upsert([record(mid, "Pending", 1)])  # the producer's
    for seconds, status, extra in (
        (2, "Pending", {"reason": "Released: shutdown"}),
        (3, "Failed", {"last_error": "boom"}),
        (4, "Succeeded", {}),
    ):
        await writer.write([record(mid, status, seconds, **extra)])
        got = await store.get(mid)
        assert got is not None
        assert (got.status, got.reason, got.last_error) == (
            status,
            extra.get("reason"),
            extra.get("last_error"),
        )
    await writer.close()


async def test_a_runs_record_is_not_held_back_by_the_producers_later_clock(store: Tracker):
    """The producer's "Pending" (its clock read after the send) is stored first with a later time than
    the worker's "Failed" of a retry due at once, and of a deferral: both land, written at once and
    from the backlog (found in review: the late write's time rule dropped them)."""
    writer = HistoryWriter(store)
    try:
        for status, extra in (
            ("Failed", {"last_error": "boom"}),
            ("Paused", {"reason": "queue 'work' is paused"}),
        ):
            for late in (False, True):
                mid = uuid.uuid4()
                await store.upsert([record(mid, "Pending", 5, body={"n": 1})])  # the producer's
                writer._down = late  # (True: the write goes by the backlog)
                soon = T0 + timedelta(seconds=4)
                await writer.write([record(mid, status, 3, attempt=1, not_before=soon, **extra)])
                await wait_until(lambda: writer.backlog == 0, timeout=10)
                got = await store.get(mid)
                assert got is not None
                assert (got.status, late) == (status, late)
                assert got.body == {"n": 1}
    finally:
        await writer.close()


async def test_a_messages_records_in_one_write_end_with_its_last(store: Tracker):
    """Two records of one message in one write with the same time (a batch's clock): the last stays,
    as the stores fold a write's records."""
    mid = uuid.uuid4()
    writer = HistoryWriter(store)
    await writer.write([record(mid, "Failed", 3, last_error="boom"), record(mid, "Succeeded", 3)])
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert got.status == "Succeeded"


async def test_a_late_record_of_the_run_before_does_not_replace_a_running_handlers_progress(store: Tracker):
    """A progress report (``Leased``, nothing else said) is a run's record, not a producer's: the late
    "Failed" of the run before it, 7 s older, does not replace it (found in review)."""
    mid = uuid.uuid4()
    progress = {"step": 1, "total": 2, "text": None, "at": None}
    await store.upsert([record(mid, "Leased", 10, attempt=2, progress=progress)])
    writer = HistoryWriter(store)
    writer._down = True  # (the late record comes by the backlog)
    await writer.write([record(mid, "Failed", 3, attempt=1, last_error="boom")])
    await wait_until(lambda: writer.backlog == 0, timeout=10)
    await writer.close()
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.progress) == ("Leased", progress)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("Pending", "Released: host shutting down"),  # the checked write (the message may run again)
        ("Succeeded", None),  # the plain write (an outcome: nothing runs after it)
    ],
)
async def test_tables_does_not_make_a_deleted_message_again_without_its_body(
    store: Tracker, request: pytest.FixtureRequest, status: str, reason: str | None
):
    """An operator deleted the message's history on another host; this host's write of a later record
    of it without its body, checked or plain, finds nothing. Azure Tables, which sends a message's body
    and id index once per host, does not make the record again from it (found in review: made again,
    it had neither, and no lookup found it)."""
    if type(store).__name__ != "TablesTracker":
        pytest.skip("only the Tables store sends a known message's body and index once")
    mid = uuid.uuid4()
    writer = HistoryWriter(store)
    await writer.write([record(mid, "Pending", 1, body={"n": 1})])  # (this host wrote it)
    from azure.data.tables.aio import TableClient

    from queueing_core.providers.tables import TablesTracker

    azurite = request.getfixturevalue("azurite")
    table = store._table.client.table_name  # type: ignore[attr-defined]
    other = TablesTracker(TableClient.from_connection_string(azurite.connection_string, table))
    try:  # the operator, on another host
        assert await other.delete(MessageQuery(), only=[mid]) == 1
    finally:
        await other.aclose()
    assert await writer.write([record(mid, status, 2, reason=reason)]) is True  # (no backlog to hide in)
    await writer.close()
    assert await store.get(mid) is None
    assert mid not in {r.message_id for r in (await store.query(MessageQuery())).items}


def _tables_only(store: Tracker) -> None:
    if type(store).__name__ != "TablesTracker":
        pytest.skip("only the Tables store sends a known message's body and index once")


async def _delete_elsewhere(store: Tracker, request: pytest.FixtureRequest, *mids: uuid.UUID) -> None:
    """The operator deletes these messages' history on another host."""
    from azure.data.tables.aio import TableClient

    from queueing_core.providers.tables import TablesTracker

    azurite = request.getfixturevalue("azurite")
    table = store._table.client.table_name  # type: ignore[attr-defined]
    other = TablesTracker(TableClient.from_connection_string(azurite.connection_string, table))
    try:
        assert await other.delete(MessageQuery(), only=list(mids)) == len(mids)
    finally:
        await other.aclose()


async def _listed(store: Tracker) -> set[uuid.UUID]:
    return {r.message_id for r in (await store.query(MessageQuery())).items}


async def test_tables_updates_the_known_messages_of_one_write_but_the_deleted_one(
    store: Tracker, request: pytest.FixtureRequest
):
    """Several records of messages this host wrote go in one transaction of updates; one of them was
    deleted meanwhile, which fails the whole transaction: the others are still written, the deleted one
    is not made again, and a message this host never wrote, in the same call, is written whole."""
    _tables_only(store)
    mids = [uuid.uuid4() for _ in range(3)]
    await store.upsert([record(mid, "Leased", 1, body={"n": i}) for i, mid in enumerate(mids)])
    await _delete_elsewhere(store, request, mids[1])
    stranger = uuid.uuid4()
    await store.upsert([*(record(mid, "Succeeded", 2) for mid in mids), record(stranger, "Succeeded", 2)])
    for i in (0, 2):
        got = await store.get(mids[i])
        assert got is not None
        assert (got.status, got.body) == ("Succeeded", {"n": i})
    assert await store.get(mids[1]) is None
    got = await store.get(stranger)
    assert got is not None
    assert got.status == "Succeeded"
    assert await _listed(store) == {mids[0], mids[2], stranger}


async def test_tables_does_not_make_a_deleted_message_again_from_a_progress_report(
    store: Tracker, request: pytest.FixtureRequest
):
    """A running handler's progress report reads like a first record (no reason, no worker): inserted
    unless an outcome is stored. Without its body, for a message this host wrote and the operator
    deleted meanwhile, it is not made again either (with it, it is: the test below)."""
    _tables_only(store)
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Leased", 1, body={"n": 1})])
    await _delete_elsewhere(store, request, mid)
    await store.upsert([record(mid, "Leased", 2, progress={"done": 1})])
    assert await store.get(mid) is None
    assert mid not in await _listed(store)


async def test_tables_writes_the_next_run_of_a_deleted_message_whole(
    store: Tracker, request: pytest.FixtureRequest
):
    """A deleted message the transport still held runs again on this host: its history is written
    again, whole (body and id index), after a record without its body was dropped."""
    _tables_only(store)
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Leased", 1, body={"n": 1})])
    await _delete_elsewhere(store, request, mid)
    await store.upsert([record(mid, "Succeeded", 2)])  # without its body: dropped
    assert await store.get(mid) is None
    await store.upsert([record(mid, "Leased", 3, body={"n": 1}, locked_by="w2")])  # its next run
    await store.upsert([record(mid, "Succeeded", 4)])
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.body) == ("Succeeded", {"n": 1})
    assert await _listed(store) == {mid}


@pytest.mark.parametrize(
    ("status", "fields", "checked"),
    [
        ("Succeeded", {}, False),  # an outcome, the plain write
        ("Leased", {"progress": {"done": 1}}, False),  # a progress report: a first record's write
        ("Pending", {"reason": "Released: host shutting down"}, True),  # the checked write
    ],
)
async def test_tables_writes_a_deleted_messages_record_again_whole_when_it_carries_its_body(
    store: Tracker,
    request: pytest.FixtureRequest,
    status: str,
    fields: dict[str, object],
    checked: bool,
):
    """A record of a message this host wrote that carries its body (a worker's always does) is written
    whole after a delete, as a host that never wrote the message would write it: found by its id,
    with its body, listed once."""
    _tables_only(store)
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Leased", 1, body={"n": 1})])
    await _delete_elsewhere(store, request, mid)
    late = record(mid, status, 2, body={"n": 1}, **fields)
    if checked:
        await store.upsert_newer([late])  # type: ignore[attr-defined]
    else:
        await store.upsert([late])
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.body) == (status, {"n": 1})
    assert await _listed(store) == {mid}
    assert mid in store._written  # type: ignore[attr-defined]  # (known again: sent without its body)
    await store.upsert([record(mid, "Succeeded", 3)])
    got = await store.get(mid)
    assert got is not None
    assert (got.status, got.body) == ("Succeeded", {"n": 1})


@pytest.mark.parametrize("count", [1, 2])  # one update, and a transaction of updates
async def test_tables_does_not_drop_a_known_messages_record_when_the_table_is_gone(
    store: Tracker, request: pytest.FixtureRequest, count: int
):
    """A missing table is not a missing entity: the write fails (the history writer keeps the record
    and tries again) instead of dropping the record as deleted."""
    _tables_only(store)
    from queueing_core.errors import ProviderError

    mids = [uuid.uuid4() for _ in range(count)]
    await store.upsert([record(mid, "Leased", 1, body={"n": 1}) for mid in mids])
    await store._table.client.delete_table()  # type: ignore[attr-defined]
    with pytest.raises(ProviderError):
        await store.upsert([record(mid, "Succeeded", 2) for mid in mids])
    assert all(mid in store._written for mid in mids)  # type: ignore[attr-defined]  # (not forgotten)


@pytest.mark.parametrize("body", [None, {"n": 1}])
async def test_tables_a_delete_between_the_read_and_the_merge_is_a_deleted_message(
    store: Tracker, request: pytest.FixtureRequest, body: dict[str, int] | None
):
    """The checked write reads the entity, then merges on its ETag; the operator's delete lands in
    between (the merge answers 404). That is the message deleted meanwhile, not a failed write: the
    record is dropped without its body and written whole with it, and nothing is raised."""
    _tables_only(store)
    mid = uuid.uuid4()
    await store.upsert([record(mid, "Leased", 1, body={"n": 1})])
    client = store._table.client  # type: ignore[attr-defined]
    update = client.update_entity
    deleted: list[bool] = []

    async def delete_first(*args: object, **kwargs: object) -> object:
        if not deleted and kwargs.get("etag") is not None:  # the checked merge, once
            deleted.append(True)
            await _delete_elsewhere(store, request, mid)
        return await update(*args, **kwargs)

    client.update_entity = delete_first
    try:
        await store.upsert_newer([record(mid, "Pending", 2, reason="Released: stop", body=body)])  # type: ignore[attr-defined]
    finally:
        client.update_entity = update
    assert deleted == [True]
    got = await store.get(mid)
    if body is None:
        assert got is None
        assert mid not in await _listed(store)
    else:
        assert got is not None
        assert (got.status, got.body) == ("Pending", body)
        assert await _listed(store) == {mid}


async def test_a_delete_as_listed_takes_a_record_only_while_it_is_as_it_was_listed(store: Tracker) -> None:
    """A purge lists records, then deletes their history: one changed meanwhile stays, even where
    the purge listed other records of its new status (an operator's retry made a dead letter Pending
    while the purge also listed Pending ones), or where it came back to the status it was listed with
    (the retried copy dead-lettered again: a new letter, written later). Guards by the set of listed
    statuses, then by each record's status alone, took them (found in reviews). None: whichever."""
    moved_on, back_again, as_listed, any_status = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    await store.upsert(
        [
            record(moved_on, "Pending", 2),
            record(back_again, "DeadLettered", 3),
            record(as_listed, "Pending", 1),
            record(any_status, "Failed", 1),
        ]
    )
    at = T0 + timedelta(seconds=1)
    listed = {
        moved_on: ("DeadLettered", at),
        back_again: ("DeadLettered", at),
        as_listed: ("Pending", at),
        any_status: None,
    }
    assert await store.delete(MessageQuery(), only=listed) == 2
    for mid, status in ((moved_on, "Pending"), (back_again, "DeadLettered")):
        kept = await store.get(mid)
        assert kept is not None
        assert kept.status == status
    assert await store.get(as_listed) is None
    assert await store.get(any_status) is None
