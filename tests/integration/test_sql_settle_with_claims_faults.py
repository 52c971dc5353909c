"""The combined settlement-and-claim call (``settle_with_claims``) when part of it goes wrong, on
SQLite and PostgreSQL: a call that commits and then raises (the connection lost after COMMIT, before
the reply), and a settlement refused inside it (its lease passed to another run). Nothing is lost, a
repeated settlement is refused by the lease fence, and the rows claimed by a call whose reply never
came run once their lease lapses."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.sql.rows import Lease
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Worker
from tests.contract.harness import wait_until

#: short, so the rows a lost reply claimed come back within the test
LEASE = timedelta(seconds=3)


@queue("combined-faults", lease_duration=LEASE)
class Job(QueueMessage):
    n: int


def app(ran: Counter[int] | None = None) -> QueueingApp:
    a = QueueingApp("combined-faults")

    @a.handler(max_concurrency=10)
    async def handle(msg: Job) -> None:
        if ran is not None:
            ran[msg.n] += 1

    return a


async def rows(prov: Any) -> dict[int, dict[str, Any]]:
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        found = (await conn.execute(sa.select(m.c.id, m.c.status, m.c.attempt, m.c.last_error))).all()
    return {r.id: {"status": r.status, "attempt": r.attempt, "last_error": r.last_error} for r in found}


async def test_a_combined_call_that_commits_then_raises_loses_nothing(sql_db, monkeypatch, caplog):
    """The first combined call commits (its settlements and its claim) and then fails as a lost
    connection would: the settler settles the batch again (refused by the lease fence: already
    settled), and the rows the call claimed, which no handler received, come back when their lease
    lapses and run then, once each."""
    ran: Counter[int] = Counter()
    a = app(ran)
    prov = sql_db.provider(settle_with_claims=True)
    rt = Runtime(a, prov)
    await rt.open()
    assert prov.settles_with_claims()
    n = 120
    await a.enqueue_many([Job(n=i) for i in range(n)])
    driver = prov._driver
    original = driver.run
    lost: list[list[int]] = []  # the rows the failed call claimed

    async def commit_then_fail(engine: Any, action: str, work: Any) -> Any:
        results = await original(engine, action, work)
        if action == "a settlement and a claim" and not lost and len(work) > 1 and results[-1].rows:
            lost.append([r["id"] for r in results[-1].rows])
            raise ProviderUnavailable("the connection was lost after COMMIT")
        return results

    monkeypatch.setattr(driver, "run", commit_then_fail)
    async with Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, prefetch=2):
        await wait_until(lambda: len(ran) >= n, timeout=180, what="every handler to run")
        await wait_until(lambda: _all_succeeded(prov, n), timeout=120, what="every message to end Succeeded")
    assert lost, "no combined call carried settlements and claimed rows"
    # every message ran, the stranded rows too (after their lease). Not "exactly once": on a loaded
    # machine a live lease of 3 s may lapse before its renewal, and that duplicate is allowed
    assert set(ran) == set(range(n))
    final = await rows(prov)
    for row in lost[0]:
        # it came back through the lease sweep (which counts the lapsed lease as an attempt)
        assert "lease expired" in (final[row]["last_error"] or ""), final[row]
    assert any("lost after COMMIT" in r.getMessage() for r in caplog.records), "the call did not fail"
    # the batch settled again was refused by the fence: those rows were settled by the first commit
    assert any("not recorded" in r.getMessage() for r in caplog.records if r.name == "queueing.sql")
    await rt.close()


async def _all_succeeded(prov: Any, n: int) -> bool:
    return Counter(r["status"] for r in (await rows(prov)).values())["Succeeded"] == n


async def test_a_refused_settlement_fails_nothing_else_in_the_combined_call(sql_db):
    """Stale settlements (a completion and a retry) ride with live ones: only the stale are refused
    (marked, and their rows, which another run holds, untouched), the live ones commit, and the claim
    returns its rows."""
    prov = sql_db.provider(settle_with_claims=True, listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    sub = a.subscription("Job")
    await a.enqueue_many([Job(n=i) for i in range(8)])
    got = await prov.receive(sub, 4)
    stale_fast, stale_retry, live_fast, live_result = got
    for d in (stale_fast, stale_retry):
        d.handle = Lease(d.handle.row, d.handle.token - 1)  # its lease passed to another run
    claimed = await prov.settle_and_receive(
        [
            Settlement(stale_fast, Complete()),
            Settlement(stale_retry, RetryAfter(delay=timedelta(seconds=30), error="x")),
            Settlement(live_fast, Complete()),
            Settlement(live_result, Complete(result={"ok": 1})),
        ],
        sub,
        10,
    )
    assert [d.refused for d in got] == [True, True, False, False]
    now = await rows(prov)
    assert now[stale_fast.handle.row]["status"] == "Leased"
    assert now[stale_retry.handle.row]["status"] == "Leased"
    assert now[live_fast.handle.row]["status"] == "Succeeded"
    assert now[live_result.handle.row]["status"] == "Succeeded"
    assert len(claimed) == 4
    assert all(now[d.handle.row]["status"] == "Leased" for d in claimed)
    await rt.close()
