"""RabbitMQ has no lease that lapses: a delivery whose settlement cannot be completed (its copy to the
delayed store fails while the side database is down, its breaker open) would stay unacked on the
consumer's open channel, holding a prefetch slot and never running again until the process ends.
The provider gives it back to the broker (nack with requeue) ``give_back_after`` seconds after the
first failed try unless a later try completed it, and refuses every try after the give-back.

Real broker, real SQLite side store; the outage is injected deterministically at the store's call
(the driver's own exception, as the fault suite raises it) and lasts until the test lifts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aio_pika
import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, RetryPolicy, queue
from queueing_core.decisions import Complete
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from queueing_core.transport import Delivery, Settlement
from tests.contract.harness import all_have, running, wait_until
from tests.faults.kits import _sql_error
from tests.services import RABBITMQ_URL, fresh_prefix, require


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


@queue("GiveBack.Job", max_attempts=5, retry=RetryPolicy(base=timedelta(milliseconds=100), jitter=0))
class Job(QueueMessage):
    n: int


class Outage:
    """The delayed store's writes fail (the driver's error) while ``on``; deterministic, no timing."""

    def __init__(self, provider: RabbitMQProvider) -> None:
        self.on = False
        self.failed = 0
        real: Callable[..., Awaitable[Any]] = provider.delayed.store_many

        async def store_many(items: Any) -> Any:
            if self.on:
                self.failed += 1
                raise _sql_error()
            return await real(items)

        provider.delayed.store_many = store_many  # type: ignore[method-assign]


async def make(tmp_path, fail_runs: int = 1) -> tuple[QueueingApp, Runtime, RabbitMQProvider, list[int]]:
    prefix = fresh_prefix()
    app = QueueingApp("giveback", naming=QueueNaming(prefix=prefix))
    runs: list[int] = []

    @app.handler(max_concurrency=1)
    async def handle(msg: Job, ctx: Any) -> None:
        runs.append(ctx.attempt)
        if len(runs) <= fail_runs:
            raise RuntimeError("downstream failed: retry with backoff")

    prov = RabbitMQProvider(
        RABBITMQ_URL, stores=SideStores(f"sqlite:///{tmp_path}/{prefix}side.db"), idle_timeout=0.5
    )
    # set as an attribute (not a constructor argument) so this test runs, and fails, on the code from
    # before the give-back too
    prov.give_back_after = 1.0
    rt = Runtime(app, prov)
    await rt.open()
    return app, rt, prov, runs


async def cleanup(rt: Runtime, prov: RabbitMQProvider) -> None:
    physical = prov.physical("GiveBack.Job")
    await rt.close()
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        for name in (physical, prov.dead_letter_name(physical)):
            await channel.queue_delete(name)


async def receive_one(rt: Runtime, prov: RabbitMQProvider, timeout: float = 15.0) -> Delivery:
    sub = rt.app.subscription("Job")
    assert sub is not None
    out: list[Delivery] = []

    async def got() -> bool:
        out.extend(await prov.receive(sub, 1))
        if not out:
            await prov.wait_for_work(sub, 0.2)
        return bool(out)

    await wait_until(got, timeout=timeout, what="a delivery")
    return out[0]


async def test_a_retry_whose_copy_to_the_delayed_store_keeps_failing_is_given_back_and_runs_again(tmp_path):
    """The side database stays down past the settler's five tries: the message is not stuck on the
    channel, it is delivered again (counting the attempt its retry used) and succeeds."""
    app, rt, prov, runs = await make(tmp_path)
    outage = Outage(prov)
    try:
        outage.on = True
        async with running(rt):
            r = await app.enqueue(Job(n=1))
            # before the fix: the delivery sat unacked on the worker's channel, runs stayed [1]
            await wait_until(lambda: len(runs) >= 2, timeout=20, what="the message ran again")
            await wait_until(lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="success")
        assert outage.failed >= 1, "the retry never tried the delayed store"
        assert runs == [1, 2], "the redelivery counts the attempt the failed retry used, once"
        assert await prov.depth(prov.physical("GiveBack.Job")) == 0
        assert (await prov.delayed.counts()).get(prov.physical("GiveBack.Job"), 0) == 0
    finally:
        outage.on = False
        await cleanup(rt, prov)


async def test_a_later_try_of_a_settlement_that_was_given_back_is_refused(tmp_path):
    """The settler tries the same settlement again after the give-back: that try must neither copy
    the message into the delayed store nor ack a delivery already returned (a duplicate, or an ack
    of a tag the broker has given to someone else)."""
    app, rt, prov, _ = await make(tmp_path)
    outage = Outage(prov)
    try:
        await app.enqueue(Job(n=2))
        d = await receive_one(rt, prov)
        settlement = await rt.process(d)
        assert settlement.decision.status == MessageStatus.FAILED
        outage.on = True
        with pytest.raises(Exception, match="connection reset"):
            await prov.settle([settlement])
        outage.on = False
        # the give-back: the broker delivers it again (redelivered: the attempt its retry used)
        again = await receive_one(rt, prov, timeout=10)
        assert again.envelope is not None
        assert d.envelope is not None
        assert again.envelope.message_id == d.envelope.message_id
        # the settler's next try of the first settlement (the store answers again by now)
        await prov.settle([settlement])
        assert settlement.delivery.refused, "a try after the give-back was applied"
        assert (await prov.delayed.counts()).get(prov.physical("GiveBack.Job"), 0) == 0, (
            "a try after the give-back copied the message into the delayed store: a duplicate"
        )
        await prov.settle([Settlement(again, Complete())])
        assert not again.refused
        await asyncio.sleep(0.3)
        assert await prov.depth(prov.physical("GiveBack.Job")) == 0
    finally:
        outage.on = False
        await cleanup(rt, prov)


async def test_a_brief_outage_is_ridden_out_without_a_give_back(tmp_path):
    """The settler's second try completes the settlement before ``give_back_after``: no redelivery,
    the retry waits in the delayed store, and the consumer no longer counts it in flight."""
    app, rt, prov, _ = await make(tmp_path)
    outage = Outage(prov)
    try:
        await app.enqueue(Job(n=3))
        d = await receive_one(rt, prov)
        settlement = await rt.process(d)
        outage.on = True
        with pytest.raises(Exception, match="connection reset"):
            await prov.settle([settlement])
        outage.on = False
        await prov.settle([settlement])
        assert not settlement.delivery.refused
        await asyncio.sleep(prov.give_back_after + 0.5)  # the timer would have fired by now
        assert (await prov.delayed.counts()).get(prov.physical("GiveBack.Job"), 0) == 1
        assert await prov.depth(prov.physical("GiveBack.Job")) == 0, "given back although completed"
        assert all(c.in_flight == 0 for c in prov._consumers.values())
    finally:
        await cleanup(rt, prov)


async def test_a_settlement_cancelled_half_way_is_given_back_and_leaves_nothing_in_flight(tmp_path):
    """A try cancelled while its copy to the delayed store is under way (a settler stopped at its
    deadline, a caller's timeout): the message is given back like a failed try's, and its consumer no
    longer counts it in flight."""
    app, rt, prov, _ = await make(tmp_path)
    started, never = asyncio.Event(), asyncio.Event()
    real = prov.delayed.store_many

    async def hangs(items: Any) -> Any:
        started.set()
        await never.wait()
        return await real(items)

    prov.delayed.store_many = hangs  # type: ignore[method-assign]
    try:
        await app.enqueue(Job(n=4))
        d = await receive_one(rt, prov)
        settlement = await rt.process(d)
        assert settlement.decision.status == MessageStatus.FAILED
        task = asyncio.create_task(prov.settle([settlement]))
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        prov.delayed.store_many = real  # type: ignore[method-assign]
        again = await receive_one(rt, prov, timeout=10)  # before the fix: never (unacked for ever)
        assert again.envelope is not None
        assert d.envelope is not None
        assert again.envelope.message_id == d.envelope.message_id
        await prov.settle([Settlement(again, Complete())])
        assert not again.refused
        assert all(c.in_flight == 0 for c in prov._consumers.values())
    finally:
        never.set()
        await cleanup(rt, prov)
