"""Settling a batch and claiming the next in one transaction (PostgreSQL, durable claims): the two
commit together or not at all, lease fencing still refuses a stale run's settlement inside it, and the
worker's claims carry its settler's buffered settlements without ever holding them for long."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, RetryAfter
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.driver import DriverPath
from queueing_core.providers.sql.rows import Lease
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement, SettlesWithClaims
from queueing_core.worker import Worker
from tests.contract.harness import wait_until


@queue("combined", lease_duration=timedelta(seconds=60))
class Job(QueueMessage):
    n: int


def app(
    ran: Counter[int] | None = None, gate: dict[int, asyncio.Event] | None = None, concurrency: int = 10
) -> QueueingApp:
    a = QueueingApp("combined")

    @a.handler(max_concurrency=concurrency)
    async def handle(msg: Job) -> None:
        if gate is not None and msg.n in gate:
            await gate[msg.n].wait()
        if ran is not None:
            ran[msg.n] += 1

    return a


async def statuses(prov: Any) -> dict[int, tuple[str, int]]:
    """Each row's status and lease token, by row id."""
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.id, m.c.status, m.c.lease_token))).all()
    return {r[0]: (r[1], r[2]) for r in rows}


def count_actions(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The hot path's round trips by what they were (each is one transaction, one commit)."""
    seen: Counter[str] = Counter()
    original = DriverPath.run

    combined = SqlProvider.settle_and_receive

    async def counted(self: DriverPath, engine: Any, action: str, work: Any) -> Any:
        seen[action] += 1
        return await original(self, engine, action, work)

    async def settled_in_claims(self: SqlProvider, settlements: Any, sub: Any, n: int) -> Any:
        got = await combined(self, settlements, sub, n)
        seen["settled in claims"] += len(settlements)
        return got

    monkeypatch.setattr(DriverPath, "run", counted)
    monkeypatch.setattr(SqlProvider, "settle_and_receive", settled_in_claims)
    return seen


async def test_offered_when_asked_for_with_durable_claims_only(pg_db):
    durable = pg_db.provider(settle_with_claims=True, listen=False)
    relaxed = pg_db.provider(settle_with_claims=True, listen=False, durable_claims=False)
    default = pg_db.provider(listen=False)
    assert isinstance(durable, SettlesWithClaims)
    assert not durable.settles_with_claims()  # not open yet: no hot path
    await Runtime(app(), durable).open()
    await Runtime(app(), relaxed).open()
    await Runtime(app(), default).open()
    assert durable.settles_with_claims()
    assert not default.settles_with_claims()  # off unless asked for
    # relaxed claims commit without the WAL flush; a settlement never does: they stay apart
    assert not relaxed.settles_with_claims()


async def test_the_setting_reaches_the_provider(pg_db, monkeypatch):
    from queueing_core.bootstrap import make_provider
    from queueing_core.settings import load_settings

    monkeypatch.setenv("QUEUEING_DATABASE_SCHEMA", pg_db.schema)
    for value, expected in (("true", True), ("false", False)):
        monkeypatch.setenv("QUEUEING_SETTLE_WITH_CLAIMS", value)
        prov = make_provider(load_settings(provider="sql", database_url=pg_db.url))
        assert isinstance(prov, SqlProvider)
        pg_db.providers.append(prov)  # closed by the fixture
        await prov.open(app())
        assert prov.settles_with_claims() is expected


async def test_a_failed_claim_rolls_back_the_settlements_and_the_retry_applies_them(pg_db, monkeypatch):
    prov = pg_db.provider(settle_with_claims=True, listen=False)
    a = app()
    await Runtime(a, prov).open()
    sub = a.subscription("Job")
    await a.enqueue_many([Job(n=i) for i in range(5)])
    first = await prov.receive(sub, 2)
    before = await statuses(prov)
    settlements = [
        Settlement(first[0], Complete()),
        Settlement(first[1], RetryAfter(delay=timedelta(seconds=60), error="again")),
    ]
    seen = count_actions(monkeypatch)
    # the server refuses the claim (a negative LIMIT), after the settlements ran in the same pipeline
    with pytest.raises(Exception, match="LIMIT"):
        await prov.settle_and_receive(settlements, sub, -1)
    assert await statuses(prov) == before  # nothing settled, nothing claimed
    assert not any(d.refused for d in first)

    got = await prov.settle_and_receive(settlements, sub, 10)
    assert seen["a settlement and a claim"] == 2
    assert seen["a settlement"] == seen["a claim"] == 0
    assert len(got) == 3
    assert not any(d.refused for d in first)
    after = await statuses(prov)
    assert after[first[0].handle.row][0] == "Succeeded"
    assert after[first[1].handle.row][0] == "Failed"
    assert [after[d.handle.row][0] for d in got] == ["Leased"] * 3
    # settled once: settling the same runs again is refused by their fences (the tokens moved on)
    await prov.settle(settlements)
    assert all(d.refused for d in first)
    assert await statuses(prov) == after


async def test_a_stale_runs_settlement_is_refused_while_the_claim_still_happens(pg_db):
    prov = pg_db.provider(settle_with_claims=True, listen=False)
    a = app()
    await Runtime(a, prov).open()
    sub = a.subscription("Job")
    await a.enqueue_many([Job(n=i) for i in range(4)])
    stale, live = await prov.receive(sub, 2)
    stale.handle = Lease(stale.handle.row, stale.handle.token - 1)  # its lease passed to another run
    got = await prov.settle_and_receive(
        [Settlement(stale, Complete()), Settlement(live, Complete())], sub, 10
    )
    assert stale.refused
    assert not live.refused
    rows = await statuses(prov)
    assert rows[stale.handle.row][0] == "Leased"  # the live run's, untouched
    assert rows[live.handle.row][0] == "Succeeded"
    assert len(got) == 2
    assert all(rows[d.handle.row][0] == "Leased" for d in got)


async def test_ordered_queues_claim_the_head_only(pg_db):
    @queue("combined-ordered", ordered=True)
    class InLine(QueueMessage):
        n: int

    a = QueueingApp("combined-ordered")
    a.handler(InLine)(lambda msg: None)
    prov = pg_db.provider(settle_with_claims=True, listen=False)
    await Runtime(a, prov).open()
    sub = a.subscription("InLine")
    await a.enqueue_many([InLine(n=i) for i in range(3)])
    [head] = await prov.receive(sub, 10)
    got = await prov.settle_and_receive([Settlement(head, Complete())], sub, 10)
    assert [d.envelope.body["n"] for d in got if d.envelope is not None] == [1]


async def test_a_worker_burns_down_through_combined_claims_each_message_once(pg_db, monkeypatch):
    ran: Counter[int] = Counter()
    a = app(ran)
    prov = pg_db.provider(settle_with_claims=True)
    rt = Runtime(a, prov)
    await rt.open()
    n = 1500
    await a.enqueue_many([Job(n=i) for i in range(n)])
    seen = count_actions(monkeypatch)
    async with Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, prefetch=2):
        await wait_until(lambda: sum(ran.values()) >= n, timeout=180, what="every handler to run")
    assert ran == Counter(range(n))  # each ran once
    rows = await statuses(prov)
    assert Counter(s for s, _ in rows.values()) == Counter({"Succeeded": n})
    # the claims carried settlements (how many depends on timing: a held settlement is flushed on
    # its own when no claim comes soon enough)
    assert seen["settled in claims"] > 0, seen
    commits = seen["a settlement"] + seen["a settlement and a claim"] + seen["a claim"]
    print(f"round trips: {dict(seen)}; {commits} commits for {n} messages")


