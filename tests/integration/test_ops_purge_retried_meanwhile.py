"""A purge deletes a message's history only while it still says what the purge listed.

An operator retried a dead letter while another's purge of its queue was under way: the purge's
look for the letter found it gone (the retry had taken it, its copy on its way) and deleted the
message's history by its id, so the copy ran with no history, the purge counted it deleted, and it
could not be cancelled meanwhile (found in review). SQS on moto's server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from uuid import UUID

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


@contextlib.asynccontextmanager
async def dead_lettered(tmp_path: Path) -> AsyncIterator[tuple[Runtime, SqsProvider, UUID]]:
    """A runtime on SQS whose one message was dead-lettered, its worker stopped."""
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

        async def dead() -> bool:
            return await status(rt, mid) == MessageStatus.DEAD_LETTERED

        async with running(rt):
            await wait_until(dead, what="the dead letter")
        yield rt, provider, mid
    finally:
        await rt.close()
        for url in sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            sqs.delete_queue(QueueUrl=url)


async def status(rt: Runtime, mid: UUID) -> str | None:
    rec = await rt.tracker.get(mid)
    return rec.status if rec is not None else None


async def test_a_letter_retried_while_its_queue_is_purged_keeps_its_history(tmp_path: Path) -> None:
    async with dead_lettered(tmp_path) as (rt, provider, mid):
        ops = OpsService(rt)
        remove = provider.ops_remove

        async def retried_meanwhile(query: MessageQuery, records: Any) -> Any:
            await ops.retry(mid)  # another operator, after this purge listed the history
            return await remove(query, records)

        provider.ops_remove = retried_meanwhile  # type: ignore[method-assign]
        done = await ops.purge(MessageQuery(queue=QUEUE))
        assert await status(rt, mid) == MessageStatus.PENDING  # the copy waits in the queue with its history
        assert (done.deleted, done.left_waiting) == (0, 1), done
        await ops.cancel(mid)  # (it named no message: MessageNotFound)


async def test_a_letter_retried_after_its_queue_was_emptied_keeps_its_history(tmp_path: Path) -> None:
    """The queue emptied whole, its waiting message listed Pending; the letter retried after the
    transport's purge and before its history went: the copy is Pending as well, and waits in the
    emptied queue. Its history stays (a guard by the set of listed statuses took it: Pending was one)."""
    async with dead_lettered(tmp_path) as (rt, provider, mid):
        waiting = (await rt.app.enqueue(Job(n=2))).message_id  # no worker: it waits, Pending
        ops = OpsService(rt)
        remove = provider.ops_remove

        async def retried_after(query: MessageQuery, records: Any) -> Any:
            removed = await remove(query, records)
            await ops.retry(mid)  # another operator, once the queue was emptied
            return removed

        provider.ops_remove = retried_after  # type: ignore[method-assign]
        await ops.purge(MessageQuery(queue=QUEUE), whole=True)
        assert await status(rt, waiting) is None  # its message emptied with the queue, its history gone
        assert await status(rt, mid) == MessageStatus.PENDING  # the copy's history kept
        await ops.cancel(mid)  # (it named no message: MessageNotFound)


async def test_a_letter_retried_and_dead_lettered_again_during_the_purge_keeps_its_history(
    tmp_path: Path,
) -> None:
    """Retried after the purge listed it, the copy ran and was dead-lettered again before the purge
    deleted the history: DeadLettered once more, as listed, but a new letter. Its history stays with
    it (a guard by the status alone took it, and the new letter was left with no history, which the
    dead-letter list on SQS reads: never listed, never retried; found in review)."""
    async with dead_lettered(tmp_path) as (rt, provider, mid):
        ops = OpsService(rt)
        remove = provider.ops_remove
        first = await rt.tracker.get(mid)
        assert first is not None

        async def retried_and_dead_again(query: MessageQuery, records: Any) -> Any:
            await ops.retry(mid)  # another operator, after this purge listed the history
            removed = await remove(query, records)  # its letter not there: the copy on its way

            async def dead_again() -> bool:
                rec = await rt.tracker.get(mid)
                return (
                    rec is not None
                    and rec.status == MessageStatus.DEAD_LETTERED
                    and rec.updated_at > first.updated_at
                )

            async with running(rt):  # the copy runs, and is dead-lettered again at once
                await wait_until(dead_again, what="the copy's dead letter")
            return removed

        provider.ops_remove = retried_and_dead_again  # type: ignore[method-assign]
        await ops.purge(MessageQuery(queue=QUEUE))
        assert await status(rt, mid) == MessageStatus.DEAD_LETTERED  # the new letter's history
        listed = await rt.tracker.query(MessageQuery(queue=QUEUE, status=("DeadLettered",)))
        assert [r.message_id for r in listed.items] == [mid]  # listed, so it can be retried
