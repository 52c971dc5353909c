"""Structured logging: one line per outcome carrying message id and correlation id."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

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
    """``time level logger message key=value ...`` for people at a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extra = structured_fields(record)
        if not extra:
            return base
        return base + " " + " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)


def configure_logging(level: str = "INFO", fmt: Literal["text", "json"] = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # the Azure SDKs log every HTTP request at INFO
    logging.getLogger("azure").setLevel(logging.WARNING)
