"""Fault injection at the SDK and driver calls a provider makes.

A :class:`CallPoint` names one call (``QueueClient.delete_message``, ``AsyncConnection.execute``,
``SqlHistoryTracker.upsert``) and how that call fails for real (the SDK's own exception type). An
:class:`Injector` wraps every call point of a provider for the span of one multi-step sequence:

- it records the calls made, in order: these are the sequence's steps (checked against the table);
- ``error`` mode: the n-th call raises the SDK's exception, once; the code goes on as it would;
- ``kill`` mode: the process sends itself SIGKILL at the n-th call (a real process, see
  ``test_sigkill.py``);
- ``crash`` mode: the n-th call raises :class:`Crash` (a ``BaseException``, so no ``except Exception``
  catches it) and so does every later call point: the process is dead from that step on, nothing it
  would still send or write reaches a store;
- ``lost`` mode: the n-th call runs (a commit is made, a message sent), then raises the SDK's exception
  as if its answer had been lost on the way back (a connection dropped after the server committed);
- ``refused`` call points fail with the SDK's exception at every call, whatever the mode: a first
  fault that is part of the sequence (a broker refusing the send), so that the n-th step's fault is
  a second one, in the path that handles the first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class Crash(BaseException):
    """The process stops at this step (an injected crash)."""


@dataclass(frozen=True)
class CallPoint:
    name: str
    #: (runtime) -> the class (or object) whose attribute is wrapped
    owner: Callable[[Any], Any]
    attribute: str
    #: () -> the exception the real SDK or driver raises when this call fails
    error: Callable[[], BaseException] | None

    def resolve(self, runtime: Any) -> Any:
        return self.owner(runtime)


@dataclass
class Injector:
    points: list[CallPoint]
    mode: str | None = None  # None (trace only), "error", "crash", "kill" or "lost"
    at: int = -1  # the index of the call (step) to fail
    #: the call points that fail at every call (before it runs), in every mode: name -> the error
    #: (None: the call point's own, an outage)
    refused: Mapping[str, Callable[[], BaseException] | None] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    armed: bool = False
    crashed: bool = False
    fired: bool = False

    def _before(self, point: CallPoint) -> bool:
        """Before the call: True when its answer is to be lost once it has run (``lost`` mode)."""
        if not self.armed:
            return False
        if self.crashed:
            raise Crash(f"already crashed; {point.name} never runs")
        index = len(self.calls)
        self.calls.append(point.name)
        if index != self.at or self.mode is None:
            if point.name in self.refused:
                refusal = self.refused[point.name]
                raise refusal() if refusal is not None else self._error(point)
            return False
        self.fired = True
        if self.mode == "lost":
            return True
        if self.mode == "kill":  # the real thing: the kernel stops the process at this step
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "crash":
            self.crashed = True
            raise Crash(f"crash at step {index} ({point.name})")
        raise self._error(point)

    @staticmethod
    def _error(point: CallPoint) -> BaseException:
        """The SDK's exception of ``point``: raised before the call (``error``) or after it (``lost``)."""
        assert point.error is not None
        return point.error()

    def _wrap(self, point: CallPoint, original: Any) -> Any:
        injector = self
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                lose = injector._before(point)
                result = await original(*args, **kwargs)
                if lose:
                    raise injector._error(point)
                return result

            return async_wrapper

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            lose = injector._before(point)
            result = original(*args, **kwargs)
            if lose:
                raise injector._error(point)
            return result

        return wrapper

    @contextlib.contextmanager
    def installed(self, runtime: Any) -> Iterator[Injector]:
        """Wrap every call point (idle until :meth:`armed_for` arms it)."""
        undo: list[tuple[Any, str, Any]] = []
        try:
            for point in self.points:
                owner = point.resolve(runtime)
                # None: the attribute is inherited (or a bound method of an instance): delete to undo
                own = vars(owner).get(point.attribute) if isinstance(owner, type) else None
                undo.append((owner, point.attribute, own))
                setattr(owner, point.attribute, self._wrap(point, getattr(owner, point.attribute)))
            yield self
        finally:
            for owner, attribute, own in reversed(undo):
                if own is None:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, own)

    @contextlib.contextmanager
    def armed_for(self) -> Iterator[Injector]:
        self.armed = True
        try:
            yield self
        finally:
            self.armed = False
