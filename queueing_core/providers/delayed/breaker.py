"""The delayed store's circuit breakers (store, fetch and dispatch).

Failures that *continue* - no success in between - for longer than ``time_to_trigger`` trigger the
breaker: it logs once at CRITICAL and from then on the caller backs off ``open_backoff`` seconds
between tries instead of hammering a database or broker that is down. The first success closes it
(logged once). Before it triggers, the back-off is short and grows (a blip costs little).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Literal

from ..sql.errors import first_line as first_line  # one wording of an error in a log line

log = logging.getLogger("queueing.delayed")

BreakerState = Literal["closed", "failing", "open"]


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        time_to_trigger: timedelta = timedelta(seconds=30),
        *,
        open_backoff: float = 10.0,
        max_failing_backoff: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.time_to_trigger = time_to_trigger.total_seconds()
        self.open_backoff = open_backoff
        self.max_failing_backoff = max_failing_backoff
        self._clock = clock
        self.state: BreakerState = "closed"
        self.failures = 0
        self._since: float | None = None
        self._retry_at = 0.0
        #: times it triggered (for tests and metrics)
        self.triggered = 0

    def success(self) -> None:
        if self.state == "open":
            log.warning(
                "%s circuit breaker closed: working again after %d failures", self.name, self.failures
            )
        self.state = "closed"
        self.failures = 0
        self._since = None
        self._retry_at = 0.0

    def failure(self, exc: BaseException) -> float:
        """Record a failure; returns how long the caller should back off (seconds)."""
        now = self._clock()
        self.failures += 1
        if self._since is None:
            self._since = now
            self.state = "failing"
            log.warning(
                "%s failed (%s); its circuit breaker opens if failures continue for %.3gs",
                self.name,
                first_line(exc),
                self.time_to_trigger,
            )
        if self.state != "open" and now - self._since >= self.time_to_trigger:
            self.state = "open"
            self.triggered += 1
            log.critical(
                "%s circuit breaker triggered: failing for %.3gs (%d failures, last: %s); "
                "backing off %.3gs between tries",
                self.name,
                now - self._since,
                self.failures,
                first_line(exc),
                self.open_backoff,
            )
        # before it triggers, never back off longer than once it has
        delay = (
            self.open_backoff
            if self.state == "open"
            else min(self.max_failing_backoff, self.open_backoff, 0.05 * 2 ** min(self.failures, 16))
        )
        self._retry_at = now + delay
        return delay

    def blocked(self) -> float:
        """Seconds before an open breaker lets the next try through (0: go ahead)."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._retry_at - self._clock())
