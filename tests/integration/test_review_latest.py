"""Review of the latest changes (bounded purge, SQL purge batches, the functionTimeout check): each
test here fails on the code as reviewed and names the defect it proves."""

from __future__ import annotations

import asyncio
import json

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.ops import OpsService
from queueing_core.providers.sql.retention import RetentionPolicy
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import HARNESSES
from tests.faults.test_regressions import Letter, Letters  # noqa: F401  (Letter registers the queue)

BROKERS = ["servicebus", "storage_queue", "rabbitmq", "sqs"]


@pytest.fixture(params=BROKERS)
async def broker(request):
    name = request.param
    make = HARNESSES[name]
    h = make(request.getfixturevalue("azurite")) if name in ("storage_queue", "servicebus") else make()
    yield h
    if h.cleanup is not None:
        await h.cleanup()


# -- 1. purge_all stops while removable matches remain -------------------------------------------------


async def test_purge_all_reaches_dead_letters_behind_a_full_page_of_queued_messages(broker, monkeypatch):
    """A purge of dead letters *and* waiting messages (the query of the fault suite's own purge test):
    the transport cannot pick a waiting message out of a live queue, so those stay, history and all.
    When more of them than one purge takes are newer than the dead letters, every call reads the same
    first PURGE_LIMIT records, removes nothing, and purge_all stops after the second call, answering
    more=False while every dead letter is still there. Before the bound one purge removed them all."""
    from queueing_core.ops import service as ops_service

    monkeypatch.setattr(ops_service, "PURGE_LIMIT", 40)
    letters = await Letters(broker).open()
    try:
        dead = await letters.dead_letter([f"d{i}" for i in range(5)])
        for i in range(45):  # newer than the dead letters, no worker runs: they wait in the queue
            await letters.app.enqueue(Letter(key=f"w{i}"))
        query = MessageQuery(queue="letters", status=("DeadLettered", "Pending"))
        done = await letters.ops.purge_all(query)
        left = (await letters.places())["dead"]
        assert left == 0, f"purge_all answered {done!r} with {left} matching dead letters left"
        assert all([await letters.rt.tracker.get(i) is None for i in dead])
    finally:
        await letters.rt.close()


# -- 2. one bounded purge of a whole queue ----------------------------------------------------------


@pytest.mark.parametrize("broker", ["servicebus", "rabbitmq"], indirect=True)
async def test_a_whole_queue_purge_leaves_no_history_of_messages_it_removed(broker, monkeypatch):
    """The whole-queue fast path empties the queue in one go, whatever the bound, but only the first
    PURGE_LIMIT records' history goes: the rest stay Pending in the history for messages the transport
    no longer holds (until someone purges again; the HTTP API and dashboard call purge once)."""
    from queueing_core.ops import service as ops_service

    monkeypatch.setattr(ops_service, "PURGE_LIMIT", 40)
    letters = await Letters(broker).open()
    try:
        ids = [(await letters.app.enqueue(Letter(key=f"w{i}"))).message_id for i in range(50)]
        done = await letters.ops.purge(MessageQuery(queue="letters"))
        assert (await letters.places())["queue"] == 0  # the transport holds none of them now
        phantoms = [i for i in ids if await letters.rt.tracker.get(i) is not None]
        assert phantoms == [], (
            f"{len(phantoms)} records still say Pending for messages the queue no longer holds ({done!r})"
        )
    finally:
        await letters.rt.close()


# -- 3. the SQL batch purge stops at a short batch ------------------------------------------------------


@queue("review_purge")
class Chore(QueueMessage):
    n: int


async def test_a_sql_purge_does_not_stop_at_a_batch_shortened_by_a_claim(pg_db):
    """PostgreSQL: a worker claims a row of the purge's first batch while the purge waits for it; the
    recheck (4233828) rightly leaves that row, but the batch then deletes fewer than its size and the
    loop takes that as the end: every row after the first batch stays, and the answer says no more."""
    from tests.contract.harness import wait_until

    from .pg_locks import waiting_for_a_lock

    app = QueueingApp("review-purge")
    app.message(Chore)
    prov = pg_db.provider(retention=RetentionPolicy(batch=4))
    rt = Runtime(app, prov)
    await rt.open()
    sent = await app.enqueue_many([Chore(n=i) for i in range(12)])
    claimed = sent[0]
    m = prov.tables.messages
    async with prov.engine.connect() as conn:
        claim = await conn.begin()
        await conn.execute(
            sa.update(m).where(m.c.message_id == claimed.message_id).values(status="Leased", locked_by="w")
        )
        purge = asyncio.create_task(OpsService(rt).purge(MessageQuery(queue="review_purge")))
        await wait_until(lambda: waiting_for_a_lock(prov, f"{pg_db.schema}.queueing_messages"), what="wait")
        await claim.commit()
    done = await purge
    async with prov.engine.connect() as conn:
        left = set((await conn.execute(sa.select(m.c.message_id))).scalars())
    try:
        assert left == {claimed.message_id}, (
            f"{len(left) - 1} unclaimed matching rows left by a purge that answered {done!r}"
        )
        assert (done.deleted, done.skipped_leased) == (11, 1)
    finally:
        await rt.close()


# -- 4. the functionTimeout check reads host.json alone ---------------------------------------------


def _sql_settings(budget: float):
    from queueing_core.settings import QueueingSettings

    return QueueingSettings(provider="sql", database_url="postgresql://h/db", functions_processor_budget=budget)


def test_an_app_setting_that_overrides_function_timeout_is_honoured(tmp_path):
    """Azure Functions lets an app setting override any host.json value
    (AzureFunctionsJobHost__functionTimeout). With the timeout raised to an hour that way, a 20-minute
    budget is right, but indexing fails on host.json's 10 minutes: the app finds no functions."""
    from functions import build_app

    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0", "functionTimeout": "00:10:00"}))
    env = {"AzureWebJobsScriptRoot": str(tmp_path), "AzureFunctionsJobHost__functionTimeout": "01:00:00"}
    build_app(_sql_settings(1200), env=env)


def test_a_host_json_without_function_timeout_is_held_to_the_plans_default(tmp_path):
    """No functionTimeout in host.json does not mean unbounded: the plan's default applies (5 minutes
    on Consumption, 30 on Flex Consumption, Premium and Dedicated). A budget of an hour passes the
    check and is then cut short by the host mid-settlement, as the commit meant to prevent."""
    from functions import build_app
    from queueing_core.errors import ConfigurationError

    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0"}))
    with pytest.raises(ConfigurationError, match="PROCESSOR_BUDGET"):
        build_app(_sql_settings(3600), env={"AzureWebJobsScriptRoot": str(tmp_path)})


