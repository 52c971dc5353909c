"""A whole-queue purge on SQS takes the messages workers hold too.

SQS's PurgeQueue deletes in-flight messages with the rest ("Deletes available messages in a queue
(including in-flight messages)", PurgeQueue API reference; moto does the same). The provider did not
say so (``purge_takes_held``), so the purge reported a held message as left to its worker
(``skipped_leased``) and kept its history while SQS had deleted it; when the run ended, SQS refused its
delete, the settlement was refused, and the history said ``Leased`` for good (found in review).

Now its history goes with the purge, and what the held run does afterwards writes no record back: a
completion is refused (the message is gone), a retry's copy, sent before the original's delete, comes
back and runs again (a duplicate, as the docs say), and that run records it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

import tests.contract.harness  # noqa: F401  (first: it imports harness_sqs itself)
from queueing_core import (
    MessageStatus,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    QueueNaming,
    RetryPolicy,
    queue,
)
from queueing_core.ops.service import OpsService
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix


@queue(
    "Held.Purged",
    lease_duration=timedelta(seconds=20),
    retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0),
)
class Held(QueueMessage):
    n: int


async def _status(rt: Runtime, message_id: Any) -> str | None:
    rec = await rt.tracker.get(message_id)
    return rec.status if rec is not None else None


@pytest.mark.parametrize("ending", ["complete", "retry", "dead-letter"])
async def test_a_whole_purge_takes_the_held_message_and_its_history(tmp_path, ending: str) -> None:
    prefix = fresh_prefix()
    client = sqs_client()
    app = QueueingApp("held", naming=QueueNaming(prefix=prefix))
    started, go = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    async def handle(msg: Held, ctx: Any) -> None:
        runs.append(ctx.attempt)
        if len(runs) > 1:
            return  # the copy a retry sent before the purge's deletion was found
        await ctx.report_progress(1, 3, "started")
        started.set()
        await go.wait()
        if ending == "progress":
            await ctx.report_progress(2, 3, "after the purge")
        if ending == "retry":
            raise RuntimeError("try again")
        if ending == "dead-letter":
            raise NonRetryableError("declined")

    app.handler(Held)(handle)
    provider = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    await rt.open()
    ops = OpsService(rt)
    try:
        r = await app.enqueue(Held(n=1))
        async with running(rt):
            await asyncio.wait_for(started.wait(), 20)
            await wait_until(
                lambda: _is(rt, r.message_id, MessageStatus.LEASED.value), what="the progress recorded"
            )
            result = await ops.purge(MessageQuery(queue="Held.Purged"), whole=True)
            depth = await provider.depth("Held.Purged")
            # SQS deleted the held message: the purge says so, and its history went with it
            assert sum(depth.values()) == 0, depth
            assert (result.deleted, result.skipped_leased, result.left_waiting) == (1, 0, 0), result
            assert await rt.tracker.get(r.message_id) is None
            go.set()
            if ending == "retry":
                # the run sent its copy before SQS refused the original's delete: the message comes
                # back once and runs again (a duplicate), and that run records its outcome
                await wait_until(
                    lambda: _is(rt, r.message_id, MessageStatus.SUCCEEDED.value), what="the copy's run"
                )
                assert runs == [1, 2], runs
            else:
                await asyncio.sleep(3)  # the run ends and settles; nothing comes back
                assert runs == [1], runs
        status = await _status(rt, r.message_id)
        if ending == "retry":
            assert status == MessageStatus.SUCCEEDED.value
        elif ending == "dead-letter":
            # its letter is sent before the delete: it is in the dead-letter queue, and recorded so
            # (listed, and retried or purged from there), not a letter no listing shows
            assert status == MessageStatus.DEAD_LETTERED.value
            dead = await provider.depth("Held.Purged", dead=True)
            assert dead["ready"] + dead["in_flight"] == 1, dead
        else:
            # the completion is refused (SQS refuses the purged message's receipt: moto does), and no
            # record is written back; a service that took the delete would record it Succeeded
            assert status in (None, MessageStatus.SUCCEEDED.value), status
        assert status != MessageStatus.LEASED.value
        if ending != "retry":
            assert sum((await provider.depth("Held.Purged")).values()) == 0
    finally:
        await rt.close()
        for url in client.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            client.delete_queue(QueueUrl=url)


async def _is(rt: Runtime, message_id: Any, status: str) -> bool:
    return await _status(rt, message_id) == status


async def test_a_record_a_late_progress_report_left_goes_with_the_next_purge(tmp_path) -> None:
    """What the SQS page says: progress a run reports after the purge writes its history back as
    Leased (the report cannot tell a purged message from one whose producer wrote no record: another
    producer's, or a record still on its way), and where the run's completion is then refused (moto
    refuses a purged message's delete) that record stays, until the next purge of the whole queue."""
    async with _progress_after_purge(tmp_path) as (rt, ops, message_id):
        assert await _status(rt, message_id) == MessageStatus.LEASED.value
        result = await ops.purge(MessageQuery(queue="Held.Purged"), whole=True)
        assert (result.deleted, result.skipped_leased) == (1, 0), result
        assert await _status(rt, message_id) is None


@contextlib.asynccontextmanager
async def _progress_after_purge(tmp_path: Any) -> AsyncIterator[tuple[Runtime, OpsService, Any]]:
    """A run that reports progress after a whole-queue purge took its message, and completes: yields
    the runtime (its worker stopped), the ops service and the message id."""
    prefix = fresh_prefix()
    client = sqs_client()
    app = QueueingApp("held", naming=QueueNaming(prefix=prefix))
    started, go = asyncio.Event(), asyncio.Event()

    async def handle(msg: Held, ctx: Any) -> None:
        await ctx.report_progress(1, 3, "started")
        started.set()
        await go.wait()
        await ctx.report_progress(3, 3, "after the purge")  # the last step: stored at once

    app.handler(Held)(handle)
    provider = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    await rt.open()
    ops = OpsService(rt)
    try:
        r = await app.enqueue(Held(n=1))
        async with running(rt):
            await asyncio.wait_for(started.wait(), 20)
            await wait_until(
                lambda: _is(rt, r.message_id, MessageStatus.LEASED.value), what="the progress recorded"
            )
            result = await ops.purge(MessageQuery(queue="Held.Purged"), whole=True)
            assert (result.deleted, result.skipped_leased) == (1, 0), result
            go.set()
            await asyncio.sleep(3)  # the run reports, ends and settles (refused: the message is gone)
        yield rt, ops, r.message_id
    finally:
        await rt.close()
        for url in client.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            client.delete_queue(QueueUrl=url)
