"""A text log record is one line, whatever its values hold.

Found in review: an outcome line wrote the envelope's correlation id and message type as they were;
a correlation id sent to the ops API holding a newline and a whole made-up log line after it showed
up in the log as a second record (``... INFO queueing.outcome Succeeded AdminGrant ...``).
"""

from __future__ import annotations

import logging
import sys

import pytest

from queueing_core.logs import TextFormatter, one_line

FORGED = "2026-01-01 00:00:00,000 INFO queueing.outcome Succeeded AdminGrant"


def record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("queueing.outcome", logging.INFO, __file__, 1, msg, args, None)
    r.__dict__.update(extra)
    return r


@pytest.mark.parametrize("breaker", ["\n", "\r", "\r\n", "\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c"])
def test_a_value_that_breaks_lines_stays_on_the_line(breaker: str) -> None:
    r = record(
        "%s %s",
        "Succeeded",
        f"OrderPlaced{breaker}{FORGED}",
        message_id="m-1",
        correlation_id=f"c-1{breaker}{FORGED}",
        queue="orders",
    )
    text = TextFormatter().format(r)
    assert len(text.splitlines()) == 1
    assert breaker not in text
    assert "message_id=m-1" in text
    assert text.count(FORGED) == 2  # (both still there to read, escaped, on the one line)


def test_control_characters_are_written_as_their_escapes() -> None:
    assert one_line("a\nb\rc\td\x1b[31me\u2028f\x00g") == "a\\nb\\rc\\td\\x1b[31me\\u2028f\\x00g"
    assert one_line("plain text, é and ünïcode") == "plain text, é and ünïcode"


def test_a_traceback_keeps_its_lines() -> None:
    try:
        raise ValueError("nope")
    except ValueError:
        r = logging.LogRecord("queueing.worker", logging.ERROR, __file__, 1, "a\nb", (), sys.exc_info())
    lines = TextFormatter().format(r).splitlines()
    assert lines[0].endswith("a\\nb")
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: nope"
