"""SQS, on moto's server: the consumers' long polls cannot hold the threads of the other calls.

Every boto3 call ran on one pool of 16 threads, and an idle consumer (one per type, each type its
own queue) long-polls back to back, holding a thread almost always. With more idle queues than
threads, renewals, settlements, sends and delayed forwards waited behind the polls; a renewal that
waited past what was left of the visibility timeout came too late, and the message ran twice while
its first run went on (found in review). The receives now have a pool of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.decisions import Complete
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix

IDLE = 40
#: the control calls' threads: far fewer than the idle queues, as 16 are beside a hundred
THREADS = 4


@queue("OwnPool.Slow", lease_duration=timedelta(seconds=6), max_attempts=5)
class Slow(QueueMessage):
    n: int


def _idle_types() -> list[type[QueueMessage]]:
    made = []
    for i in range(IDLE):
        cls = type(f"OwnPoolIdle{i}", (QueueMessage,), {"__annotations__": {"n": int}})
        made.append(queue(f"OwnPool.Idle{i}", lease_duration=timedelta(seconds=30))(cls))
    return made


IDLE_TYPES = _idle_types()


def _app(prefix: str, slow: Callable[..., Any], *, idle: bool) -> QueueingApp:
    app = QueueingApp("ownpool", naming=QueueNaming(prefix=prefix))
    app.handler(Slow)(slow)
    if idle:
        for cls in IDLE_TYPES:

            async def nothing(msg: Any) -> None:
                pass

            app.handler(cls)(nothing)
    return app


def _delete_queues(prov: SqsProvider) -> None:
    client = sqs_client()
    for q in ["OwnPool.Slow", *[f"OwnPool.Idle{i}" for i in range(IDLE)]]:
        physical = prov.physical(q)
        for name in (physical, prov.dead_letter_name(physical)):
            with contextlib.suppress(Exception):
                client.delete_queue(QueueUrl=client.get_queue_url(QueueName=name)["QueueUrl"])


async def test_idle_long_polls_hold_no_thread_a_send_renewal_or_settlement_needs(tmp_path: Any) -> None:
    """Forty receives stay in their long polls (held there until the end of the test, as idle queues'
    polls hold their threads back to back) while a message already received is renewed and settled,
    and another is enqueued: each goes ahead. On one pool of four threads the polls held every
    thread and none of the three ever started."""

    async def slow(msg: Slow) -> None:
        pass

    prefix = fresh_prefix()
    app = _app(prefix, slow, idle=True)
    prov = SqsProvider(
        sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/side.db"), threads=THREADS, receive_wait=0
    )
    rt = Runtime(app, prov)
    await rt.open()
    release = threading.Event()
    polling = 0
    count_lock = threading.Lock()
    real_receive = prov.client.receive_message
    idle_urls = {await prov._url(f"OwnPool.Idle{i}") for i in range(IDLE)}

    def receive_message(**kwargs: Any) -> Any:
        nonlocal polling
        if kwargs["QueueUrl"] in idle_urls:
            with count_lock:
                polling += 1
            release.wait(60)  # an idle queue's long poll, for as long as the test needs
            return {}
        return real_receive(**kwargs)

    polls: list[asyncio.Task[Any]] = []
    try:
        await app.enqueue(Slow(n=1))
        sub = app.subscription("Slow")
        assert sub is not None
        got: list[Any] = []

        async def received() -> bool:
            got.extend(await prov.receive(sub, 1))
            return bool(got)

        await wait_until(received, timeout=15, what="the slow message")
        [held] = got
        prov.client.receive_message = receive_message  # (the instance's, not the class's)
        for cls in IDLE_TYPES:
            idle_sub = app.subscription(cls.__name__)
            assert idle_sub is not None
            polls.append(asyncio.create_task(prov.receive(idle_sub, 10)))
        # every thread of a pool of THREADS is in a poll by now, on a shared pool
        await wait_until(lambda: polling >= THREADS, timeout=15, what="the idle queues' polls")
        # (a bound to fail by, far above a call's time: on a shared pool these never start)
        lost = await asyncio.wait_for(prov.renew([held]), 30)
        assert lost == [], "the renewal of a message whose run goes on was lost"
        await asyncio.wait_for(app.enqueue(Slow(n=2)), 30)
        settlement = await rt.process(held)
        await asyncio.wait_for(prov.settle([settlement]), 30)
        await rt.record([settlement])
        assert isinstance(settlement.decision, Complete)
        assert not held.refused
        record = await rt.tracker.get(held.envelope.message_id)
        assert record is not None
        assert record.status == MessageStatus.SUCCEEDED
        # (each idle consumer has a thread of its own by default: none waits for another's poll)
        await wait_until(lambda: polling == IDLE, timeout=15, what="every idle queue's poll")
    finally:
        release.set()
        await asyncio.gather(*polls, return_exceptions=True)
        prov.client.receive_message = real_receive
        await rt.close()
        _delete_queues(prov)


async def test_a_run_longer_than_its_visibility_timeout_beside_many_idle_queues_runs_once(
    tmp_path: Any,
) -> None:
    """The worker, forty idle queues long-polling on moto, four control threads: a message whose run
    takes more than twice its six-second visibility timeout runs once, renewed all along, although a
    second host consumes its queue. On one shared pool each renewal waited for some ten polls ahead
    of it, past the timeout, and the second host received the message and ran it beside the first."""
    runs: list[int] = []
    second_run = asyncio.Event()

    async def slow(msg: Slow) -> None:
        runs.append(msg.n)
        if len(runs) > 1:
            second_run.set()
        # longer than two visibility timeouts; cut short once a second run shows the failure
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(second_run.wait(), 14)

    prefix = fresh_prefix()
    app = _app(prefix, slow, idle=True)
    side = f"sqlite:///{tmp_path}/side.db"
    prov = SqsProvider(sqs_client(), stores=SideStores(side), threads=THREADS)
    rt = Runtime(app, prov)
    await rt.open()
    idle_urls = {await prov._url(f"OwnPool.Idle{i}") for i in range(IDLE)}
    polled: set[str] = set()
    real_receive = prov.client.receive_message

    def receive_message(**kwargs: Any) -> Any:
        polled.add(kwargs["QueueUrl"])
        return real_receive(**kwargs)

    prov.client.receive_message = receive_message  # (the instance's: noted, then moto's answer)
    # the second host: the same queue and side store, the slow type only
    prov_b = SqsProvider(sqs_client(), stores=SideStores(side))
    rt_b = Runtime(_app(prefix, slow, idle=False), prov_b)
    await rt_b.open()
    try:
        async with running(rt, shutdown_timeout=1.0):
            # the idle consumers poll before the message goes
            await wait_until(lambda: len(polled & idle_urls) >= 2 * THREADS, what="the idle polls")
            message_id = (await asyncio.wait_for(app.enqueue(Slow(n=1)), 30)).message_id
            await wait_until(lambda: bool(runs), timeout=30, what="the first run")
            async with running(rt_b, shutdown_timeout=1.0):

                async def recorded() -> bool:
                    record = await rt.tracker.get(message_id)
                    return record is not None and record.status == MessageStatus.SUCCEEDED

                await wait_until(recorded, timeout=60, what="the run's outcome")
        assert runs == [1], "the message ran again while its first run went on (its lease lapsed)"
    finally:
        await rt_b.close()
        await rt.close()
        _delete_queues(prov)
