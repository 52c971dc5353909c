"""Retention never deletes or archives a message that an operator's retry took back while retention
waited for the row (PostgreSQL). A batch is chosen by a subquery that does not lock its rows; the
statement then waits for any row another transaction holds, and PostgreSQL checks only the statement's
own WHERE against the row's new version. So the WHERE says the row's conditions again: a row retried
meanwhile (Pending now, no longer settled) is left to run."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import RetentionPolicy
from queueing_core.providers.sql.maintenance import retain
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until

from .pg_locks import waiting_for_a_lock


@queue("race_archived")
class Archived(QueueMessage):
    n: int


@queue("race_kept", keep_processed_for=timedelta(hours=1))
class Kept(QueueMessage):
    n: int


@pytest.mark.parametrize("kind", [Archived, Kept], ids=["archive", "keep_processed_for"])
async def test_a_message_retried_while_retention_waited_for_it_is_left_to_run(pg_db, kind):
    app = QueueingApp("race")
    app.handler(kind)(lambda msg: None)
    prov = pg_db.provider(
        retention=RetentionPolicy(archive_after=timedelta(hours=1), delete_archived_after=None)
    )
    rt = Runtime(app, prov)
    retried, other = await app.enqueue_many([kind(n=1), kind(n=2)])
    async with running(rt):
        for sent in (retried, other):
            await wait_until(lambda s=sent: _succeeded(prov, s.message_id), what="both messages succeeded")
    m = prov.tables.messages
    later = prov.clock() + timedelta(hours=2)  # both are past the archive's and their queue's age
    # the operator's retry (the statement the ops API runs), not yet committed when retention starts
    async with prov.engine.connect() as operator:
        await operator.begin()
        took = await operator.execute(
            sa.update(m)
            .where(m.c.message_id == retried.message_id, m.c.status == "Succeeded")
            .values(status="Pending", attempt=0, settled_at=None, available_at=prov.clock())
        )
        assert took.rowcount == 1
        upkeep = asyncio.create_task(retain(prov, app, later))
        await wait_until(
            lambda: waiting_for_a_lock(prov, f"{pg_db.schema}.queueing_messages"),
            what="retention waiting for the row",
        )
        await operator.commit()
    done = await asyncio.wait_for(upkeep, 10)
    record = await prov.tracker().get(retried.message_id)
    assert record is not None, "the retried message was deleted"
    assert record.status == "Pending"
    assert not record.archived, "the retried message was archived: it would never run"
    # and retention did its work on the other one
    gone_or_archived = await prov.tracker().get(other.message_id)
    if kind is Kept:
        assert done["deleted_processed"] == 1
        assert gone_or_archived is None
    else:
        assert done["archived"] == 1
        assert gone_or_archived is not None
        assert gone_or_archived.archived
    # the retried message runs again
    async with running(rt):
        await wait_until(lambda: _succeeded(prov, retried.message_id), what="the retried message ran")


async def _succeeded(prov, message_id) -> bool:
    record = await prov.tracker().get(message_id)
    return record is not None and record.status == "Succeeded"
