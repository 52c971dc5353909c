"""SQS while its side store answers reads but refuses writes (a PostgreSQL server turned read-only in a
failover): a receive counts against its messages' attempts whether they run or not, so the provider
asks SQS again only once the store takes a write. Before, every poll received the backlog again and
failed on its lease write: an outage of a few leases' length dead-lettered it unrun (found in review).

Real PostgreSQL refuses the writes, two ways: every transaction of the provider's side store made READ
ONLY (the server answers as a read-only server does), and a trigger refusing each lease row as a full
disk does; the queues are moto's."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import POSTGRES_URL, drop_schema, fresh_prefix, require


@queue("ReadOnly.Orders", max_attempts=3, lease_duration=timedelta(seconds=1))
class Order(QueueMessage):
    n: int


class ReadOnlyServer:
    """Every transaction of the provider's side store made READ ONLY: the server refuses each statement
    that writes, as a server turned read-only in a failover does."""

    def __init__(self, engine: AsyncEngine, schema: str) -> None:
        self.engine, self.on = engine.sync_engine, False
        event.listen(self.engine, "begin", self._begin)

    def _begin(self, conn: Any) -> None:
        if self.on:
            conn.exec_driver_sql("SET TRANSACTION READ ONLY")

    async def start(self) -> None:
        self.on = True

    async def end(self) -> None:
        self.on = False


class FullDisk:
    """The server takes statements but no lease row: a trigger answers each row written to the leases
    table as a full disk does (SQLSTATE 53100), while a statement that writes no row passes (found in
    review: a probe that wrote none let every poll receive again)."""

    def __init__(self, engine: AsyncEngine, schema: str) -> None:
        self.engine, self.schema = engine, schema

    async def start(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    f"CREATE FUNCTION {self.schema}.no_space() RETURNS trigger LANGUAGE plpgsql AS $$ "
                    "BEGIN RAISE EXCEPTION 'could not extend file: No space left on device' "
                    "USING ERRCODE = 'disk_full'; END $$"
                )
            )
            await conn.execute(
                sa.text(
                    f"CREATE TRIGGER no_space BEFORE INSERT OR UPDATE ON {self.schema}.queueing_leases "
                    f"FOR EACH ROW EXECUTE FUNCTION {self.schema}.no_space()"
                )
            )

    async def end(self) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.text(f"DROP TRIGGER no_space ON {self.schema}.queueing_leases"))


@pytest.mark.parametrize("outage", [ReadOnlyServer, FullDisk])
async def test_a_side_store_refusing_writes_spends_no_more_than_one_receive_of_a_message(outage: Any) -> None:
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qro_{uuid.uuid4().hex[:10]}"
    app = QueueingApp("sqsro", naming=QueueNaming(prefix=fresh_prefix()))
    runs: list[int] = []

    @app.handler(Order, max_concurrency=8)
    async def handle(msg: Order) -> None:
        runs.append(msg.n)

    provider = SqsProvider(sqs_client(), stores=SideStores(POSTGRES_URL, schema=schema), receive_wait=0)
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    refused: list[str] = []
    try:
        ids = [(await app.enqueue(Order(n=i))).message_id for i in range(5)]
        engine = provider.stores.sql.engine

        def note_refusal(context: Any) -> None:
            refused.append(type(context.original_exception).__name__)

        event.listen(engine.sync_engine, "handle_error", note_refusal)
        made = outage(engine, schema)
        await made.start()
        async with running(rt):
            await asyncio.sleep(8)  # eight leases' length: each poll received the backlog again before
            assert refused, "the store refused no write: the outage was not made"
            await made.end()
            await wait_until(lambda: _ran(runs, 5), what="every message ran once the store took writes")
        sqs = sqs_client()
        for dead in (False, True):
            url = await provider._url("ReadOnly.Orders", dead=dead)
            attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
            assert attrs["ApproximateNumberOfMessages"] == "0", (dead, attrs)
            assert attrs["ApproximateNumberOfMessagesNotVisible"] == "0", (dead, attrs)
        assert sorted(runs) == [0, 1, 2, 3, 4]
        for mid in ids:
            rec = await rt.tracker.get(mid)
            assert rec is not None
            # one receive spent in the outage at most (the one whose lease write failed), then the run
            assert (rec.status, rec.attempt <= 2) == ("Succeeded", True), rec
    finally:
        await rt.close()
        await drop_schema(schema)


async def _ran(runs: list[int], n: int) -> bool:
    return len(runs) >= n
