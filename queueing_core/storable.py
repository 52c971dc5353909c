"""Text every store keeps: what a handler hands back (its result, its progress text) made storable.

PostgreSQL keeps neither JSON nor text with U+0000, and no store takes a lone surrogate (text that is
not Unicode, from ``"\\ud800"``), which also fails UTF-8 for every transport's history. A message's own
text is refused at enqueue (``check_sendable``); a handler's result cannot be refused once the work is
done, so such characters are replaced with U+FFFD and the run still succeeds. Left as they were, the
settlement failed on every try (the message ran again, then was dead-lettered although its work was
done) or a history write failed for ever. The same holds for the text of a decision (a handler's
exception text, the reason it gave): one settlement a store refuses fails the whole batch it rides in,
so ``decisions`` keeps its texts storable from the start.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


def _clean(text: str) -> str:
    # UTF-16 pairs what can be paired and replaces lone surrogates; U+0000 is replaced by hand
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text.replace("\x00", REPLACEMENT)


def _unstorable(text: str) -> bool:
    if "\x00" in text:
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def storable_text(text: str) -> str:
    """``text`` as every store keeps it: itself, unless it holds what no store keeps."""
    return _clean(text) if _unstorable(text) else text


def storable(data: Any) -> tuple[Any, bool]:
    """``data`` (JSON-ready: dicts, lists, strings, numbers) with every string a store keeps, and
    whether anything was replaced."""
    if isinstance(data, str):
        kept = storable_text(data)
        return kept, kept is not data
    if isinstance(data, list | tuple):
        items = [storable(x) for x in data]
        return ([x for x, _ in items], True) if any(c for _, c in items) else (data, False)
    if isinstance(data, dict):
        pairs = [(storable(k), storable(v)) for k, v in data.items()]
        if not any(kc or vc for (_, kc), (_, vc) in pairs):
            return data, False
        return {k: v for (k, _), (v, _) in pairs}, True
    return data, False


# -- what a store keeps only in part ---------------------------------------------------------------
#: the key of the marker kept in place of JSON too large to keep whole (a handler's result; a body in
#: a history store with a size limit per record, Azure Tables)
CUT_SHORT = "_truncated"
#: the header a history store adds in place of the headers it dropped to fit its size limit
HEADERS_CUT_SHORT = "x-queueing-truncated"


def cut_short_marker(chars: int, preview: str) -> dict[str, Any]:
    """What is kept in place of JSON of ``chars`` characters too large to keep: its start, and its size."""
    return {CUT_SHORT: True, "_original_chars": chars, "_preview": preview}


def is_cut_short(value: object) -> bool:
    """``value`` is a :func:`cut_short_marker`, not the JSON it stands for."""
    return (
        isinstance(value, dict)
        and value.get(CUT_SHORT) is True
        and "_original_chars" in value
        and "_preview" in value
    )
