"""Message history: what happened to each message, for the ops API."""

from .base import (
    Activity,
    ActivitySource,
    ChangesInPlace,
    MessageQuery,
    MessageRecord,
    Page,
    Removed,
    Reopen,
    Tracker,
    nothing_to_reopen,
    record_change,
    record_from_envelope,
)
from .memory import MemoryTracker

__all__ = [
    "Activity",
    "ActivitySource",
    "ChangesInPlace",
    "MemoryTracker",
    "MessageQuery",
    "MessageRecord",
    "Page",
    "Removed",
    "Reopen",
    "Tracker",
    "nothing_to_reopen",
    "record_change",
    "record_from_envelope",
]
