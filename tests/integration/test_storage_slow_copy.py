"""Storage Queues: a settlement that copies (a dead letter, a release's fresh copy) hides the original
under its receipt, then writes the copy, then deletes the original. Hidden for one lease only, a copy
that took longer than the lease landed after another run had received the message and completed it:
the stale run's letter (or fresh copy, run again) stood beside the success (found in review). Now the
original stays hidden for as long as a copy and a delete can take, and a copy slower than that is
given up before the hold ends, so no other run can have the message while the copy lands."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, Decision, Release
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("slow.copy", lease_duration=timedelta(seconds=1))
class Job(QueueMessage):
    n: int


@pytest.fixture
async def provider(azurite: Any) -> AsyncIterator[StorageQueueProvider]:
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("slowcopy", naming=QueueNaming(prefix=f"s{tag}-"))
    app.message(Job)
    p = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"sc{tag}", tracker_table=f"sh{tag}"
    )
    rt = Runtime(app, p)
    await rt.open()
    yield p
    sub = app.subscription(Job.type_name())
    for name in (p.physical(sub.queue), p.poison_name(sub.queue)):
        await p.client(name).delete_queue()
    await rt.close()


async def _slowed(p: StorageQueueProvider, kind: str, seconds: float) -> Any:
    """The copy's queue client, its sends taking ``seconds`` before they go out."""
    sub = p._app.subscription(Job.type_name())  # type: ignore[union-attr]
    name = p.poison_name(sub.queue) if kind == "dead-letter" else p.physical(sub.queue)
    client = await p._ensure(name)
    real = client.send_message

    async def send_message(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(seconds)
        return await real(*args, **kwargs)

    client.send_message = send_message
    return client, real


def _decision(kind: str) -> Decision:
    if kind == "dead-letter":
        return DeadLetter(DeadLetterReason.NON_RETRYABLE, "the stale run's verdict")
    return Release("the stale run's release")


@pytest.mark.parametrize("kind", ["dead-letter", "release"])
async def test_a_copy_slower_than_the_hold_is_given_up_before_another_run_can_have_the_message(
    provider: StorageQueueProvider, kind: str
) -> None:
    p = provider
    app = p._app
    assert app is not None
    sub = app.subscription(Job.type_name())
    await app.enqueue(Job(n=1))
    [stale] = await p.receive(sub, 1)
    # the renewal before the copy hides the original for one lease (1 s); the copy takes 2.5 s
    client, real = await _slowed(p, kind, 2.5)
    with pytest.raises(ProviderUnavailable, match="took longer than the message stays hidden"):
        await p.settle([Settlement(stale, _decision(kind))])
    client.send_message = real
    # past the hold: the original comes back, and another run completes it
    live = await _received(p, sub)
    await p.settle([Settlement(live, Complete())])
    assert not live.refused
    # the settler tries the stale run's settlement again: its receipt is gone, so nothing is written
    await p.settle([Settlement(stale, _decision(kind))])
    assert stale.refused
    await asyncio.sleep(2.5)  # as long as the slow copy would have taken to land
    assert (await p.depth(sub.queue), await p.depth(sub.queue, poison=True)) == (0, 0)
    assert await p.receive(sub, 5) == []


async def _received(p: StorageQueueProvider, sub: Any) -> Any:
    for _ in range(40):
        got = await p.receive(sub, 1)
        if got:
            return got[0]
        await asyncio.sleep(0.1)
    raise AssertionError("the original did not come back after its hold")
