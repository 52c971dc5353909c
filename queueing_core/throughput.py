"""What this process has handled, by queue and outcome, and how long messages waited: kept by the
decision pipeline, read by ``GET metrics``. Counters of one process since it started (Prometheus
``rate()`` turns them into throughput); the counts by status come from the store, as ``GET stats``
reads them.

The pipeline counts here directly, not through the app's hooks: two hook events per message, each an
``Observation`` and a pass over the hooks, cost three times the counting itself, on every message of
every app, hooks or not."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from .hooks import Event, Hooks

if TYPE_CHECKING:
    from .envelope import Envelope

#: the outcomes counted, by the hook event that reports them
OUTCOMES = {
    Event.SUCCEEDED: "succeeded",
    Event.FAILED: "failed",
    Event.DEAD_LETTERED: "dead_lettered",
    Event.EXPIRED: "expired",
}


_TALLIES: WeakKeyDictionary[Hooks, Throughput] = WeakKeyDictionary()


@dataclass
class Lag:
    count: int = 0
    total: float = 0.0  # seconds
    last: float = 0.0


class Throughput:
    def __init__(self) -> None:
        self.handled: dict[tuple[str, str], int] = defaultdict(int)
        self.lag: dict[str, Lag] = defaultdict(Lag)

    @classmethod
    def of(cls, hooks: Hooks) -> Throughput:
        """The one tally of an app (every runtime and pipeline of the app shares its hooks, and this)."""
        found = _TALLIES.get(hooks)
        if found is None:
            found = _TALLIES[hooks] = cls()
        return found

    def count(self, queue: str, event: Event) -> None:
        """A message of ``queue`` reached the outcome ``event`` tells of (one that is not an outcome,
        deferred or released, is not counted)."""
        outcome = OUTCOMES.get(event)
        if outcome is not None:
            self.handled[(queue, outcome)] += 1

    def began(self, queue: str, env: Envelope, now: datetime) -> None:
        """A handler of ``queue`` is about to run ``env`` at ``now``: how long it waited since it was due."""
        waited = max(0.0, (now - (env.not_before or env.created_at)).total_seconds())
        lag = self.lag[queue]
        lag.count += 1
        lag.total += waited
        lag.last = waited
