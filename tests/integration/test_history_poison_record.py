"""One history record the store can never take must not hold back the records of every other message.

The history writer retries what a failed write left in its backlog until it lands, oldest first: a
record no store keeps (found in review: a result holding a lone surrogate, on RabbitMQ and SQS) stayed
at the head of the backlog, and every later record of the host waited behind it, so messages that had
succeeded read Pending for ever. Now the records are written one by one after such a failure; the one
the store refuses while it takes the others is dropped after three such rounds, with an error naming
it (until then, new records wait behind it, so that each round can vouch for the store).
A store that is down takes none of them, and nothing is dropped however long it stays down.
"""

from __future__ import annotations

import contextlib
import logging
import uuid

from queueing_core.tracking.backlog import POISON_STRIKES, HistoryWriter
from tests.contract.harness import wait_until

from .flaky_history import FlakyTracker, RefusesSome, record


async def test_a_record_the_store_refuses_is_dropped_and_the_others_land(caplog):
    bad = uuid.uuid4()
    store = RefusesSome({bad})
    writer = HistoryWriter(store)
    assert not await writer.write([record(bad, "Succeeded")])  # refused: into the backlog
    good: list[uuid.UUID] = []
    with caplog.at_level(logging.ERROR, logger="queueing.history"):
        for n in range(POISON_STRIKES):
            # behind it (the writer is down while it waits): each round lands them and counts a strike
            batch = [uuid.uuid4() for _ in range(3)]
            good += batch
            await writer.write([record(m, "Succeeded") for m in batch])
            await wait_until(lambda b=batch: writer.backlog <= 1, timeout=20, what=f"round {n + 1}")
            assert writer.backlog == (1 if n + 1 < POISON_STRIKES else 0)
        await wait_until(lambda: writer.backlog == 0, timeout=20, what="the backlog to drain")
    for m in good:
        got = await store.get(m)
        assert got is not None
        assert got.status == "Succeeded"
    assert await store.get(bad) is None
    assert str(bad) in caplog.text
    assert "dropped" in caplog.text
    # written directly again, not queued behind anything
    later = uuid.uuid4()
    assert await writer.write([record(later, "Succeeded")])
    await writer.close()


async def test_a_store_that_is_down_drops_nothing():
    store = FlakyTracker()
    store.down = True
    writer = HistoryWriter(store)
    mids = [uuid.uuid4() for _ in range(3)]
    await writer.write([record(m, "Succeeded") for m in mids])
    await wait_until(lambda: writer._strikes == {} and writer.backlog == 3, what="the backlog")
    for _ in range(POISON_STRIKES + 2):
        with contextlib.suppress(ConnectionError):
            await writer._drain_once()
    assert writer.backlog == 3
    assert writer._strikes == {}
    store.down = False
    await wait_until(lambda: writer.backlog == 0, timeout=20, what="the backlog to drain once it is back")
    for m in mids:
        got = await store.get(m)
        assert got is not None
    await writer.close()
