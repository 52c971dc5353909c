"""Pause and circuit-breaker state: protocol, pure transitions, in-memory store."""

from .base import CachedControlStore, CircuitState, ControlState, ControlStore
from .memory import MemoryControlStore

__all__ = ["CachedControlStore", "CircuitState", "ControlState", "ControlStore", "MemoryControlStore"]
