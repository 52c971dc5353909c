"""The delayed store judges due times and leases on the database's clock, and a dispatcher renews the
lease of the rows it is still forwarding. SQLite and PostgreSQL.

Found by a review: each host judged due times and leases on its own clock. A dispatcher whose clock
ran ahead by more than the few seconds a worker holds an early delivery forwarded a message early,
the worker sent it back as not due yet, and the dispatcher forwarded it again at once, hundreds of
times; a host whose clock ran behind by more than the lease wrote leases the others read as over and
forwarded the same rows beside it; a purging host whose clock ran ahead took rows being forwarded. And
a forward that outlasted the 60 s lease (a transport's SDK retrying) was fetched again and taken by a
purge by status (reported gone, its history deleted), then landed and ran. Host clocks are stood in
for by clocks off the real one by a fixed amount; the database's is the real one here."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa

from queueing_core.clock import utcnow
from queueing_core.naming import Transport
from queueing_core.providers.delayed import DelayedDispatcher, SqlDelayedStore
from queueing_core.providers.sql.db_clock import DatabaseClock
from queueing_core.providers.sql.history import SideStores
from queueing_core.tracking.base import record_from_envelope
from tests.contract.harness import wait_until
from tests.envelopes import an_envelope
from tests.services import POSTGRES_URL, drop_schema, require
from tests.slow_forward import Slow


@dataclass
class Hosts:
    """Side stores on one database, one per host, each with its own clock."""

    url: str
    schema: str | None
    made: list[SideStores] = field(default_factory=list)

    def host(self, off: timedelta = timedelta(0)) -> SideStores:
        s = SideStores(self.url, schema=self.schema, clock=off_by(off))
        self.made.append(s)
        return s

    def store(self, off: timedelta = timedelta(0)) -> SqlDelayedStore:
        return self.host(off).delayed_store(Transport.RABBITMQ)


def off_by(off: timedelta) -> DatabaseClock:
    """A host's clock ``off`` from the real one, corrected by the database's as a host's own clock is
    (a plain callable is a test's clock, used as it is)."""
    return DatabaseClock(lambda: utcnow() + off)


@pytest.fixture(params=["sqlite", "postgres"])
async def hosts(request, tmp_path) -> AsyncIterator[Hosts]:
    if request.param == "sqlite":
        h = Hosts(f"sqlite:///{tmp_path}/side.db", None)
    else:
        require("PostgreSQL", "127.0.0.1", 5432)
        h = Hosts(POSTGRES_URL, f"qdc_{uuid.uuid4().hex[:10]}")
    yield h
    for s in h.made:
        await s.close()
    if h.schema is not None:
        await drop_schema(h.schema)


async def due_at(store: SqlDelayedStore, message_id: uuid.UUID) -> datetime:
    t = store.sql.tables.delayed
    async with store.sql.engine.connect() as conn:
        value = (await conn.execute(sa.select(t.c.due_at).where(t.c.message_id == message_id))).scalar_one()
    return value if value.tzinfo is not None else value.replace(tzinfo=utcnow().tzinfo)


async def test_a_dispatcher_whose_clock_is_ahead_does_not_forward_early(hosts):
    on_time, ahead = hosts.store(), hosts.store(timedelta(seconds=20))
    await on_time.store(an_envelope(), "jobs", utcnow() + timedelta(seconds=10))
    # on its own clock it was due 10 s ago: forwarded 10 s early, sent back by the worker, forwarded...
    assert await ahead.fetch_due() == []
    assert await on_time.fetch_due() == []


async def test_a_lease_written_by_a_host_whose_clock_is_behind_holds_for_the_others(hosts):
    behind, on_time = hosts.store(-timedelta(seconds=90)), hosts.store()
    await on_time.store(an_envelope(), "jobs", utcnow() - timedelta(seconds=100))
    assert len(await behind.fetch_due()) == 1
    # its lease (60 s) is the database's: not over for a host on time, which would forward it beside it
    assert await on_time.fetch_due() == []


async def test_a_host_whose_clock_is_behind_stores_until_its_own_clock_says_due(hosts):
    """A worker whose clock runs behind sends a delivery back as not due yet, due by its clock: stored
    at that time on the database's, a dispatcher on time found it due and forwarded it straight back."""
    behind, on_time = hosts.store(-timedelta(seconds=20)), hosts.store()
    await behind.store(an_envelope(), "jobs", behind.clock() + timedelta(seconds=10))
    assert await on_time.fetch_due() == []
    assert await on_time.next_due() > utcnow() + timedelta(seconds=5)


async def test_a_purge_from_a_host_whose_clock_is_ahead_leaves_a_row_being_forwarded(hosts):
    dispatching = hosts.host()
    store = dispatching.delayed_store(Transport.RABBITMQ)
    purger = hosts.store(timedelta(seconds=61))  # beyond the 60 s lease
    now = utcnow()
    env = an_envelope(created_at=now)
    await store.store(env, "jobs", now - timedelta(seconds=1))
    await dispatching.history.upsert([record_from_envelope(env, "Pending", now)])
    assert len(await store.fetch_due()) == 1  # its forward under way
    done = await purger.purge("jobs", [env.message_id], history_while=("Pending",))
    assert done.gone == set()
    assert done.left == {env.message_id}
    assert await dispatching.history.get(env.message_id) is not None


async def test_a_forward_that_outlasts_the_lease_keeps_its_row(hosts):
    """The dispatcher renews the lease while the forward is under way: no other dispatcher fetches
    the row, and a purge by status leaves it (counted as left, its history kept), for it lands."""
    dispatching = hosts.host()
    store = SqlDelayedStore(dispatching.sql, Transport.RABBITMQ, lease=timedelta(seconds=3))
    other = hosts.store()
    now = utcnow()
    env = an_envelope(created_at=now)
    await store.store(env, "jobs", now - timedelta(seconds=1))
    await dispatching.history.upsert([record_from_envelope(env, "Pending", now)])
    target = Slow()
    forwarding = asyncio.create_task(DelayedDispatcher(store, target, listen=False).dispatch_once())
    try:
        await asyncio.wait_for(target.entered.wait(), 30)
        first_lease = await due_at(store, env.message_id)
        # the forward is still under way when the lease it was fetched with has ended
        await wait_until(lambda: utcnow() > first_lease + timedelta(milliseconds=200), what="the lease's end")
        assert await due_at(store, env.message_id) > first_lease  # renewed
        assert await other.fetch_due() == []  # not forwarded a second time beside it
        done = await other.purge("jobs", [env.message_id], history_while=("Pending",))
    finally:
        target.go.set()
        await forwarding
    assert target.landed == [env.message_id]  # it landed: the message runs
    assert done.gone == set()
    assert done.left == {env.message_id}
    assert await dispatching.history.get(env.message_id) is not None
    assert await store.counts() == {}  # removed once its forward was accepted


async def test_a_renewal_leaves_a_row_given_back_or_fetched_again(hosts):
    store = hosts.store()
    now = utcnow()
    given_back, fetched_again = an_envelope(), an_envelope()
    a = await store.store(given_back, "jobs", now - timedelta(seconds=2))
    b = await store.store(fetched_again, "jobs", now - timedelta(seconds=1))
    first = await store.fetch_due()
    assert [i.id for i in first] == [a, b]
    held_until = first[0].leased_until
    assert held_until is not None
    retry_at = utcnow() + timedelta(seconds=5)
    assert await store.release(a, retry_at)  # its forward failed: due again after the back-off
    assert await store.release(b, utcnow() - timedelta(seconds=1))  # its lease ended, say
    [again] = await store.fetch_due()  # and another dispatcher took it
    renewed, _ = await store.renew([a, b], held_until)
    assert renewed == set()
    assert abs(await due_at(store, given_back.message_id) - retry_at) < timedelta(milliseconds=1)
    assert again.leased_until is not None
    assert abs(await due_at(store, fetched_again.message_id) - again.leased_until) < timedelta(milliseconds=1)


async def test_a_tests_own_clock_travels_in_time_uncorrected(hosts):
    """A plain callable is a test's clock, as for the SQL provider's leases: moved two hours ahead,
    what it stores comes due by it (corrected by the database's, nothing came due for two hours)."""
    now = [utcnow() + timedelta(hours=2)]
    s = SideStores(hosts.url, schema=hosts.schema, clock=lambda: now[0])
    hosts.made.append(s)
    store = s.delayed_store(Transport.RABBITMQ)
    await store.store(an_envelope(), "jobs", now[0] + timedelta(seconds=30))
    assert await store.fetch_due() == []
    now[0] += timedelta(seconds=31)
    assert len(await store.fetch_due()) == 1
