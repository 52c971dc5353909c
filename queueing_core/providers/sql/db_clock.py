"""The database's clock, for the SQL provider's leases.

Every host claims, renews and sweeps leases on one table. Were each to use its own clock, a host whose
clock runs ahead would read another host's live lease as lapsed and sweep it: a second run, or on a
message's last attempt a dead letter although the live run succeeds; one whose clock runs behind would
write leases that the others read as lapsed already. The database is the one clock every host shares,
so a lease's end is the host's clock corrected by its difference to the database's. The difference is
read when the provider opens and again at most once a minute (one round trip, with a claim or the
upkeep).

Only leases: a message's own times (``not_before``, expiry) are stamped by its producer's clock and
judged by the pipeline's, both the host's, and must stay on one clock with the claim that reads them.

A difference within a second is left alone: it is within what a lease's renewal cadence absorbs. Once
corrected, the clock follows the difference until it falls under half a second, so a difference near
a second does not switch the correction on and off at every reading.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from ...clock import Clock, utcnow

log = logging.getLogger("queueing.sql")

#: differences up to this are the host's own (see the module's note)
TOLERANCE = timedelta(seconds=1)
#: how often the difference is read again (host seconds, monotonic)
READ_EVERY = 60.0


class DatabaseClock:
    """A clock that reads the database's time: the host's clock plus the last difference read.

    The SQL provider uses one for its leases by default. A plain callable passed as the provider's
    ``clock`` is used as it is (tests move it to travel in time); a host clock wrapped in this class
    keeps the correction.
    """

    def __init__(self, host: Clock = utcnow, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.offset = timedelta(0)
        self._monotonic = monotonic
        self._read_at: float | None = None

    def __call__(self) -> datetime:
        return self.host() + self.offset

    def due(self) -> bool:
        """Whether the difference should be read again."""
        return self._read_at is None or self._monotonic() - self._read_at >= READ_EVERY

    def failed(self) -> None:
        """A reading that failed: the last difference stands, and the next try is a minute later
        (not at every claim while the database is away)."""
        self._read_at = self._monotonic()

    def correct(self, database_now: datetime, before: datetime, after: datetime) -> None:
        """Take the database's reading of its clock, made between ``before`` and ``after`` (host
        time): compared with the midpoint, its error is at most half the round trip."""
        self._read_at = self._monotonic()
        difference = database_now - (before + (after - before) / 2)
        if after - before > TOLERANCE:
            return  # a round trip over a second says too little about either clock: keep the last
        threshold = TOLERANCE / 2 if self.offset else TOLERANCE
        offset = difference if abs(difference) > threshold else timedelta(0)
        if abs(offset - self.offset) > TOLERANCE or bool(offset) != bool(self.offset):
            if offset:
                log.warning(
                    "this host's clock is %.1f s %s the database's: the kit takes the database's time "
                    "for leases (check the host's time synchronisation)",
                    abs(offset.total_seconds()),
                    "behind" if offset > timedelta(0) else "ahead of",
                )
            else:
                log.info("this host's clock agrees with the database's again")
        self.offset = offset
