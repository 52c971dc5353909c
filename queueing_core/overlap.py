"""Whether a worker starts a second claim while its first is on its way (``receives_in_flight="auto"``).

A second claim fills the time a worker waits for the database's answer to its first, so it pays where
that wait is the limit: a lone worker on a server with time to spare (measured on PostgreSQL with
durable claims: 1.2 to 1.4 times the messages a second). It does not pay, and costs, in two cases:

- **other workers share the server**: their claims already fill the server's time, and a second claim
  each only adds work on the cores it shares with them (4 workers on 2 cores: 0.85-0.88 of one claim
  each). Each worker would see its own rate rise at the others' expense, so no worker can judge this
  by its own rate; what it can see is other workers' leases in the database (the provider's
  ``sole_claimer``, asked in the background every :data:`GATE_EVERY` seconds while a queue is full;
  an answer older than :data:`STALE` counts as "not alone"). For the same reason a worker tries two
  claims only for its one backlogged queue: two of its own queues would each judge by their own rate;
- **the server runs one claim's commit after the other's** (a disk whose flushes are slow and do not
  merge): the two claims together move no more rows than one (on such machines two claims were slower
  in 5 of 9 pairs). Only the rate tells; a claim's round trip does not (measured: it doubles with two
  claims where they pay too, since it includes the wait for the worker's own busy event loop).

So, per queue and while its claims come back full: one claim at a time unless this worker is alone;
alone, a trial of :data:`PAIRS` pairs of windows, one claim in flight then two, each of :data:`WINDOW`
claims (after :data:`SETTLE` claims that straddle the change), compares the rows claimed a second; two
claims are kept if they claimed at least :data:`BETTER` times as many, for :data:`HOLD` seconds, after
which the trial runs again. A short claim (the queue drained) ends a trial unfinished: the next full
queue starts it again. Where a second claim can never start beside the first (a single slot), nothing
is asked or tried.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: full claims a trial's window counts (claims of 10 at a few thousand messages a second: about a tenth
#: of a second; claims of 100: about a second)
WINDOW = 20
#: claims that come back after a window's change of mode and before it counts (the previous mode's)
SETTLE = 2
#: windows of each mode in a trial, alternated
PAIRS = 3
#: two claims are kept when they claimed at least this many times the rows a second of one
BETTER = 1.05
#: how long a trial's finding stands, seconds
HOLD = 30.0
#: how often the database is asked whether another worker holds leases, seconds (a worker asks once for
#: all its queues); a worker that took itself for alone when others started with it learns otherwise
#: within this, and goes back to one claim at once
GATE_EVERY = 1.0
#: an answer older than this (the question unanswered since: a slow or silent database) counts as "not
#: alone": one claim
STALE = 3 * GATE_EVERY


class Overlap:
    """The decision for one queue's consumer: :meth:`limit` claims in flight at most (1 or 2)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: no other worker held a lease at the last look (the consumer sets it)
        self.sole = False
        #: the mode a finished trial chose, and until when it stands
        self.chosen = 1
        self.chosen_until = -math.inf
        self._trial_start()

    def _trial_start(self) -> None:
        #: rows claimed and seconds taken, per mode (index 1 and 2), over the trial's windows so far
        self._rows = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._window = 0  # windows of the trial done: even ones run one claim, odd ones two
        self._seen = 0  # claims back since this window's mode began
        self._since: float | None = None  # when the window's counted claims began (the last settling one)

    @property
    def trying(self) -> int:
        """The mode the trial's current window runs."""
        return 1 if self._window % 2 == 0 else 2

    def limit(self) -> int:
        """Claims this queue may have in flight now."""
        if not self.sole:
            return 1
        if self.clock() < self.chosen_until:
            return self.chosen
        return self.trying

    def returned(self, rows: int) -> None:
        """A full claim of ``rows`` came back (call it for every full claim, whatever the mode)."""
        if not self.sole or self.clock() < self.chosen_until:
            return
        now = self.clock()
        self._seen += 1
        if self._seen <= SETTLE:
            self._since = now  # (still the last mode's claims: the window counts from here)
            return
        mode = self.trying
        self._rows[mode] += rows
        if self._seen < SETTLE + WINDOW:
            return
        assert self._since is not None
        self._seconds[mode] += now - self._since
        self._window += 1
        self._seen = 0
        if self._window < 2 * PAIRS:
            return
        timed = self._seconds[1] > 0 and self._seconds[2] > 0  # (no time measured: no evidence, one claim)
        faster = timed and self._rows[2] / self._seconds[2] >= BETTER * self._rows[1] / self._seconds[1]
        self.chosen = 2 if faster else 1
        self.chosen_until = now + HOLD
        self._trial_start()

    def drained(self) -> None:
        """A claim came back short: the queue is drained, and a trial under way ends unfinished (a
        rate measured while the queue ran dry says nothing of two claims)."""
        self._trial_start()

    def alone(self, sole: bool) -> None:
        """Whether this worker may try a second claim now (the only one holding leases, this its one
        backlogged queue). Not alone ends a trial under way and a choice of two claims at once; a choice
        of one stands its time (a worker seen now and then, or a slow answer, must not restart trials
        of two claims where they were found not to pay)."""
        if self.sole and not sole:
            self._trial_start()
            if self.chosen == 2:
                self.chosen_until = -math.inf
        self.sole = sole
