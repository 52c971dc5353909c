"""A clock the test moves by hand, and a provider that is never reached: for tests of the pipeline alone."""

from __future__ import annotations

from datetime import datetime

from queueing_core.transport import Capabilities


class ManualClock:
    """Stands still at ``now`` until the test sets it."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class NullProvider:
    """Enough of a provider for a ``Producer`` whose sends the test never makes."""

    capabilities = Capabilities()
