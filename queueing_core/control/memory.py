"""In-memory control store: one process only (tests, in-process provider)."""

from __future__ import annotations

import asyncio
import copy
from datetime import datetime
from typing import Any
from uuid import UUID

from ..clock import Clock, utcnow
from ..options import CircuitBreakerOptions
from . import circuit
from .base import CANCEL_KEPT, CircuitState, ControlState, PauseKind


class MemoryControlStore:
    def __init__(self, clock: Clock = utcnow) -> None:
        """``clock``: the time a cancellation request's age is read against (the durable stores read
        it against theirs: the SQL provider's clock, the wall clock on Tables)."""
        self.clock = clock
        self._queues: set[str] = set()
        self._types: set[str] = set()
        self._schedules: set[str] = set()
        self._circuits: dict[str, CircuitState] = {}
        self._cancels: dict[UUID, datetime] = {}
        self._identities: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}
        self._lock = asyncio.Lock()

    async def state(self) -> ControlState:
        # a request past its keeping time is no longer one, as the durable stores read it
        since = self.clock() - CANCEL_KEPT
        return ControlState(
            frozenset(self._queues),
            frozenset(self._types),
            dict(self._circuits),
            paused_schedules=frozenset(self._schedules),
            cancelled=frozenset(k for k, at in self._cancels.items() if at > since),
        )

    async def set_cancel(self, message_id: UUID, requested: bool, now: datetime) -> None:
        for old in [k for k, at in self._cancels.items() if at < now - CANCEL_KEPT]:
            del self._cancels[old]
        if requested:
            self._cancels[message_id] = now  # a request made again is kept from now (as SQL and Tables)
        else:
            self._cancels.pop(message_id, None)

    async def identity_doc(self, type_name: str, identity: str) -> tuple[dict[str, Any], object] | None:
        found = self._identities.get((type_name, identity))
        return None if found is None else (copy.deepcopy(found[0]), found[1])

    async def put_identity_doc(
        self, type_name: str, identity: str, doc: dict[str, Any], token: object | None
    ) -> bool:
        found = self._identities.get((type_name, identity))
        if (found[1] if found is not None else None) != token:
            return False
        self._identities[(type_name, identity)] = (copy.deepcopy(doc), (found[1] if found else 0) + 1)
        return True

    async def set_paused(self, kind: PauseKind, name: str, paused: bool) -> None:
        target = {"queue": self._queues, "type": self._types, "schedule": self._schedules}[kind]
        (target.add if paused else target.discard)(name)

    def _get(self, type_name: str) -> CircuitState:
        return self._circuits.get(type_name) or CircuitState.closed(type_name)

    async def record_failure(
        self, type_name: str, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
    ) -> CircuitState:
        async with self._lock:
            current = self._get(type_name)
            new = circuit.on_failure(current, opts, now, probe_until)
            if new is None:
                return current
            self._circuits[type_name] = new
            return new

    async def record_success(self, type_name: str, probe_until: datetime | None = None) -> CircuitState:
        async with self._lock:
            current = self._get(type_name)
            new = circuit.on_success(current, probe_until)
            if new is None:
                return current
            self._circuits.pop(type_name, None)
            return new

    async def acquire_probe(self, type_name: str, opts: CircuitBreakerOptions, now: datetime) -> bool:
        async with self._lock:
            new = circuit.acquire_probe(self._get(type_name), opts, now)
            if new is None:
                return False
            self._circuits[type_name] = new
            return True

    async def release_probe(self, type_name: str, held_until: datetime, now: datetime) -> None:
        async with self._lock:
            new = circuit.release_probe(self._get(type_name), held_until, now)
            if new is not None:
                self._circuits[type_name] = new

    async def reset_circuit(self, type_name: str) -> None:
        async with self._lock:
            self._circuits.pop(type_name, None)
