"""A decision's texts hold nothing a store refuses (U+0000, a lone surrogate): one settlement a store
refuses failed its whole batch on every try (tests/integration/test_settle_batch_apart.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from queueing_core.decisions import (
    Complete,
    DeadLetter,
    DeadLetterReason,
    Defer,
    Release,
    RetryAfter,
)
from queueing_core.messages import MessageStatus

BAD = "a\x00b \ud800 c"


def _storable(text: str) -> bool:
    text.encode("utf-8")  # raises for a lone surrogate
    return "\x00" not in text


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda t: RetryAfter(timedelta(0), t), "error"),
        (lambda t: DeadLetter(DeadLetterReason.NON_RETRYABLE, t), "description"),
        (lambda t: Defer(datetime.now(UTC), MessageStatus.SLEEPING, t), "reason"),
        (lambda t: Release(t), "reason"),
        (lambda t: Complete(None, cancelled=True, reason=t), "reason"),
    ],
    ids=["retry", "dead-letter", "defer", "release", "complete"],
)
def test_each_decision_text_is_storable(make, field):
    text = getattr(make(BAD), field)
    assert _storable(text)
    assert text == "a\ufffdb \ufffd c"  # only what no store keeps is replaced
    assert getattr(make("plain text"), field) == "plain text"


def test_a_decision_without_a_text_keeps_none():
    assert Complete().reason is None
