"""SQS deletes a dead letter 14 days after it was sent (a queue's longest retention), whoever looked at
it. Its history keeps the message whole and is not pruned by age: a month on, the dead-letter list
still shows it and a retry runs it from there. (Pruned with the rest after 14 days, it was lost with
its letter: found in review.)"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.ops import OpsService
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import all_have, running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix


@queue("Kept.Refund", max_attempts=2)
class Refund(QueueMessage):
    n: int


async def test_a_dead_letter_sqs_deleted_stays_listed_a_month_on_and_a_retry_runs_it(tmp_path: Any) -> None:
    app = QueueingApp("sqskept", naming=QueueNaming(prefix=fresh_prefix()))
    runs: list[int] = []
    declines = [True]

    @app.handler(Refund)
    async def handle(msg: Refund) -> None:
        runs.append(msg.n)
        if declines[0]:
            raise NonRetryableError("the bank declined")

    provider = SqsProvider(sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    await rt.open()
    try:
        sent = await app.enqueue(Refund(n=7))
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [sent.message_id], MessageStatus.DEAD_LETTERED), what="dead"
            )
        client = sqs_client()
        dlq = await provider._url("Kept.Refund", dead=True)
        client.purge_queue(QueueUrl=dlq)  # what SQS does to it on day 14
        provider.clock = lambda: utcnow() + timedelta(days=30)  # the maintenance of a month on
        pruned = (await provider.maintain())["history_pruned"]
        provider.clock = utcnow
        assert pruned == 0
        dead = MessageQuery(queue="Kept.Refund", status=("DeadLettered",))
        assert [m.message_id for m in (await OpsService(rt).list_messages(dead)).items] == [sent.message_id]
        declines[0] = False
        async with running(rt):
            await OpsService(rt).retry(sent.message_id)
            await wait_until(lambda: all_have(rt, [sent.message_id], MessageStatus.SUCCEEDED), what="retried")
        assert runs == [7, 7]
    finally:
        await rt.close()
