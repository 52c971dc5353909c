"""The SQL circuit store on an engine of the caller's (``SqlProvider(url, engine=...)``): SQLite then
begins no transaction before the read (the kit's own engine begins each with ``BEGIN IMMEDIATE``), so
the row is not held between the read and the write. The write checks the version it read, and a change
written in between is tried again: one probe at a time, and every failure counted (an unchecked write
granted every waiting probe at once and lost most failures of a burst: found in review)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from queueing_core.control.base import ControlStore
from queueing_core.options import CircuitBreakerOptions
from queueing_core.providers.sql import SqlProvider

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
async def stores(tmp_path: Path) -> AsyncIterator[list[ControlStore]]:
    url = f"sqlite+aiosqlite:///{tmp_path}/circuits.db"
    providers = [
        SqlProvider(url, engine=create_async_engine(url, connect_args={"timeout": 30})) for _ in range(2)
    ]
    for p in providers:
        await p.ensure_open()
    yield [p.control_store() for p in providers]
    for p in providers:
        await p.close()


async def test_one_probe_at_a_time_on_a_callers_sqlite_engine(stores: list[ControlStore]) -> None:
    opts = CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(seconds=30))
    await stores[0].record_failure("T", opts, T0)  # open
    after = T0 + opts.cooldown + timedelta(seconds=1)
    won = await asyncio.gather(*(stores[i % 2].acquire_probe("T", opts, after) for i in range(10)))
    assert won.count(True) == 1


async def test_every_failure_of_a_burst_is_counted_on_a_callers_sqlite_engine(
    stores: list[ControlStore],
) -> None:
    opts = CircuitBreakerOptions(failure_threshold=1000, cooldown=timedelta(seconds=30))
    await asyncio.gather(*(stores[i % 2].record_failure("T", opts, T0) for i in range(40)))
    state = (await stores[0].state()).circuits["T"]
    assert state.consecutive_failures == 40
