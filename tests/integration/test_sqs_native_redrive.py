"""SQS, on moto's server: AWS's own dead-letter-queue redrive runs the kit's letters again.

AWS's DLQ redrive (the console's "Start DLQ redrive", ``StartMessageMoveTask``) moves each letter
back to its source queue as a new message: a new ``MessageId``, its receive count from 1, its body
and attributes as they were. A letter the kit sent carries the attempts its message had used (all of
them) and its dead-lettering marks: its first receive back was past its last attempt, and it was
dead-lettered again unrun, "the last deliveries ended without a settlement" (found in review). moto
has no ``StartMessageMoveTask``: the move is made here as AWS documents it (receive from the DLQ,
send body and attributes to the source queue, delete from the DLQ).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, RetryPolicy, queue
from queueing_core.envelope import DEAD_AT, DESCRIPTION, REASON
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix


@queue(
    "Redrive.Job",
    max_attempts=2,
    lease_duration=timedelta(seconds=30),
    retry=RetryPolicy(base=timedelta(milliseconds=10), jitter=0),
)
class Job(QueueMessage):
    n: int


async def test_a_letter_moved_back_by_aws_dlq_redrive_runs_with_fresh_attempts(tmp_path: Any) -> None:
    """A message fails both its attempts and is dead-lettered; the operator fixes what failed and
    moves the letter back with AWS's redrive: it runs (attempt 1 again, no dead-letter marks in its
    envelope), succeeds, and the history says so; the DLQ stays empty."""
    downstream_up = False
    attempts: list[int] = []
    seen_headers: list[dict[str, str]] = []

    prefix = fresh_prefix()
    app = QueueingApp("redrive", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def handle(msg: Job, ctx: Any) -> None:
        attempts.append(ctx.attempt)
        seen_headers.append(dict(ctx.headers))
        if not downstream_up:
            raise RuntimeError("downstream down")

    prov = SqsProvider(sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, prov)
    await rt.open()
    client = sqs_client()
    main_url = await prov._url("Redrive.Job")
    dlq_url = await prov._url("Redrive.Job", dead=True)
    sub = app.subscription("Job")
    assert sub is not None

    async def one_run() -> str:
        got: list[Any] = []

        async def received() -> bool:
            got.extend(await prov.receive(sub, 1))
            return bool(got)

        await wait_until(received, timeout=15, what="a message")
        s = await rt.process(got[0])
        await prov.settle([s])
        await rt.record([s])
        return type(s.decision).__name__

    try:
        message_id = (await app.enqueue(Job(n=1))).message_id
        assert await one_run() == "RetryAfter"
        assert await one_run() == "DeadLetter"
        record = await rt.tracker.get(message_id)
        assert record is not None
        assert record.status == MessageStatus.DEAD_LETTERED

        downstream_up = True
        letters = client.receive_message(
            QueueUrl=dlq_url, MaxNumberOfMessages=10, MessageAttributeNames=["All"], WaitTimeSeconds=1
        )["Messages"]
        assert len(letters) == 1
        for m in letters:  # AWS's move: a new message, body and attributes as they were
            client.send_message(
                QueueUrl=main_url, MessageBody=m["Body"], MessageAttributes=m["MessageAttributes"]
            )
            client.delete_message(QueueUrl=dlq_url, ReceiptHandle=m["ReceiptHandle"])

        assert await one_run() == "Complete", "the redriven letter was not run"
        assert attempts == [1, 2, 1]
        assert not {REASON, DESCRIPTION, DEAD_AT} & set(seen_headers[-1])
        record = await rt.tracker.get(message_id)
        assert record is not None
        assert record.status == MessageStatus.SUCCEEDED
        back = client.receive_message(QueueUrl=dlq_url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
        assert not back.get("Messages"), "the redriven letter was dead-lettered again"
    finally:
        await rt.close()
        for url in (main_url, dlq_url):
            client.delete_queue(QueueUrl=url)


async def test_a_senders_own_header_of_the_letters_name_is_not_taken_for_a_redrive(tmp_path: Any) -> None:
    """Only a letter the kit sent carries its reason among the SQS message's attributes: a header of
    that name that the sender set is the sender's, kept with the message's own expiry (taken for a
    redrive, it was dropped and the expiry replaced by the type's)."""
    seen: list[dict[str, str]] = []
    prefix = fresh_prefix()
    app = QueueingApp("redrive-own", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def handle(msg: Job, ctx: Any) -> None:
        seen.append(dict(ctx.headers))

    prov = SqsProvider(sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, prov)
    await rt.open()
    client = sqs_client()
    urls = [await prov._url("Redrive.Job"), await prov._url("Redrive.Job", dead=True)]
    sub = app.subscription("Job")
    assert sub is not None
    try:
        sent = await app.enqueue(Job(n=1), headers={REASON: "the sender's"}, ttl=timedelta(minutes=2))
        got: list[Any] = []

        async def received() -> bool:
            got.extend(await prov.receive(sub, 1))
            return bool(got)

        await wait_until(received, timeout=15, what="the message")
        assert got[0].envelope.expires_at == sent.expires_at
        await rt.process(got[0])
        assert seen == [{REASON: "the sender's"}]
    finally:
        await rt.close()
        for url in urls:
            client.delete_queue(QueueUrl=url)