async def test_a_worker_whose_combined_claim_fails_settles_on_its_own_and_loses_nothing(
    pg_db, monkeypatch, caplog
):
    """The first combined round trip fails on the server (after its settlements ran): nothing was
    settled or claimed, the settler settles them itself, the consumer claims again after its backoff,
    and every message runs once and ends Succeeded."""
    ran: Counter[int] = Counter()
    a = app(ran)
    prov = pg_db.provider(settle_with_claims=True)
    rt = Runtime(a, prov)
    await rt.open()
    n = 300
    await a.enqueue_many([Job(n=i) for i in range(n)])
    failed: list[str] = []
    original = DriverPath.run

    async def fail_once(self: DriverPath, engine: Any, action: str, work: Any) -> Any:
        if action == "a settlement and a claim" and not failed:
            failed.append(action)
            # the claim's statement errs inside the pipeline: its settlements are rolled back with it
            claim, params = work[-1]
            work = [*work[:-1], (claim, {**params, "b_limit": -1})]
        return await original(self, engine, action, work)

    monkeypatch.setattr(DriverPath, "run", fail_once)
    async with Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, prefetch=2):
        await wait_until(lambda: sum(ran.values()) >= n, timeout=180, what="every handler to run")
        await wait_until(lambda: _all(prov, "Succeeded", n), timeout=60, what="every settlement")
    assert failed
    assert any("LIMIT" in r.getMessage() for r in caplog.records if r.name == "queueing.worker"), (
        "the combined claim did not fail"
    )
    assert ran == Counter(range(n))


