"""A stale run of a SQL row never wins over the live one, on SQLite and PostgreSQL (found in review).

The fence of every settlement and renewal is (row id, lease token, worker, Leased). Two ways a stale
run of a row slipped through it:

- A claim's token was the row's token plus one. A claim whose commit is lost (a relaxed claim,
  ``synchronous_commit=off``, in a database crash; any claim in a failover to an asynchronous
  standby) leaves the row at its old token, and the same worker's next claim of it then got the very
  token of the lost one: the lost claim's run, still going, and the live run held one lease, and the
  stale run's retry or dead letter was recorded while the live run's success was refused. A claim now
  moves the token by a random step: it always changes, and two claims from one stored token share a
  token only by a one in 2**31 chance.
- A batch of successes and a renewal matched the rows the statement returned by id alone. One
  process holding two runs of a row (an operator's release, a sweep, or the lost claim above) sent
  both in one batch: the row was settled (or renewed) once, under the live run's token, and the stale
  run was reported settled (renewed) too. The statements now return (id, token), and each delivery's
  lease is looked for among those pairs.

Each store runs on the kit's hot path (psycopg / ``sqlite3``) and SQLite also on SQLAlchemy's (a
caller's engine); PostgreSQL with durable claims and with relaxed ones.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import DeadLetterReason, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete, DeadLetter, RetryAfter
from queueing_core.ops import OpsService
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from tests.services import POSTGRES_URL, drop_schema, require

#: the INTEGER column's tokens (``statements.TOKENS``)
TOKENS = 2**31 - 1


@queue("stale-claim-fence", lease_duration=timedelta(seconds=30), max_attempts=5)
class Job(QueueMessage):
    n: int = 0


@queue("stale-claim-fence-ordered", lease_duration=timedelta(seconds=30), max_attempts=5, ordered=True)
class InLine(QueueMessage):
    n: int = 0


@dataclass
class Store:
    name: str
    app: QueueingApp
    rt: Runtime
    prov: SqlProvider


@pytest.fixture(params=["sqlite", "sqlite-sqlalchemy", "postgres", "postgres-relaxed"])
async def store(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Store]:
    kind: str = request.param
    schema: str | None = None
    engine = None
    # one process, one worker id: the stale and the live run are the same worker's
    kw: dict[str, Any] = {"listen": False, "worker_id": "the-only-worker"}
    if kind.startswith("postgres"):
        require("PostgreSQL", "127.0.0.1", 5432)
        schema = f"qi_{uuid.uuid4().hex[:10]}"
        relaxed = kind == "postgres-relaxed"
        # (the combined settle-and-claim needs durable claims: offered on the durable store only)
        prov = SqlProvider(
            POSTGRES_URL, schema=schema, durable_claims=not relaxed, settle_with_claims=not relaxed, **kw
        )
    elif kind == "sqlite":
        prov = SqlProvider(f"sqlite:///{tmp_path}/q.db", settle_with_claims=True, **kw)
    else:
        from sqlalchemy.ext.asyncio import create_async_engine

        url = f"sqlite:///{tmp_path}/q.db"
        engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/q.db")
        prov = SqlProvider(url, engine=engine, **kw)
    app = QueueingApp(f"stale-claim-{kind}")
    app.handler(Job)(lambda msg: None)
    app.handler(InLine)(lambda msg: None)
    rt = Runtime(app, prov)
    await rt.open()
    # the hot path where the kit's own engine runs it; SQLAlchemy's on a caller's SQLite engine
    assert (prov._hot is None) == (kind == "sqlite-sqlalchemy")
    try:
        yield Store(kind, app, rt, prov)
    finally:
        await rt.close()
        if engine is not None:
            await engine.dispose()
        if schema is not None:
            await drop_schema(schema)


#: what a claim writes on its rows: what a claim whose commit was lost leaves as it was before
CLAIMED = ("status", "locked_by", "locked_until", "lease_token", "updated_at")


async def _row(prov: SqlProvider, message_id: uuid.UUID) -> Any:
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        return (await conn.execute(sa.select(m).where(m.c.message_id == message_id))).one()


async def _claim_lost(prov: SqlProvider, message_id: uuid.UUID, before: Any) -> None:
    """The row as a database that lost the claim's commit (a crash, a failover) has it: as it was
    before the claim, its lease token included. The run the claim started goes on all the same."""
    m = prov.tables.messages
    async with prov.engine.begin() as conn:
        await conn.execute(
            sa.update(m)
            .where(m.c.message_id == message_id)
            .values(**{c: getattr(before, c) for c in CLAIMED})
        )


async def _one(s: Store, type_name: str = "Job") -> Delivery:
    [d] = await s.prov.receive(s.app.subscription(type_name), 10)
    return d


@pytest.mark.parametrize("type_name", ["Job", "InLine"])
async def test_a_claim_whose_commit_was_lost_never_shares_its_lease_with_the_next_claim(
    store: Store, type_name: str
) -> None:
    """The same worker claims the row again after its claim's commit was lost: the two runs hold
    different leases, the stale run's retry and dead letter are refused, the live run's success is
    recorded. (An ordered queue's claim of its head writes the token as the batch claim does.)"""
    s, prov = store, store.prov
    sent = await s.app.enqueue(Job(n=1) if type_name == "Job" else InLine(n=1))
    before = await _row(prov, sent.message_id)
    stale = await _one(s, type_name)
    await _claim_lost(prov, sent.message_id, before)
    live = await _one(s, type_name)
    assert live.envelope.message_id == stale.envelope.message_id == sent.message_id
    assert live.handle.row == stale.handle.row
    assert live.handle != stale.handle, "the lost claim's run and the live run hold one lease"
    assert (await _row(prov, sent.message_id)).lease_token == live.handle.token

    assert await prov.renew([stale]) == [stale]  # the stale run's lease is lost...
    await prov.settle([Settlement(stale, RetryAfter(timedelta(minutes=5), "the stale run failed"))])
    assert stale.refused  # ...its failure is not recorded...
    stale.refused = False
    await prov.settle([Settlement(stale, DeadLetter(DeadLetterReason.NON_RETRYABLE, "the stale run"))])
    assert stale.refused  # ...nor its dead letter
    row = await _row(prov, sent.message_id)
    assert (row.status, row.lease_token, row.attempt) == ("Leased", live.handle.token, before.attempt)

    assert await prov.renew([live]) == []
    await prov.settle([Settlement(live, Complete())])
    assert not live.refused, "the live run's success was refused"
    assert (await _row(prov, sent.message_id)).status == "Succeeded"


async def test_every_claim_takes_a_token_no_other_claim_of_the_row_took(store: Store) -> None:
    """Claims of one row from the same stored token (each one's commit lost) and claims in turn
    (each lease given back by an operator) all take tokens of their own: the token always changes,
    stays in the column's range, and is no count of the claims."""
    s, prov = store, store.prov
    sent = await s.app.enqueue(Job(n=2))
    before = await _row(prov, sent.message_id)
    lost = []
    for _ in range(20):
        d = await _one(s)
        lost.append(d.handle.token)
        await _claim_lost(prov, sent.message_id, before)
    assert before.lease_token not in lost
    assert len(set(lost)) == len(lost), f"two lost claims from one stored token shared a token: {lost}"

    ops = OpsService(s.rt)
    tokens = [before.lease_token]
    for _ in range(10):
        d = await _one(s)
        assert d.handle.token != tokens[-1]
        tokens.append(d.handle.token)
        await ops.release_lease(sent.message_id)
    assert all(0 <= t < TOKENS for t in [*lost, *tokens])
    # (a counter would give 1, 2, 3, ...: nothing may read a token as the claims' count)
    assert tokens[1:] != list(range(before.lease_token + 1, before.lease_token + 11))


async def _stale_and_live(s: Store, n: int) -> tuple[Delivery, Delivery]:
    """Two runs of one row in one process: the first's lease released by an operator (it runs on),
    the row claimed again by the same worker."""
    sent = await s.app.enqueue(Job(n=n))
    old = await _one(s)
    await OpsService(s.rt).release_lease(sent.message_id)
    new = await _one(s)
    assert new.handle.row == old.handle.row
    assert new.handle != old.handle
    return old, new


async def test_a_stale_and_a_live_run_of_one_row_settled_in_one_batch(store: Store) -> None:
    """Both runs' successes (and another message's) in one batch: the row is settled once, by the live
    run; the stale run is refused, not reported settled."""
    s, prov = store, store.prov
    old, new = await _stale_and_live(s, 3)
    await s.app.enqueue(Job(n=4))
    other = await _one(s)
    await prov.settle([Settlement(d, Complete()) for d in (old, new, other)])
    assert (old.refused, new.refused, other.refused) == (True, False, False)
    row = await _row(prov, new.envelope.message_id)
    assert (row.status, row.attempt) == ("Succeeded", 1)  # (one attempt counted: one settlement)
    # the other order in the batch, the same answer
    old, new = await _stale_and_live(s, 5)
    await prov.settle([Settlement(new, Complete()), Settlement(old, Complete())])
    assert (old.refused, new.refused) == (True, False)


async def test_a_stale_and_a_live_run_of_one_row_settled_with_the_next_claim(store: Store) -> None:
    """The same batch settled in the call that claims the next one (``settle_and_receive``)."""
    s, prov = store, store.prov
    if not prov.settles_with_claims():
        pytest.skip("this store does not settle with claims (relaxed claims, or SQLAlchemy's path)")
    old, new = await _stale_and_live(s, 6)
    await prov.settle_and_receive(
        [Settlement(old, Complete()), Settlement(new, Complete())], s.app.subscription("Job"), 10
    )
    assert (old.refused, new.refused) == (True, False)
    assert (await _row(prov, new.envelope.message_id)).status == "Succeeded"


async def test_a_stale_and_a_live_run_of_one_row_renewed_together(store: Store) -> None:
    """Both runs' leases in one renewal: the row's lease is renewed for the live run; the stale run's
    is reported lost (its worker stops counting on it), and its lease's end is not moved."""
    s, prov = store, store.prov
    old, new = await _stale_and_live(s, 7)
    old_until, new_until = old.lease_until, new.lease_until
    assert await prov.renew([old, new]) == [old]
    assert old.lease_until == old_until
    assert new.lease_until is not None
    assert new_until is not None
    assert new.lease_until >= new_until
    assert await prov.renew([new, old]) == [old]  # (in either order)
    await prov.settle([Settlement(new, Complete())])
    assert not new.refused
