"""The history backlog's poison rule (a record the store refuses while it takes the others is dropped
after three such rounds) must drop nothing while the store is down. A first version also counted a
refusal, in a round where nothing landed, of a record that had a strike already by the same error: a
record refused once by a flaky store was dropped two rounds into a full outage, and its journal row
deleted, although the store would have taken it once back (found by a review)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from queueing_core.tracking import MessageRecord
from queueing_core.tracking.backlog import HistoryWriter
from tests.contract.harness import wait_until

from .flaky_history import FlakyTracker, record


class Blip(FlakyTracker):
    """Down (ConnectionError, as FlakyTracker and the kit's own "down drops nothing" test) until
    ``script`` is set; then one request holding ``victim`` fails (a blip) while the next record lands,
    and right after that the whole store goes down again with the same error."""

    def __init__(self, victim: uuid.UUID) -> None:
        super().__init__()
        self.victim = victim
        self.script = False
        self.blips = 0

    def gate(self, records: Sequence[MessageRecord]) -> None:
        if self.down:
            raise ConnectionError("history store unreachable")
        if self.script and any(r.message_id == self.victim for r in records) and self.blips < 2:
            self.blips += 1  # the chunk's write, then the victim's own write: a flaky moment
            raise ConnectionError("history store unreachable")

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        await super().upsert_newer(records)
        if self.script and self.blips >= 2:
            self.down = True  # the outage proper, right after the other record landed


async def test_a_record_with_one_blip_is_not_dropped_by_a_later_outage(caplog):
    victim, other = uuid.uuid4(), uuid.uuid4()
    store = Blip(victim)
    store.down = True
    writer = HistoryWriter(store)
    await writer.write([record(victim, "Succeeded")])
    await writer.write([record(other, "Succeeded")])
    assert writer.backlog == 2
    store.down = False
    store.script = True  # next round: victim refused once, other lands, then the store is down
    await wait_until(lambda: store.down and writer.backlog <= 1, timeout=10, what="the blip round")
    # the store stays down for a few rounds of the backlog (RETRY_MAX is 2 s)
    await asyncio.sleep(7)
    dropped = writer.backlog == 0
    store.down = False
    store.script = False
    await wait_until(lambda: writer.backlog == 0, timeout=20, what="the backlog once the store is back")
    got = await store.get(victim)
    await writer.close()
    why = " | ".join(r.getMessage() for r in caplog.records if "dropped" in r.getMessage())
    assert not dropped, f"the victim's record was dropped while the store was down: {why}"
    assert got is not None
