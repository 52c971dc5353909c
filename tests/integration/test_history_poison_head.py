"""Three records the store can never take, at the head of the history backlog, held back every record
behind them for ever (found by a review). ``_isolate`` ended a round after three refusals in a row, so no
write of the round lands, nothing vouches, nothing is dropped; and ``_down`` stays True, so every
later record of the host is queued behind them too (history of settled messages never converges)."""

from __future__ import annotations

import uuid

from queueing_core.tracking.backlog import HistoryWriter
from tests.contract.harness import wait_until

from .flaky_history import RefusesSome, record


async def test_three_poison_records_do_not_hold_back_the_others():
    poison = [uuid.uuid4() for _ in range(3)]
    store = RefusesSome(set(poison))
    writer = HistoryWriter(store)
    for p in poison:  # three messages of a type whose records the store refuses, settled in a row
        await writer.write([record(p)])
    good = [uuid.uuid4() for _ in range(5)]
    await writer.write([record(g) for g in good])
    try:
        await wait_until(
            lambda: writer.backlog <= 3, timeout=15, what="the good records to land past the poison ones"
        )
    finally:
        landed = [g for g in good if g in store._records] if hasattr(store, "_records") else None
        down, backlog = writer._down, writer.backlog
        await writer.close(grace=0.1)
    for g in good:
        assert await store.get(g) is not None, (down, backlog, landed)
