"""The raw text of a record split across the Tables properties Raw0..Raw2.

A property holds at most _PART_UNITS UTF-16 units and a part may not end inside a surrogate pair, so a
part is cut a unit short wherever a pair straddles its end. Raw text was clipped to exactly three full
parts, and a text whose pairs sat at odd offsets (one ASCII character before a run of emoji) no longer
fitted: every write of its record failed, and the history writer dropped the record after its retries.
"""

from __future__ import annotations

from datetime import UTC, datetime
from uuid import uuid4

import pytest

from queueing_core.providers.tables import _PART_UNITS, _RAW_PARTS, _record_entity
from queueing_core.tracking import MessageRecord

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
EMOJI = "\N{GRINNING FACE}"  # one character, two UTF-16 units


def units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def dead_letter(raw: str, at: datetime = T0) -> MessageRecord:
    """A dead letter that was no envelope, ``raw`` its text."""
    return MessageRecord(
        message_id=uuid4(),
        tracking_id=uuid4(),
        type="unknown",
        queue="orders",
        status="DeadLettered",
        reason="MalformedMessage",
        created_at=at,
        updated_at=at,
        raw=raw,
    )


def raw_parts(raw: str) -> list[str]:
    e = _record_entity(dead_letter(raw))
    return [e[f"Raw{i}"] for i in range(_RAW_PARTS)]


@pytest.mark.parametrize("prefix", range(4))
def test_a_raw_text_too_long_for_its_parts_is_cut_to_fit_whatever_its_alignment(prefix):
    raw = "a" * prefix + EMOJI * 60_000  # 120,000 units and more: cut short
    parts = raw_parts(raw)
    assert all(units(p) <= _PART_UNITS for p in parts)
    for p in parts:
        p.encode("utf-8")  # no half of a pair at either end (that would not encode)
    text = "".join(parts)
    assert text.startswith("a" * prefix + EMOJI)
    assert text.endswith(f"...[truncated, {len(raw)} chars]")


def test_a_raw_text_whose_pairs_straddle_every_part_boundary_fits():
    # each part of a full-length text ends where a pair would be cut, so each holds a unit less
    raw = ("a" * (_PART_UNITS - 1) + EMOJI + "a" * (_PART_UNITS - 3) + EMOJI) + "a" * _PART_UNITS
    assert units(raw) == _RAW_PARTS * _PART_UNITS
    parts = raw_parts(raw)
    assert [units(p) for p in parts[:2]] == [_PART_UNITS - 1, _PART_UNITS - 1]
    assert all(units(p) <= _PART_UNITS for p in parts)
    assert "".join(parts).startswith(raw[: _PART_UNITS * 2 - 2])


def test_a_raw_text_that_fits_is_kept_whole():
    raw = "a" + EMOJI * 47_000  # 94,001 units
    assert "".join(raw_parts(raw)) == raw
