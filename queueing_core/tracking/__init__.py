"""Message history: what happened to each message, for the ops API."""

from .base import (
    Activity,
    ActivitySource,
    MessageQuery,
    MessageRecord,
    Page,
    Reopen,
    Tracker,
    nothing_to_reopen,
    record_from_envelope,
)
from .memory import MemoryTracker

__all__ = [
    "Activity",
    "ActivitySource",
    "MemoryTracker",
    "MessageQuery",
    "MessageRecord",
    "Page",
    "Reopen",
    "Tracker",
    "nothing_to_reopen",
    "record_from_envelope",
]
