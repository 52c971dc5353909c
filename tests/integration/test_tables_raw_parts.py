"""A dead letter's raw text, any alignment of its surrogate pairs, written to the Tables history.

A raw text too long for its properties is cut to fit them. Its pairs at odd offsets (one ASCII character
before a run of emoji) used to leave a property a unit short and the rest no longer fitting: upsert and
upsert_newer failed every time, and the history writer dropped the record, so the dead letter had no
history.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from queueing_core.providers.tables import TablesTracker
from queueing_core.tracking import MessageRecord
from queueing_core.tracking.backlog import HistoryWriter
from tests.unit.test_tables_raw_parts import EMOJI
from tests.unit.test_tables_raw_parts import dead_letter as letter_of

from .test_tables import tables_tracker  # noqa: F401  (the fixture)

#: a 240 KB body: one ASCII character, then emoji (two UTF-16 units each) from an odd offset
ODD = "a" + EMOJI * 60_000


def dead_letter(raw: str) -> MessageRecord:
    return letter_of(raw, datetime.now(UTC))


async def assert_stored(tracker: TablesTracker, rec: MessageRecord) -> None:
    got = await tracker.get(rec.message_id)
    assert got is not None
    assert got.raw is not None
    assert got.raw.startswith("a" + EMOJI * 10)
    assert got.raw.endswith(f"...[truncated, {len(ODD)} chars]")


async def test_upsert_and_a_late_write_store_a_raw_text_with_pairs_at_odd_offsets(
    tables_tracker: TablesTracker,  # noqa: F811
) -> None:
    now, late = dead_letter(ODD), dead_letter(ODD)
    await tables_tracker.upsert([now])
    await assert_stored(tables_tracker, now)
    await tables_tracker.upsert_newer([late])
    await assert_stored(tables_tracker, late)


async def test_the_history_writer_lands_such_a_record(
    tables_tracker: TablesTracker,  # noqa: F811
    tmp_path: Path,
) -> None:
    writer = HistoryWriter(tables_tracker, journal_dir=tmp_path)
    rec = dead_letter(ODD)
    try:
        assert await writer.write([rec]) is True
    finally:
        await writer.close()
    await assert_stored(tables_tracker, rec)