async def test_a_worker_settles_apart_from_its_claims_by_default(pg_db, monkeypatch):
    ran: Counter[int] = Counter()
    a = app(ran)
    rt = Runtime(a, pg_db.provider())
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(100)])
    seen = count_actions(monkeypatch)
    async with Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=10, prefetch=2):
        await wait_until(lambda: sum(ran.values()) >= 100, timeout=120, what="every handler to run")
    assert seen["a settlement and a claim"] == 0
    assert seen["a settlement"] > 0


async def test_shutdown_flushes_held_settlements(pg_db):
    gate = {i: asyncio.Event() for i in range(1, 4)}
    ran: Counter[int] = Counter()
    a = app(ran, gate, concurrency=4)
    prov = pg_db.provider(settle_with_claims=True, listen=False)
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(4)])
    # four slots, all taken: the one that finishes waits for the claim that half of them free would
    # bring, and the settler holds it for that claim (an hour: only the shutdown can flush it)
    w = Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=4, settle_hold=3600)
    await w.start()
    try:
        await wait_until(lambda: ran[0] == 1, what="the first handler")
        await wait_until(lambda: len(w.settler._buf) == 1, what="its settlement in the settler")
        await asyncio.sleep(0.2)
        assert len(w.settler._buf) == 1  # held for the claim
        stopping = asyncio.create_task(w.shutdown())
        await asyncio.sleep(0.1)
        for g in gate.values():
            g.set()
        await stopping
    finally:
        for g in gate.values():
            g.set()
        await w.shutdown()
    assert Counter(s for s, _ in (await statuses(prov)).values()) == Counter({"Succeeded": 4})


async def test_an_idle_queue_does_not_hold_a_settlement(pg_db):
    """One message, nothing after it: the consumer waits for work, no claim is coming, so the settler
    flushes at once (the hold, an hour here, never applies)."""
    ran: Counter[int] = Counter()
    a = app(ran)
    prov = pg_db.provider(settle_with_claims=True)
    rt = Runtime(a, prov)
    await rt.open()
    async with Worker(rt, poll_min=0.01, poll_max=0.1, settle_hold=3600):
        await a.enqueue(Job(n=1))
        await wait_until(
            lambda: _all(prov, "Succeeded", 1), timeout=60, what="the result without further traffic"
        )


async def test_a_claim_that_does_not_come_holds_settlements_only_briefly(pg_db):
    """Four slots, one handler done and three still running: a claim would come once two are free,
    but they do not finish; the settlement of the one that did is flushed after the bounded hold."""
    gate = {i: asyncio.Event() for i in range(1, 4)}
    ran: Counter[int] = Counter()
    a = app(ran, gate, concurrency=4)
    prov = pg_db.provider(settle_with_claims=True, listen=False)
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Job(n=i) for i in range(4)])
    w = Worker(rt, poll_min=0.01, poll_max=0.1, batch_size=4)
    await w.start()
    try:
        await wait_until(lambda: _all(prov, "Succeeded", 1), timeout=60, what="the finished one's result")
        assert sorted(ran) == [0]
    finally:
        for g in gate.values():
            g.set()
        await w.shutdown()


async def _all(prov: Any, status: str, count: int) -> bool:
    return Counter(s for s, _ in (await statuses(prov)).values())[status] == count
