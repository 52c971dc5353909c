"""SQS, on moto's server: two deliveries of one message in the same ``settle()`` (or ``renew()``) call.

SQS hands a message out again once its visibility timeout runs out (and, rarely, twice at once): the
earlier delivery is then stale, and only the later one may settle or renew the message. The side
store's lease token fences them, and the two share the message's key. Found in review: the store
answered with the keys still held, so the stale delivery passed beside the live one in one batch; its
dead letter or retry copy was sent, its outcome recorded (history DeadLettered, a letter in the
dead-letter queue, though the live run succeeded), and its visibility extended with the live one's.

Both side-store databases (the lease store runs on either), so the tokens read back from each compare
equal to the ones in memory.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, Decision, RetryAfter
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from tests.contract.harness import wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import POSTGRES_URL, drop_schema, fresh_prefix, require


@queue("Fence.Twice", lease_duration=timedelta(minutes=2))
class Twice(QueueMessage):
    n: int


@dataclass
class Twins:
    """One message delivered twice: ``stale`` first, its visibility ended; then ``live``."""

    app: QueueingApp
    rt: Runtime
    prov: SqsProvider
    message_id: uuid.UUID
    stale: Delivery
    live: Delivery


@pytest.fixture(params=["sqlite", "postgres"])
async def twins(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Twins]:
    prefix = fresh_prefix()
    schema = None
    if request.param == "sqlite":
        stores = SideStores(f"sqlite:///{tmp_path}/{prefix}side.db")
    else:
        require("PostgreSQL", "127.0.0.1", 5432)
        schema = f"sqstwins_{uuid.uuid4().hex[:10]}"
        stores = SideStores(POSTGRES_URL, schema=schema)
    app = QueueingApp("sqstwins", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def handle(msg: Twice) -> None:
        pass

    prov = SqsProvider(sqs_client(), stores=stores, receive_wait=0)
    rt = Runtime(app, prov)
    await rt.open()
    urls = [await prov._url("Fence.Twice", dead=dead) for dead in (False, True)]
    try:
        message_id = (await app.enqueue(Twice(n=1))).message_id
        sub = app.subscription("Twice")
        assert sub is not None
        [stale] = await prov.receive(sub, 1)
        # its visibility ends now rather than after the lease (as a stalled run's does): SQS hands the
        # message out again, and this delivery is stale
        sqs_client().change_message_visibility(
            QueueUrl=urls[0], ReceiptHandle=stale.handle.receipt, VisibilityTimeout=0
        )
        got: list[Delivery] = []

        async def received_again() -> bool:
            got.extend(await prov.receive(sub, 1))
            return bool(got)

        await wait_until(received_again, timeout=15, what="the second delivery")
        [live] = got
        assert stale.handle.lease.key == live.handle.lease.key
        assert stale.handle.lease.token < live.handle.lease.token
        yield Twins(app, rt, prov, message_id, stale, live)
    finally:
        await rt.close()
        client = sqs_client()
        for url in urls:
            client.delete_queue(QueueUrl=url)
        if schema is not None:
            await drop_schema(schema)


@pytest.mark.parametrize(
    "stale_decision",
    [
        DeadLetter(DeadLetterReason.NON_RETRYABLE, "the stale run gave up"),
        RetryAfter(timedelta(0), "the stale run failed"),
    ],
    ids=["dead-letter", "retry"],
)
async def test_the_stale_delivery_is_refused_beside_the_live_one_in_one_settlement(
    twins: Twins, stale_decision: Decision
) -> None:
    rt, prov = twins.rt, twins.prov
    batch = [Settlement(twins.stale, stale_decision), Settlement(twins.live, Complete())]
    # as the worker's settler does: history journaled ahead, the transport settled, then recorded
    ahead = rt.history_ahead(batch)
    await prov.settle(batch)
    rt.history_applied(batch, ahead)
    await rt.record(batch, ahead)
    assert twins.stale.refused, "the stale delivery settled beside the live one"
    assert not twins.live.refused, "the live delivery was refused"
    depth = await prov.depth("Fence.Twice")
    assert depth["ready"] + depth["in_flight"] + depth["delayed"] == 0, "a copy or the original is left"
    dead = await prov.depth("Fence.Twice", dead=True)
    assert dead["ready"] + dead["in_flight"] + dead["delayed"] == 0, "the stale run's dead letter was sent"
    rec = await rt.tracker.get(twins.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED


async def test_renewing_both_deliveries_in_one_call_extends_only_the_live_one(twins: Twins) -> None:
    prov = twins.prov
    renewed: list[str] = []
    real_call = prov._call

    async def noting_renewals(action: str, fn: Any, **kwargs: Any) -> Any:
        if action == "renewing leases":
            renewed.extend(e["ReceiptHandle"] for e in kwargs["Entries"])
        return await real_call(action, fn, **kwargs)

    prov._call = noting_renewals  # type: ignore[method-assign]
    lost = await prov.renew([twins.stale, twins.live])
    assert renewed == [twins.live.handle.receipt], "the stale delivery's visibility was changed too"
    assert lost == [twins.stale]
    assert await prov.leases.holding([twins.stale.handle.lease, twins.live.handle.lease]) == {
        twins.live.handle.lease
    }
