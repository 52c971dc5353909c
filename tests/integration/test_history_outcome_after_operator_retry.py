"""A run's outcome written at once (``HistoryWriter.write``, not the backlog) whose write is slow lands
after an operator's retry of the message and the retried copy's own outcome: it leaves them in place.

Found in review: outcomes went by the plain upsert ("no run follows an outcome"), so host A's late
"DeadLettered" replaced host B's "Succeeded" of the copy; DeadLettered is retryable, so a second retry
sent a second copy and the handler ran again. The same interleaving through the backlog was already
guarded (``test_a_runs_record_older_than_an_operators_retry_never_replaces_the_reopened_record``).

Each store is written by two trackers, as two hosts write it (one SQL schema on PostgreSQL, one table
on Azurite; the memory store is shared, as one process's).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import pytest

from queueing_core.ops.service import RETRYABLE
from queueing_core.tracking import MemoryTracker, MessageRecord, Tracker
from queueing_core.tracking.backlog import HistoryWriter
from queueing_core.tracking.base import ChangesIfUnchanged, reopening
from tests.services import POSTGRES_URL, drop_schema, require

from .flaky_history import T0, record

Hosts = tuple[Tracker, Tracker]


@pytest.fixture(params=["memory", "tables", "postgresql"])
async def hosts(request: pytest.FixtureRequest) -> AsyncIterator[Hosts]:
    """Host A's and host B's trackers over one history store."""
    if request.param == "memory":
        shared = MemoryTracker()
        yield shared, shared
        return
    if request.param == "tables":
        from azure.data.tables.aio import TableClient

        from queueing_core.providers.tables import TablesTracker

        azurite = request.getfixturevalue("azurite")
        name = "retryoutcome" + uuid.uuid4().hex[:12]
        a = TablesTracker(
            TableClient.from_connection_string(azurite.connection_string, name), create_table=True
        )
        b = TablesTracker(
            TableClient.from_connection_string(azurite.connection_string, name), create_table=True
        )
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()
        return
    require("PostgreSQL", "127.0.0.1", 5432)
    from queueing_core.providers.sql.history import SideStores

    schema = f"t_retry_outcome_{uuid.uuid4().hex[:8]}"
    host_a, host_b = SideStores(POSTGRES_URL, schema=schema), SideStores(POSTGRES_URL, schema=schema)
    try:
        await host_a.open()
        await host_b.open()
        yield host_a.history, host_b.history
    finally:
        await host_a.close()
        await host_b.close()
        await drop_schema(schema)


class SlowWrites:
    """``inner`` whose writes are held before they reach the store until ``gate`` is set (a pool wait, a
    network stall, an SDK's tries); ``held`` is set once one is."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.held = asyncio.Event()

    async def _hold(self) -> None:
        self.held.set()
        await self.gate.wait()

    async def upsert(self, records: Sequence[MessageRecord]) -> None:
        await self._hold()
        await self.inner.upsert(records)

    async def upsert_newer(self, records: Sequence[MessageRecord]) -> None:
        await self._hold()
        await self.inner.upsert_newer(records)

    def __getattr__(self, name: str) -> Any:  # reads, and the rest, as the store does them
        return getattr(self.inner, name)


def dead_letter(mid: uuid.UUID, seconds: float) -> MessageRecord:
    return record(mid, "DeadLettered", seconds, attempt=3, reason="max-attempts-exceeded", description="boom")


async def test_a_slow_outcome_never_replaces_an_operators_retry_and_the_copys_outcome(hosts: Hosts):
    a, b = hosts
    mid = uuid.uuid4()
    await b.upsert([record(mid, "Pending", 0, body={"n": 1})])  # the producer's
    slow = SlowWrites(a)
    writer_a, writer_b = HistoryWriter(slow), HistoryWriter(b)  # type: ignore[arg-type]
    try:
        # host A dead-lettered the message on the broker; its history write is held on the way
        landing = asyncio.create_task(writer_a.write([dead_letter(mid, 1)]))
        await slow.held.wait()
        # the operator's retry (history still reads Pending; the letter is found in the dead-letter
        # queue): the record is reopened by compare-and-set, and the copy is sent
        seen = await b.get(mid)
        assert seen is not None
        assert seen.status == "Pending"
        assert isinstance(b, ChangesIfUnchanged)
        assert await b.change_if_unchanged(seen, reopening(T0 + timedelta(seconds=2), None))
        # the copy runs on host B and succeeds
        assert await writer_b.write([record(mid, "Succeeded", 3, attempt=1, result={"ok": True})])
        slow.gate.set()
        assert await landing  # host A's write went through (and changed nothing)
        got = await b.get(mid)
        assert got is not None
        assert (got.status, got.result) == ("Succeeded", {"ok": True})
        assert got.status not in {s.value for s in RETRYABLE}  # no second retry, no second run
    finally:
        slow.gate.set()
        await writer_a.close()
        await writer_b.close()


async def test_a_slow_outcome_never_replaces_the_reopened_record_while_the_copy_waits(hosts: Hosts):
    """The copy has not run yet when A's outcome lands: history keeps saying the retry waits."""
    a, b = hosts
    mid = uuid.uuid4()
    await b.upsert([record(mid, "Pending", 0, body={"n": 1})])
    slow = SlowWrites(a)
    writer_a = HistoryWriter(slow)  # type: ignore[arg-type]
    try:
        landing = asyncio.create_task(writer_a.write([dead_letter(mid, 1)]))
        await slow.held.wait()
        seen = await b.get(mid)
        assert seen is not None
        assert isinstance(b, ChangesIfUnchanged)
        assert await b.change_if_unchanged(seen, reopening(T0 + timedelta(seconds=2), None))
        slow.gate.set()
        assert await landing
        got = await b.get(mid)
        assert got is not None
        assert (got.status, got.reason) == ("Pending", "retried by an operator")
    finally:
        slow.gate.set()
        await writer_a.close()


async def test_outcomes_written_at_once_still_land_over_the_producers_record_and_in_turn(hosts: Hosts):
    """The rule holds back only older records: a run's outcome replaces the producer's record even when
    the producer's clock reads later (it is read after the send), and a run's records land in turn."""
    a, b = hosts
    writer = HistoryWriter(a)
    try:
        first = uuid.uuid4()
        await b.upsert([record(first, "Pending", 5, body={"n": 1})])  # the producer's, clock ahead
        assert await writer.write([record(first, "Succeeded", 3, attempt=1)])
        got = await b.get(first)
        assert got is not None
        assert (got.status, got.body) == ("Succeeded", {"n": 1})

        turn = uuid.uuid4()
        await b.upsert([record(turn, "Pending", 0, body={"n": 2})])
        for seconds, status, extra in (
            (1, "Failed", {"attempt": 1, "last_error": "boom"}),
            (2, "Failed", {"attempt": 2, "last_error": "boom again"}),
            (3, "DeadLettered", {"attempt": 3, "reason": "max-attempts-exceeded"}),
        ):
            assert await writer.write([record(turn, status, seconds, **extra)])
            got = await b.get(turn)
            assert got is not None
            assert (got.status, got.attempt) == (status, extra["attempt"])
        # an operator's retry, then the copy's outcome, written at once: newer, so it lands
        seen = await b.get(turn)
        assert seen is not None
        assert isinstance(b, ChangesIfUnchanged)
        assert await b.change_if_unchanged(seen, reopening(T0 + timedelta(seconds=4), None))
        assert await writer.write([record(turn, "Succeeded", 5, attempt=1)])
        got = await b.get(turn)
        assert got is not None
        assert (got.status, got.body) == ("Succeeded", {"n": 2})
    finally:
        await writer.close()
