"""An open circuit on the SQL provider, on SQLite and PostgreSQL: the claim leaves a held type's rows
alone, and once the cooldown ends one message probes (the claim keeps its index: test_sql_provider)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from queueing_core import CircuitBreakerOptions, QueueingApp, QueueMessage, RetryPolicy, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until


class CountingClaims(SqlProvider):
    """The real provider, counting the rows its claims hand out."""

    claimed = 0

    async def receive(self, sub, max_messages):
        got = await super().receive(sub, max_messages)
        self.claimed += len(got)
        return got


@queue(
    "held-backlog",
    max_concurrency=4,
    max_attempts=100,
    retry=RetryPolicy(base=timedelta(milliseconds=20), factor=1.0, jitter=0),
    circuit_breaker=CircuitBreakerOptions(failure_threshold=1, cooldown=timedelta(seconds=2)),
)
class Charge(QueueMessage):
    n: int


async def test_an_open_circuit_stops_claims_except_the_probe(sql_db):
    """500 rows behind an open circuit for 6 s: only one probe per 2 s cooldown is claimed; before the
    fix the whole backlog was claimed and deferred again and again."""
    calls: list[int] = []
    app = QueueingApp("circuits")

    @app.handler()
    async def charge(msg: Charge) -> None:
        calls.append(msg.n)
        raise ConnectionError("payment gateway down")

    prov = CountingClaims(sql_db.url, schema=sql_db.schema, maintenance_interval=0.2)
    sql_db.providers.append(prov)
    rt = Runtime(app, prov, control_ttl=0.05)
    await app.enqueue_many([Charge(n=i) for i in range(500)])
    async with running(rt) as worker:
        await wait_until(lambda: _circuit_is(rt, "open"), what="the circuit to open")
        # the handlers that were running when it opened finish (waited for, not a fixed sleep)
        await wait_until(lambda: worker.in_flight == 0, what="the runs in flight at the opening to end")
        claimed, ran = prov.claimed, len(calls)
        started = time.monotonic()
        await asyncio.sleep(6)
        await wait_until(lambda: len(calls) > ran, what="a probe")  # however slow the machine
        window = time.monotonic() - started
        claimed, ran = prov.claimed - claimed, len(calls) - ran
    # at most one per cooldown over the window as it really lasted (a loaded machine stretches it), and
    # one more for its edges
    probes = int(window // 2) + 1
    assert 1 <= ran <= probes, (ran, window)  # the probes ran, nothing else did
    assert claimed <= probes, claimed  # and nothing else was claimed


async def _circuit_is(rt: Runtime, name: str) -> bool:
    rt.control.invalidate()
    return (await rt.control.state()).circuit("Charge").state == name
