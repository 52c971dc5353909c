"""A dead letter's description as Service Bus's SDKs take it: at most 4,096 UTF-16 code units (the
.NET SDK a Functions host settles through counts ``string.Length``), never a pair split."""

from queueing_core.providers.servicebus import MAX_DEAD_LETTER_TEXT, dead_letter_text


def _units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2  # (raises on a lone surrogate: none may be left)


def test_a_text_within_the_length_is_kept_as_it_is() -> None:
    text = "é" * MAX_DEAD_LETTER_TEXT
    assert dead_letter_text(text) is text
    assert dead_letter_text("short") == "short"


def test_characters_beyond_the_bmp_count_two_and_a_pair_at_the_cut_is_dropped_whole() -> None:
    text = "a" + "🔥" * 3000  # 3,001 code points, 6,001 units: the cut falls inside a pair
    cut = dead_letter_text(text)
    assert cut == "a" + "🔥" * 2047
    assert _units(cut) == MAX_DEAD_LETTER_TEXT - 1
    even = dead_letter_text("🔥" * 3000)
    assert _units(even) == MAX_DEAD_LETTER_TEXT
