"""The schedule tick stores, one contract: memory, SQL (tick and messages in one transaction, on SQLite
and PostgreSQL), the SQL side database's claim-send-confirm (RabbitMQ, SQS) and Azure Tables (Azurite).

Two handles on one store stand for two hosts. Each step of a tick can fail: the tick is then sent
again later (a duplicate with the same message ids at worst), never lost.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.envelope import Envelope
from queueing_core.producer import build_envelope
from queueing_core.providers.sql import SqlProvider
from queueing_core.schedules import TickStore, tick_message_id
from tests.tick_stores import two_tick_stores

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


@queue("pings")
class Ping(QueueMessage):
    n: int = 0


@dataclass
class Hosts:
    kind: str
    a: TickStore
    b: TickStore
    provider: SqlProvider | None = None
    sent: list[list[uuid.UUID]] = field(default_factory=list)

    async def send(self, envelopes: Sequence[Envelope]) -> None:
        self.sent.append([e.message_id for e in envelopes])

    def envelopes(self, tick: datetime) -> list[Envelope]:
        app = QueueingApp("t")
        return [
            build_envelope(app, Ping(n=i, message_id=tick_message_id("s", tick, i)), T0) for i in range(2)
        ]

    async def delivered(self, tick: datetime) -> int:
        """How many times the tick's messages reached the transport."""
        ids = {tick_message_id("s", tick, i) for i in range(2)}
        if self.provider is not None and getattr(self.a, "writes_messages", False):
            m = self.provider.tables.messages
            async with self.provider.engine.connect() as conn:
                found = (await conn.execute(sa.select(m.c.message_id).where(m.c.message_id.in_(ids)))).all()
            return len(found) // 2
        return sum(1 for batch in self.sent if set(batch) == ids)


@pytest.fixture(params=["memory", "sqlite", "sqlite-claim", "postgres", "postgres-claim", "tables"])
async def hosts(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Hosts]:
    async with two_tick_stores(request.param, request, tmp_path) as (a, b, provider):
        yield Hosts(request.param, a, b, provider)


async def test_two_hosts_firing_one_tick_at_once_send_it_once(hosts: Hosts) -> None:
    for k in range(3):
        tick = T0 + timedelta(seconds=k)
        envs = hosts.envelopes(tick)
        won = await asyncio.gather(
            *(h.fire("s", tick, envs, hosts.send, T0) for h in (hosts.a, hosts.b, hosts.a, hosts.b))
        )
        assert sorted(won) == [False, False, False, True]
        assert await hosts.delivered(tick) == 1
    assert await hosts.b.last_ticks(["s", "other"]) == {"s": T0 + timedelta(seconds=2)}


async def test_a_failed_send_leaves_the_tick_to_run_again(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    tick = T0
    envs = hosts.envelopes(tick)

    async def broken(envelopes: Sequence[Envelope]) -> None:
        raise ConnectionError("transport down")

    if getattr(hosts.a, "writes_messages", False):
        assert hosts.provider is not None
        # the tick's row and its messages are one transaction: break the messages' insert
        monkeypatch.setattr(
            hosts.provider, "rows_for", lambda *a: (_ for _ in ()).throw(ConnectionError("down"))
        )
    with pytest.raises(ConnectionError):
        await hosts.a.fire("s", tick, envs, broken, T0)
    monkeypatch.undo()
    # the next round, on the other host: the tick is due again (never claimed, or its claim lapsed)
    again = await hosts.b.unfinished("s", T0 + timedelta(seconds=1))
    last = (await hosts.b.last_ticks(["s"])).get("s")
    assert again == [tick] or last is None
    assert await hosts.b.fire("s", tick, envs, hosts.send, T0 + timedelta(seconds=1))
    assert await hosts.delivered(tick) == 1
    assert not await hosts.a.fire("s", tick, envs, hosts.send, T0 + timedelta(seconds=2))


async def test_a_host_dying_between_claim_and_send_loses_no_tick(hosts: Hosts) -> None:
    claim = getattr(hosts.a, "_claim", None)
    if claim is None or getattr(hosts.a, "writes_messages", False):
        pytest.skip(f"{hosts.kind}: the claim and the send are one step")
    tick = T0
    envs = hosts.envelopes(tick)
    if hosts.kind == "tables":
        assert await claim("s", tick, T0) is not None
    else:
        assert await claim({"schedule": "s", "tick_at": tick, "messages": 2, "fired_at": T0}, T0)
    # the claim holds while its host may still send: nobody else sends, and later ticks wait
    assert await hosts.b.unfinished("s", T0 + timedelta(seconds=5)) == []
    assert not await hosts.b.fire("s", tick, envs, hosts.send, T0 + timedelta(seconds=5))
    # once it lapses, one host takes it over and sends it
    later = T0 + LEASE + timedelta(seconds=1)
    assert await hosts.b.unfinished("s", later) == [tick]
    won = await asyncio.gather(*(h.fire("s", tick, envs, hosts.send, later) for h in (hosts.a, hosts.b)))
    assert sorted(won) == [False, True]
    assert await hosts.delivered(tick) == 1
    assert await hosts.a.unfinished("s", later + LEASE * 2) == []
