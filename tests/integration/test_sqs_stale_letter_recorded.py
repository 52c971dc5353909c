"""SQS, on moto's server: a dead letter sent is recorded though the settler gives its batch up.

A dead letter whose original's delete SQS refuses as the sender's fault (the receipt is no longer the
message's) is recorded all the same, so that the letter in the DLQ is listed. That was done only
once the batch's deletes had all gone through: with another settlement of the same batch whose
delete kept failing on SQS's side, every try raised before it, and when the settler gave the batch
up after its five tries the letter's record was dropped: the letter sat in the DLQ, its history
Pending for good (found in review).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Settler
from tests.contract.harness import wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix


@queue("GivenUp.Job", lease_duration=timedelta(minutes=2))
class Job(QueueMessage):
    n: int


async def test_a_sent_letter_whose_delete_was_refused_is_recorded_when_the_batch_is_given_up(
    tmp_path: Any,
) -> None:
    """Two settlements in one batch: a dead letter whose original's receipt SQS refuses, and a
    completion whose delete fails on SQS's side on every try. After the settler's five tries the
    letter is in the DLQ and its history says DeadLettered; the completion is not recorded."""
    prefix = fresh_prefix()
    app = QueueingApp("givenup", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def handle(msg: Job) -> None:
        pass

    prov = SqsProvider(sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, prov)
    await rt.open()
    client = sqs_client()
    urls = [await prov._url("GivenUp.Job", dead=dead) for dead in (False, True)]
    try:
        for i in range(2):
            await app.enqueue(Job(n=i))
        sub = app.subscription("Job")
        assert sub is not None
        got: list[Any] = []

        async def both() -> bool:
            got.extend(await prov.receive(sub, 10))
            return len(got) >= 2

        await wait_until(both, timeout=15, what="the two messages")
        letter, flaky = got
        letter.handle.receipt = "not-a-receipt-sqs-gave"  # (SQS refuses it as the sender's fault)
        real_call = prov._call
        deletes = 0

        async def flaky_fails_on_sqs_side(action: str, fn: Any, **kwargs: Any) -> Any:
            nonlocal deletes
            if action != "deleting messages":
                return await real_call(action, fn, **kwargs)
            deletes += 1
            entries = [e for e in kwargs["Entries"] if e["ReceiptHandle"] != flaky.handle.receipt]
            failing = [e for e in kwargs["Entries"] if e["ReceiptHandle"] == flaky.handle.receipt]
            resp = await real_call(action, fn, **{**kwargs, "Entries": entries}) if entries else {}
            for e in failing:  # SQS fails this entry on its side, every time
                resp.setdefault("Failed", []).append(
                    {"Id": e["Id"], "SenderFault": False, "Code": "InternalError", "Message": "try again"}
                )
            return resp

        prov._call = flaky_fails_on_sqs_side  # type: ignore[method-assign]
        settler = Settler(rt, linger=0)
        settler.backoff = 0.01
        settler.start()
        settler.add(Settlement(letter, DeadLetter(DeadLetterReason.NON_RETRYABLE, "declined")))
        settler.add(Settlement(flaky, Complete()))
        await wait_until(lambda: deletes >= 5, timeout=60, what="the settler's five tries")
        await settler.close()
        prov._call = real_call  # type: ignore[method-assign]

        dlq = client.receive_message(
            QueueUrl=urls[1], MaxNumberOfMessages=10, VisibilityTimeout=0, WaitTimeSeconds=1
        ).get("Messages", [])
        assert len(dlq) == 1, "the dead letter was not sent"
        record = await rt.tracker.get(letter.envelope.message_id)
        assert record is not None
        assert record.status == MessageStatus.DEAD_LETTERED, "the letter in the DLQ is not listed"
        other = await rt.tracker.get(flaky.envelope.message_id)
        assert other is None or other.status != MessageStatus.SUCCEEDED, "an undeleted message recorded"
    finally:
        await rt.close()
        for url in urls:
            client.delete_queue(QueueUrl=url)
