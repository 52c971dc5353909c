"""Structured logging: one line per outcome carrying message id and correlation id."""

from __future__ import annotations

import json
import logging
import re
from datetime import UTC, datetime
from typing import Any, Literal

#: what ends a line or steers a terminal: the C0 and C1 controls and Unicode's line and paragraph
#: separators. Written into a text log as they are, a value holding one (a correlation id sent to
#: the ops API, a message type read from an envelope) started a line of its own, forged
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

#: a URL's query string, from its '?' to the next space or quote, when it holds a ``name=value``:
#: an error's text may quote the URL it failed on, and a Storage SAS token is that query string
_URL_QUERY = re.compile(r"""\?[^\s'"<>]*=[^\s'"<>]*""")


def one_line(text: str) -> str:
    """``text`` as one line: each control character as its escape (``\\n``, ``\\x1b``, ``\\u2028``)."""
    return _CONTROL.sub(_escape, text)


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    return _ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def without_url_queries(text: str) -> str:
    """``text`` (an SDK error's) with every URL query string shown as ``?…``: it may carry a secret
    (a SAS token's ``sig=``), and is never worth a log line."""
    return _URL_QUERY.sub("?…", text)


#: attributes every LogRecord has; anything else was passed in ``extra=`` and is structured data
_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def structured_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **structured_fields(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...`` for people at a terminal, one line per record
    (a traceback, when there is one, follows on lines of its own)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (the message and the extras only: ``format`` adds the traceback after, its lines kept)
        line = super().formatMessage(record)
        extra = " ".join(f"{k}={v}" for k, v in structured_fields(record).items() if v is not None)
        return one_line(f"{line} {extra}" if extra else line)


def configure_logging(level: str = "INFO", fmt: Literal["text", "json"] = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the Azure SDKs log every HTTP request at INFO
    logging.getLogger("azure").setLevel(logging.WARNING)
