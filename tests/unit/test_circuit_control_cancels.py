"""Cancellation requests in the control stores (kept beside the circuits): the memory store keeps them
as the durable stores do. A request older than CANCEL_KEPT is no longer read, and a request made again
is kept from its latest time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from uuid import uuid4

import pytest

from queueing_core.control import MemoryControlStore
from queueing_core.control.base import CANCEL_KEPT
from queueing_core.providers.sql import SqlProvider
from tests.clocks import ManualClock

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["memory", "sqlite"])
async def store_and_clock(request, tmp_path):
    clock = ManualClock(T0)
    if request.param == "memory":
        yield MemoryControlStore(clock=clock), clock
        return
    provider = SqlProvider(f"sqlite:///{tmp_path}/control.db", clock=clock)
    yield provider.control_store(), clock
    await provider.close()


async def test_a_request_older_than_it_is_kept_is_not_read(store_and_clock):
    """Before the fix the memory store dropped old requests only at the next set_cancel: read before
    it, a two-day-old request still cancelled its message."""
    store, clock = store_and_clock
    old, fresh = uuid4(), uuid4()
    await store.set_cancel(old, True, T0 - 2 * CANCEL_KEPT)
    await store.set_cancel(fresh, True, T0 - CANCEL_KEPT + timedelta(minutes=1))
    assert (await store.state()).cancelled == {fresh}
    clock.now = T0 + timedelta(minutes=2)  # the fresh one's day is over too
    assert (await store.state()).cancelled == frozenset()


async def test_a_request_made_again_is_kept_from_its_latest_time(store_and_clock):
    """Before the fix the memory store kept the first time (the request lapsed a day after it, though
    it was made again since)."""
    store, clock = store_and_clock
    mid = uuid4()
    await store.set_cancel(mid, True, T0)
    await store.set_cancel(mid, True, T0 + timedelta(hours=20))
    clock.now = T0 + CANCEL_KEPT + timedelta(hours=1)
    assert mid in (await store.state()).cancelled
    clock.now = T0 + timedelta(hours=20) + CANCEL_KEPT + timedelta(minutes=1)
    assert mid not in (await store.state()).cancelled


async def test_a_withdrawn_request_is_gone(store_and_clock):
    store, _ = store_and_clock
    mid = uuid4()
    await store.set_cancel(mid, True, T0)
    await store.set_cancel(mid, False, T0)
    assert mid not in (await store.state()).cancelled


async def test_the_memory_store_reads_a_request_s_age_on_the_wall_clock_by_default():
    """As Tables does: a request made two days ago is not read (before the fix it was)."""
    from queueing_core.clock import utcnow

    store = MemoryControlStore()
    mid = uuid4()
    await store.set_cancel(mid, True, utcnow() - 2 * CANCEL_KEPT)
    assert mid not in (await store.state()).cancelled
