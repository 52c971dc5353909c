"""A purge names a queue of the app. Off SQL a whole queue's purge empties the broker's queue of that
name and its dead-letter queue: asked for a queue the app does not have, it created them (SQS with
auto-create, RabbitMQ's declare), or set another application's queue of that name up as its own and
emptied it (same account and deployment prefix), and answered as a normal purge (found in review). On
SQL a queue the app no longer has may still have rows: those are only rows, and a purge may take them."""

from __future__ import annotations

import pytest

from queueing_core import QueueMessage, queue
from tests.contract.harness import ops_client

SQL = ("sqlite", "postgres")


@queue("purge_named")
class Kept(QueueMessage):
    n: int


@queue("purge_retired")
class Retired(QueueMessage):
    n: int


@pytest.mark.parametrize(
    "params",
    [{"queue": "purge_elsewhere", "all": "true"}, {"queue": "purge_elsewhere", "status": "Pending"}],
    ids=["whole-queue", "by-status"],
)
async def test_a_purge_of_a_queue_the_app_does_not_have_is_refused(harness, params):
    app = harness.app()

    @app.handler()
    async def handle(msg: Kept) -> None:
        return None

    rt = await harness.runtime(app)
    try:
        await app.enqueue(Kept(n=1))
        async with ops_client(rt) as client:
            res = await client.delete("/messages", params=params)
            assert res.status_code == 404, res.text
            assert "purge_elsewhere" in res.json()["detail"]
            kept = await client.get("/messages", params={"queue": "purge_named"})
        assert len(kept.json()["items"]) == 1  # nothing of the app's own was touched
    finally:
        await rt.close()


async def test_on_sql_a_purge_takes_the_rows_of_a_queue_the_app_no_longer_has(harness):
    if harness.name not in SQL:
        pytest.skip("only SQL keeps a removed queue's messages as rows of its own table")
    before = harness.app()

    @before.handler()
    async def old(msg: Retired) -> None:
        return None

    rt = await harness.runtime(before)
    try:
        await before.enqueue(Retired(n=1))
    finally:
        await rt.close()
    after = harness.app()  # the same database, a release without that queue

    @after.handler()
    async def handle(msg: Kept) -> None:
        return None

    rt = await harness.runtime(after)
    try:
        async with ops_client(rt) as client:
            res = await client.delete("/messages", params={"queue": "purge_retired", "all": "true"})
        assert res.status_code == 200, res.text
        assert res.json()["deleted"] == 1
    finally:
        await rt.close()
