"""A purge deletes a message's history only while it still says what the purge listed.

An operator retried a dead letter while another's purge of its queue was under way: the purge's
look for the letter found it gone (the retry had taken it, its copy on its way) and deleted the
message's history by its id, so the copy ran with no history, the purge counted it deleted, and it
could not be cancelled meanwhile (found in review). SQS on moto's server."""

from __future__ import annotations

from typing import Any

import tests.contract.harness  # noqa: F401  (first: it imports harness_sqs itself)
from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.ops import OpsService
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix

QUEUE = "Purge.RetriedMeanwhile"


@queue(QUEUE, max_attempts=1)
class Job(QueueMessage):
    n: int


async def test_a_letter_retried_while_its_queue_is_purged_keeps_its_history(tmp_path) -> None:
    prefix = fresh_prefix()
    sqs = sqs_client()
    app = QueueingApp("purge-retried", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def job(msg: Job) -> None:
        raise NonRetryableError("not this one")

    provider = SqsProvider(sqs, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider, control_ttl=0.05)
    await rt.open()
    try:
        mid = (await app.enqueue(Job(n=1))).message_id

        async def status() -> str | None:
            rec = await rt.tracker.get(mid)
            return rec.status if rec is not None else None

        async def dead() -> bool:
            return await status() == MessageStatus.DEAD_LETTERED

        async with running(rt):
            await wait_until(dead, what="the dead letter")
        ops = OpsService(rt)
        remove = provider.ops_remove

        async def retried_meanwhile(query: MessageQuery, records: Any) -> Any:
            await ops.retry(mid)  # another operator, after this purge listed the history
            return await remove(query, records)

        provider.ops_remove = retried_meanwhile  # type: ignore[method-assign]
        done = await ops.purge(MessageQuery(queue=QUEUE))
        assert await status() == MessageStatus.PENDING  # the copy waits in the queue with its history
        assert (done.deleted, done.left_waiting) == (0, 1), done
        await ops.cancel(mid)  # (it named no message: MessageNotFound)
    finally:
        await rt.close()
        for url in sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            sqs.delete_queue(QueueUrl=url)
