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
alone, a trial of pairs of windows, one claim in flight then two, each of :data:`WINDOW` claims (after
:data:`SETTLE` claims that straddle the change), measures the rows claimed a second of each window.
Each pair says "two" if its window of two claims claimed at least :data:`BETTER` times the rows a
second of its window of one. After :data:`PAIRS` pairs that all say the same, that is the finding;
pairs that disagree are no finding yet, and the trial goes on to :data:`MOST_PAIRS` pairs, whose
median says. The finding stands for :data:`HOLD` seconds, after which the trial runs again. A short
claim (the queue drained) ends a trial unfinished: the next full queue starts it again. Where a
second claim can never start beside the first (a single slot), nothing is asked or tried.

Pairs are judged apart, not the windows' rows and seconds summed: in one of 10 logged burn-downs of
20,000 messages, one window of two claims ran at 2,662 rows a second against 7,166 and 11,315 in the
trial's other two (a stall of the machine's, not of the mode), the sums said two claims claimed 0.75
times the rows of one, and the worker kept one claim where the 9 other trials found two 1.05 to 1.57
times faster. Those pairs said 0.48, 0.88 and 1.70: they disagree, so the trial now runs on.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

#: full claims a trial's window counts (claims of 10 at a few thousand messages a second: about a tenth
#: of a second; claims of 100: about a second)
WINDOW = 20
#: claims that come back after a window's change of mode and before it counts (the previous mode's)
SETTLE = 2
#: pairs of windows (one claim, then two) a trial runs at least: their finding if they all agree
PAIRS = 3
#: pairs a trial runs at most, when the first ones disagree: the median pair's finding (odd: a middle one)
MOST_PAIRS = 5
#: a pair says "two claims" when its window of two claimed at least this many times the rows a second
#: of its window of one
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
        #: the rows a second of each window of the trial done so far, in order: even ones ran one claim,
        #: odd ones two
        self._rates: list[float] = []
        self._rows = 0  # rows of the current window's counted claims
        self._seen = 0  # claims back since this window's mode began
        self._since: float | None = None  # when the window's counted claims began (the last settling one)

    @property
    def trying(self) -> int:
        """The mode the trial's current window runs."""
        return 1 if len(self._rates) % 2 == 0 else 2

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
        self._rows += rows
        if self._seen < SETTLE + WINDOW:
            return
        assert self._since is not None
        seconds = now - self._since
        # (no time measured: no evidence that two claims pay, and the pair says one)
        self._rates.append(self._rows / seconds if seconds > 0 else 0.0)
        self._rows = 0
        self._seen = 0
        found = self._finding()
        if found is not None:
            self.chosen = found
            self.chosen_until = now + HOLD
            self._trial_start()

    def _finding(self) -> int | None:
        """What the pairs measured so far say (None: run another pair)."""
        rates = self._rates
        pairs = len(rates) // 2
        if len(rates) % 2 or pairs < PAIRS:
            return None
        # each pair's two claims against its one (a window of one that measured no time: no evidence)
        ratios = [two / one if one > 0 else 0.0 for one, two in zip(rates[::2], rates[1::2], strict=True)]
        says = {r >= BETTER for r in ratios}
        if len(says) == 1:
            return 2 if says.pop() else 1
        if pairs < MOST_PAIRS:
            return None
        return 2 if statistics.median(ratios) >= BETTER else 1

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
