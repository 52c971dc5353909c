"""Every concurrent change of a circuit is applied on PostgreSQL: a burst of failures from many
handlers on two hosts is counted in full, none refused (test_tables.py runs the same check on memory,
Tables and SQLite)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from queueing_core.options import CircuitBreakerOptions

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
MANY = CircuitBreakerOptions(failure_threshold=1000)


async def test_concurrent_failures_are_all_counted_on_postgres(pg_db):
    """96 failures at once from two hosts, on a type with no row yet (the first writers race to create
    it) and again on the row they made: each one counted, none raising. Before the fix a compare-and-set
    retried 20 times without a pause and some callers gave up (RuntimeError), their failures lost."""
    a, b = (pg_db.provider().control_store() for _ in range(2))
    results = await asyncio.gather(
        *(s.record_failure("T", MANY, T0) for s in [a, b] * 48), return_exceptions=True
    )
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert (await b.state()).circuit("T").consecutive_failures == 96
    # each caller saw its own failure applied: the counts it got back are 1..96, once each
    assert sorted(r.consecutive_failures for r in results) == list(range(1, 97))

    results = await asyncio.gather(
        *(s.record_failure("T", MANY, T0) for s in [b, a] * 48), return_exceptions=True
    )
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert (await a.state()).circuit("T").consecutive_failures == 192


async def test_concurrent_failures_open_the_breaker_at_its_threshold_on_postgres(pg_db):
    """80 failures at once against a threshold of 80: the breaker is open once they are all in, and a
    reset among a burst is applied too (it took the same path and could give up the same way)."""
    a, b = (pg_db.provider().control_store() for _ in range(2))
    opts = CircuitBreakerOptions(failure_threshold=80, cooldown=timedelta(seconds=30))
    await asyncio.gather(*(s.record_failure("T", opts, T0) for s in [a, b] * 40))
    state = (await a.state()).circuit("T")
    assert (state.state, state.consecutive_failures) == ("open", 80)

    results = await asyncio.gather(
        *(s.record_failure("U", MANY, T0) for s in [a, b] * 40),
        a.reset_circuit("U"),
        return_exceptions=True,
    )
    assert [r for r in results if isinstance(r, BaseException)] == []
    # the reset came somewhere among them: every failure was applied, those before it counted 1..k
    # and gone with it, those after it counted again from 1
    final = (await b.state()).circuit("U").consecutive_failures
    before = 80 - final
    counts = sorted(r.consecutive_failures for r in results[:80])
    assert counts == sorted([*range(1, before + 1), *range(1, final + 1)])
