"""The delayed-message store for transports whose native delay is too short."""

from .breaker import CircuitBreaker
from .dispatcher import (
    FORWARD_FAILED,
    DelayedDispatcher,
    DelayedTarget,
    forward_failed_record,
    record_stored_text,
)
from .store import DelayedMessage, SqlDelayedStore

__all__ = [
    "FORWARD_FAILED",
    "CircuitBreaker",
    "DelayedDispatcher",
    "DelayedMessage",
    "DelayedTarget",
    "SqlDelayedStore",
    "forward_failed_record",
    "record_stored_text",
]
