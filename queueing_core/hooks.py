"""Observing hooks: began, succeeded, failed, dead-lettered, expired, deferred, enqueued.

Hooks observe; they cannot change an outcome. A hook that raises is logged and ignored, so metrics
or logging code can never fail a message.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .decisions import Decision
    from .envelope import Envelope

log = logging.getLogger("queueing.hooks")


class Event(StrEnum):
    ENQUEUED = "enqueued"
    BEGAN = "began"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    EXPIRED = "expired"
    DEFERRED = "deferred"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class Observation:
    event: Event
    envelope: Envelope | None
    queue: str
    attempt: int = 0
    decision: Decision | None = None
    error: BaseException | None = None
    duration: timedelta | None = None


Hook = Callable[[Observation], Awaitable[Any] | Any]


class Hooks:
    def __init__(self) -> None:
        self._hooks: dict[Event, list[Hook]] = {e: [] for e in Event}

    def on(self, *events: Event) -> Callable[[Hook], Hook]:
        """Decorator: ``@app.hooks.on(Event.FAILED, Event.DEAD_LETTERED)``; no events means all."""

        def register(fn: Hook) -> Hook:
            for e in events or tuple(Event):
                self._hooks[e].append(fn)
            return fn

        return register

    def off(self, fn: Hook) -> None:
        """Remove ``fn`` from every event it observes."""
        for hooks in self._hooks.values():
            while fn in hooks:
                hooks.remove(fn)

    def wants(self, event: Event) -> bool:
        return bool(self._hooks[event])

    async def emit(self, obs: Observation) -> None:
        pending = self.notify(obs)
        if pending is not None:
            await pending

    def notify(self, obs: Observation) -> Awaitable[None] | None:
        """Call the hooks of ``obs.event`` in order; an awaitable one returns is awaited before the next
        is called. None when every hook returned without one (the usual case: counters, log lines),
        else what is left to await. The worker tells of two events per message: a message whose hooks
        are all plain functions costs no coroutine here."""
        step = self._call_from(obs, 0)
        return None if step is None else self._then(obs, step)

    def _call_from(self, obs: Observation, i: int) -> tuple[Hook, Awaitable[Any], int] | None:
        """Call the hooks of ``obs.event`` from index ``i`` until one returns an awaitable: that hook,
        its awaitable and the index after it; None once every hook was called."""
        hooks = self._hooks[obs.event]
        while i < len(hooks):  # by index, as a list's iterator goes: a hook added meanwhile is called
            fn = hooks[i]
            i += 1
            try:
                result = fn(obs)
            except Exception:
                log.exception("hook %r failed on %s; ignored", fn, obs.event.value)
                continue
            if result is not None and inspect.isawaitable(result):  # most hooks return None
                return fn, result, i
        return None

    async def _then(self, obs: Observation, step: tuple[Hook, Awaitable[Any], int]) -> None:
        """Await each awaitable a hook returned, then call the hooks after it, in one loop: not a
        coroutine per awaitable hook (no depth that grows with them)."""
        next_step: tuple[Hook, Awaitable[Any], int] | None = step
        while next_step is not None:
            fn, pending, i = next_step
            try:
                await pending
            except Exception:
                log.exception("hook %r failed on %s; ignored", fn, obs.event.value)
            next_step = self._call_from(obs, i)
