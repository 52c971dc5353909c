"""What this process has handled, by queue and outcome, and how long messages waited: kept by hooks,
read by ``GET metrics``. Counters of one process since it started (Prometheus ``rate()`` turns them
into throughput); the counts by status come from the store, as ``GET stats`` reads them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from .clock import utcnow
from .hooks import Event, Hooks, Observation

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
        """The one tally of an app (every runtime of the app shares its hooks, and this)."""
        found = _TALLIES.get(hooks)
        if found is None:
            found = _TALLIES[hooks] = cls()
            hooks.on(*OUTCOMES)(found._count)
            hooks.on(Event.BEGAN)(found._began)
        return found

    def _count(self, obs: Observation) -> None:
        self.handled[(obs.queue, OUTCOMES[obs.event])] += 1

    def _began(self, obs: Observation) -> None:
        env = obs.envelope
        if env is None:
            return
        waited = max(0.0, (utcnow() - (env.not_before or env.created_at)).total_seconds())
        lag = self.lag[obs.queue]
        lag.count += 1
        lag.total += waited
        lag.last = waited
