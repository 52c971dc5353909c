"""Control-store protocol. Every host and serverless instance must see the same pause/circuit state,
so the durable stores (SQL, Azure Tables) are the real ones; the memory store serves tests and the
in-process provider."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal, Protocol, runtime_checkable
from uuid import UUID

from ..options import CircuitBreakerOptions


async def cas_backoff(attempt: int) -> None:
    """The pause before compare-and-set round ``attempt`` (from 1): jitter spreads competing writers
    (other hosts) so the next round is not another collision."""
    await asyncio.sleep(random.uniform(0, min(0.25, 0.005 * 2**attempt)))  # noqa: S311 - not crypto


CircuitName = Literal["closed", "open", "half_open"]
PauseKind = Literal["queue", "type", "schedule"]

#: how long a cancellation request is kept: a message it names that has not run by then is held by an
#: operator's status or lost track of, and the request only costs every host a row to read. (On SQL a
#: request seldom needs to outlast a delay: the cancel takes a waiting message out of its queue, and a
#: run's settlement that would leave its message waiting settles it Cancelled while a request stands)
CANCEL_KEPT = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class CircuitState:
    type_name: str
    state: CircuitName = "closed"
    consecutive_failures: int = 0
    opened_at: datetime | None = None
    open_until: datetime | None = None
    probe_until: datetime | None = None

    @classmethod
    def closed(cls, type_name: str) -> CircuitState:
        return cls(type_name)


@dataclass(frozen=True, slots=True)
class ControlState:
    paused_queues: frozenset[str] = frozenset()
    paused_types: frozenset[str] = frozenset()
    circuits: Mapping[str, CircuitState] = field(default_factory=dict)
    paused_schedules: frozenset[str] = frozenset()
    #: messages whose cancellation was requested: none of them starts, and a running one is told
    cancelled: frozenset[UUID] = frozenset()

    def is_paused(self, queue: str, type_name: str) -> bool:
        return queue in self.paused_queues or type_name in self.paused_types

    def circuit(self, type_name: str) -> CircuitState:
        return self.circuits.get(type_name) or CircuitState.closed(type_name)


@runtime_checkable
class ControlStore(Protocol):
    async def state(self) -> ControlState:
        """Pauses and every circuit that is not plainly closed: open, half-open, or closed with
        failures counted. The pipeline resets a circuit's count only when it sees one here, so a store
        that left out closed circuits with failures would count failures that are not consecutive."""
        ...

    async def set_paused(self, kind: PauseKind, name: str, paused: bool) -> None: ...

    async def record_failure(
        self, type_name: str, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
    ) -> CircuitState:
        """A transient failure: ``probe_until`` names the probe that ran it (the time it was acquired
        until), None a run that was not a probe (see ``circuit.on_failure``)."""
        ...

    async def record_success(self, type_name: str, probe_until: datetime | None = None) -> CircuitState:
        """A success: ``probe_until`` names the probe that ran it (the time it was acquired until),
        None a run admitted while the circuit was closed (see ``circuit.on_success``)."""
        ...

    async def acquire_probe(self, type_name: str, opts: CircuitBreakerOptions, now: datetime) -> bool: ...

    async def release_probe(self, type_name: str, held_until: datetime, now: datetime) -> None:
        """Hand back the probe acquired until ``held_until``, unrun (see ``circuit.release_probe``)."""
        ...

    async def reset_circuit(self, type_name: str) -> None: ...

    async def set_cancel(self, message_id: UUID, requested: bool, now: datetime) -> None:
        """Request (or withdraw, for an operator's retry) the cancellation of one message; requests
        older than :data:`CANCEL_KEPT` are dropped."""
        ...


class CachedControlStore:
    """Reads the inner store at most once per ``ttl`` seconds; writes go through and invalidate.

    Hot paths (a poll loop, a Functions trigger) ask for the state per message; a short TTL bounds
    both the load on the shared store and how long a pause takes to reach every instance.
    """

    def __init__(self, inner: ControlStore, ttl: float = 1.0) -> None:
        self.inner = inner
        self.ttl = ttl
        self._cached: ControlState | None = None
        self._read_at = 0.0
        self._reading: asyncio.Future[ControlState] | None = None
        self._generation = 0  # bumped by every write, so a read that began before it is not kept

    def fresh(self) -> ControlState | None:
        """The cached state while it is fresh, else None (then :meth:`state` reads it): what
        :meth:`state` would return without a read, for a caller on a hot path that awaits only then."""
        if self._cached is not None and time.monotonic() - self._read_at < self.ttl:
            return self._cached
        return None

    async def state(self) -> ControlState:
        cached = self.fresh()
        if cached is not None:
            return cached
        # single flight: concurrent callers share one read instead of each starting their own
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._refresh())
        reading = self._reading
        return await asyncio.shield(reading)

    async def _refresh(self) -> ControlState:
        generation = self._generation
        try:
            started = time.monotonic()
            state = await self.inner.state()
            if generation == self._generation:
                self._cached, self._read_at = state, started
            return state
        finally:
            self._reading = None

    def invalidate(self) -> None:
        self._generation += 1
        self._cached = None
        self._reading = None

    async def set_paused(self, kind: PauseKind, name: str, paused: bool) -> None:
        await self.inner.set_paused(kind, name, paused)
        self.invalidate()

    async def record_failure(
        self, type_name: str, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
    ) -> CircuitState:
        result = await self.inner.record_failure(type_name, opts, now, probe_until)
        self.invalidate()
        return result

    async def record_success(self, type_name: str, probe_until: datetime | None = None) -> CircuitState:
        result = await self.inner.record_success(type_name, probe_until)
        self.invalidate()
        return result

    async def acquire_probe(self, type_name: str, opts: CircuitBreakerOptions, now: datetime) -> bool:
        result = await self.inner.acquire_probe(type_name, opts, now)
        self.invalidate()
        return result

    async def release_probe(self, type_name: str, held_until: datetime, now: datetime) -> None:
        await self.inner.release_probe(type_name, held_until, now)
        self.invalidate()

    async def reset_circuit(self, type_name: str) -> None:
        await self.inner.reset_circuit(type_name)
        self.invalidate()

    async def set_cancel(self, message_id: UUID, requested: bool, now: datetime) -> None:
        await self.inner.set_cancel(message_id, requested, now)
        self.invalidate()
