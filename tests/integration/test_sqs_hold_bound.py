"""A run on SQS is cut before SQS's 12 hours from its receive end, and its renewals stop there.

SQS ends a receive's hold on a message 12 hours after it, however often its visibility timeout is
extended (ChangeMessageVisibility refuses more: "you can't extend the timeout of a message ... to more
than a total visibility timeout of 12 hours"). A handler that ran longer could not settle its
message: another worker ran it beside the first, whose outcome was refused, every attempt, until it
was dead-lettered "ended without a settlement". The kit now cuts the run a minute before, as at its
time limit, and renews no further than the 12 hours (asked for a whole lease past them, SQS refused
the renewal, and the message came back beside its run before the cut: review). moto's SQS server, the
receive's time moved back; for the renewals, moto in this process with its clock and the kit's moved
forward together."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from botocore.exceptions import ClientError

import tests.contract.harness  # noqa: F401  (first: it imports harness_sqs itself)
from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import HOLD_BOUND, HOLD_MARGIN, MAX_VISIBILITY, SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix

#: how long the run has left of its hold when it starts
LEFT = timedelta(minutes=1, seconds=3)


@queue("Sqs.HoldBound", max_attempts=1)
class Job(QueueMessage):
    n: int


def test_the_bound_is_a_minute_inside_the_longest_hold_sqs_takes() -> None:
    sqs = sqs_client()
    url = sqs.create_queue(QueueName=f"{fresh_prefix()}hold")["QueueUrl"]
    try:
        sqs.send_message(QueueUrl=url, MessageBody="x")
        receipt = sqs.receive_message(QueueUrl=url)["Messages"][0]["ReceiptHandle"]
        longest = int(MAX_VISIBILITY.total_seconds())
        margin = int(HOLD_MARGIN.total_seconds())
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=receipt, VisibilityTimeout=longest - margin)
        # (moto's server, as SQS: 12 hours in all from the receive, its time since included)
        with pytest.raises(ClientError, match="beyond the limit"):
            sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=receipt, VisibilityTimeout=longest)
    finally:
        sqs.delete_queue(QueueUrl=url)
    assert HOLD_BOUND.limit == MAX_VISIBILITY - HOLD_MARGIN == timedelta(hours=11, minutes=59)
    provider = SqsProvider(sqs, stores=SideStores("sqlite://"), receive_wait=0)
    assert provider.capabilities.longest_run is HOLD_BOUND


async def test_a_run_nearing_twelve_hours_from_its_receive_is_cut_and_settled(tmp_path) -> None:
    prefix = fresh_prefix()
    sqs = sqs_client()
    app = QueueingApp("sqs-hold", naming=QueueNaming(prefix=prefix))
    runs: list[int] = []
    finished: list[int] = []

    @app.handler()
    async def job(msg: Job) -> None:
        runs.append(msg.n)
        await asyncio.sleep(120)
        finished.append(msg.n)

    provider = SqsProvider(sqs, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    receive = provider.receive

    async def received_long_ago(sub: Any, most: int) -> Any:
        deliveries = await receive(sub, most)
        for d in deliveries:  # as if received 11 h 58 min 57 s ago
            d.received_at -= MAX_VISIBILITY - LEFT
        return deliveries

    provider.receive = received_long_ago  # type: ignore[method-assign]
    rt = Runtime(app, provider)
    await rt.open()
    try:
        mid = (await app.enqueue(Job(n=1))).message_id

        async def dead() -> bool:
            rec = await rt.tracker.get(mid)
            return rec is not None and rec.status == MessageStatus.DEAD_LETTERED

        async with running(rt):
            # without the bound the run went on for its two minutes
            await wait_until(dead, timeout=30, what="the cut run's dead letter")
        rec = await rt.tracker.get(mid)
        assert rec is not None
        assert "SQS's 12 hours" in (rec.description or ""), rec.description
        assert (runs, finished) == ([1], [])  # one run, cut
    finally:
        await rt.close()
        for url in sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            sqs.delete_queue(QueueUrl=url)


@queue("Sqs.HoldRenew", lease_duration=timedelta(minutes=15))
class LongJob(QueueMessage):
    n: int


async def test_renewals_reach_the_bound_and_no_further(tmp_path, monkeypatch) -> None:
    import boto3
    import moto.sqs.models as moto_sqs
    from moto import mock_aws

    ahead = [timedelta(0)]
    real = moto_sqs.unix_time_millis

    def moved(dt: Any = None) -> float:
        return real(dt) if dt is not None else real() + ahead[0].total_seconds() * 1000

    monkeypatch.setattr(moto_sqs, "unix_time_millis", moved)
    with mock_aws():
        sqs = boto3.client(
            "sqs",
            region_name="us-east-1",
            endpoint_url="https://sqs.us-east-1.amazonaws.com",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        app = QueueingApp("sqs-hold-renew", naming=QueueNaming(prefix=fresh_prefix()))

        @app.handler()
        async def long_job(msg: LongJob) -> None:
            return None

        provider = SqsProvider(
            sqs,
            stores=SideStores(f"sqlite:///{tmp_path}/side.db"),
            receive_wait=0,
            clock=lambda: utcnow() + ahead[0],
        )
        rt = Runtime(app, provider)
        await rt.open()
        try:
            await app.enqueue(LongJob(n=1))
            sub = app.subscription("LongJob")
            assert sub is not None
            [d] = await provider.receive(sub, 1)
            # renewed every third of its lease, as the worker does, up to the run's bound
            for minutes in range(5, int(HOLD_BOUND.limit.total_seconds() // 60) + 1, 5):
                ahead[0] = timedelta(minutes=minutes)
                assert await provider.renew([d]) == [], f"the renewal at {minutes} min was refused"
            ahead[0] = HOLD_BOUND.limit
            # still hidden when the bound cuts the run (without the cap: back since 11 h 55)
            assert not sqs.receive_message(QueueUrl=d.handle.url).get("Messages")
            ahead[0] = MAX_VISIBILITY + timedelta(seconds=1)
            assert await provider.renew([d]) == [d]  # over: its receipt no longer works
        finally:
            await rt.close()
