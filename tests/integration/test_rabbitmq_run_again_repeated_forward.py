"""A message that asks to run again (its handler returns a time) and whose delayed forward is repeated
(the row is forwarded again, marked ``queueing-repeated-forward``): a repeat whose first forward never
arrived runs, the chain's first copy and a later one alike. (A repeat whose first forward did run also
runs: its history says Sleeping, which a record written ahead of a settlement that never happened says
too, so it cannot be told from the only copy left; see tests/unit/test_run_again_repeat_runs.py.)"""

from __future__ import annotations

from datetime import timedelta

import aio_pika
import pytest

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.delayed import DelayedMessage
from queueing_core.providers.rabbitmq import RabbitMQProvider
from queueing_core.providers.sql.history import SideStores
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.services import RABBITMQ_URL, fresh_prefix, require


@pytest.fixture(autouse=True)
def _broker():
    require("RabbitMQ", "127.0.0.1", 5672)


@queue("Recurring.Tick")
class Tick(QueueMessage):
    n: int


#: far enough off that no next run comes due while a test looks
LATER = timedelta(hours=1)


def make(tmp_path, periods: list[timedelta]) -> tuple[QueueingApp, Runtime, RabbitMQProvider, list[int]]:
    """A handler that asks to run again after each of ``periods`` in turn (then an hour on)."""
    prefix = fresh_prefix()
    app = QueueingApp("again", naming=QueueNaming(prefix=prefix))
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Tick):
        runs.append(msg.n)
        period = periods[len(runs) - 1] if len(runs) <= len(periods) else LATER
        return utcnow() + period  # run again later

    provider = RabbitMQProvider(
        RABBITMQ_URL,
        stores=SideStores(f"sqlite:///{tmp_path}/{prefix}side.db"),
        idle_timeout=0.5,
        reconnect_interval=0.5,
        dispatcher_options={"open_backoff": 0.05, "max_idle": 0.2},
    )
    return app, Runtime(app, provider), provider, runs


async def ran_again(rt: Runtime, message_id, runs: list[int], n: int) -> bool:
    """The ``n``-th run is recorded: Sleeping, its next copy stored."""
    rec = await rt.tracker.get(message_id)
    return (
        len(runs) >= n and rec is not None and rec.status == MessageStatus.SLEEPING and rec.reason is not None
    )


async def delete_queues(provider: RabbitMQProvider) -> None:
    physical = provider.physical("Recurring.Tick")
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        ch = await conn.channel()
        for name in (physical, f"{physical}.dead-letter"):
            await ch.queue_delete(name)


@pytest.mark.parametrize("lost", [1, 2], ids=["the-first-copy", "a-later-copy"])
async def test_a_repeated_forward_whose_first_forward_never_arrived_runs(tmp_path, lost):
    """Forward number ``lost`` fails before the broker takes it: the first copy (its record the
    producer's) or the copy the first run asked for (its record that run's Sleeping one, with this
    copy's own expiry). Its marked repeat is the only copy: it must run."""
    app, rt, provider, runs = make(tmp_path, [timedelta(milliseconds=300)])
    await rt.open()
    real = provider.forward_delayed
    forwards = {"n": 0}

    async def never_arrives(item: DelayedMessage) -> None:
        forwards["n"] += 1
        if forwards["n"] == lost:
            raise ProviderUnavailable("RabbitMQ unreachable during publishing")
        await real(item)

    provider.forward_delayed = never_arrives  # type: ignore[method-assign]
    try:
        receipt = await app.enqueue(Tick(n=1), delay=timedelta(milliseconds=300))
        async with running(rt):

            async def second_run_done() -> bool:
                rec = await rt.tracker.get(receipt.message_id)
                held = await provider.delayed.copies(receipt.message_id)
                # the second run recorded (it asked for an hour on), and the row it ran from removed
                return (
                    len(runs) >= 2
                    and rec is not None
                    and rec.not_before is not None
                    and rec.not_before > utcnow() + LATER / 2
                    and len(held) <= 1
                )

            await wait_until(second_run_done, what="the second run")
            assert provider.dispatcher.repeated == 1
        assert runs == [1, 1]
        assert len(await provider.delayed.copies(receipt.message_id)) == 1  # the next run's copy
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert not rec.duplicates
    finally:
        await rt.close()
        await delete_queues(provider)
