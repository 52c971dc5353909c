"""Storage Queues: a settlement that copies (a dead letter, a release's fresh copy) hides the original
under its receipt, then writes the copy, then deletes the original. Hidden for one lease only, a copy
that took longer than the lease landed after another run had received the message and completed it:
the stale run's letter (or fresh copy, run again) stood beside the success (found in review). Now the
hold is renewed while the copy is on its way, so no other run can have the message while it lands; a
copy is given up only when the hold cannot be renewed, and a copy whose answer is only slow is sent
once (cancelled at a deadline, it was sent again on every try of the settler: found in review)."""

from __future__ import annotations

import asyncio
import types
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from azure.core.exceptions import ServiceRequestError

from queueing_core import QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason, Decision, Release
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Worker


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


async def _slowed(p: StorageQueueProvider, kind: str, before: float, after: float = 0.0) -> Any:
    """The copy's queue client: its sends wait ``before`` seconds, go out, then answer ``after``
    seconds later. Returns the client, its own send, and the list of sends that went out."""
    sub = p._app.subscription(Job.type_name())  # type: ignore[union-attr]
    name = p.poison_name(sub.queue) if kind == "dead-letter" else p.physical(sub.queue)
    client = await p._ensure(name)
    real = client.send_message
    went: list[object] = []

    async def send_message(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(before)
        answer = await real(*args, **kwargs)
        went.append(answer)
        await asyncio.sleep(after)
        return answer

    client.send_message = send_message
    return client, real, went


def _decision(kind: str) -> Decision:
    if kind == "dead-letter":
        return DeadLetter(DeadLetterReason.NON_RETRYABLE, "the stale run's verdict")
    return Release("the stale run's release")


async def _depths(p: StorageQueueProvider, queue: str) -> tuple[int, int]:
    await asyncio.sleep(0.2)
    return await p.depth(queue), await p.depth(queue, poison=True)


@pytest.mark.parametrize("kind", ["dead-letter", "release"])
@pytest.mark.parametrize(("before", "after"), [(2.5, 0.0), (0.0, 2.5)], ids=["slow-send", "slow-answer"])
async def test_a_copy_slower_than_the_lease_lands_while_the_original_is_held(
    provider: StorageQueueProvider, kind: str, before: float, after: float
) -> None:
    """The lease is 1 s; the copy takes 2.5 s (before it goes out, or after, its answer slow). No other
    run gets the original meanwhile, the settlement succeeds at its first try, and one copy is sent."""
    p = provider
    app = p._app
    assert app is not None
    sub = app.subscription(Job.type_name())
    await app.enqueue(Job(n=1))
    [first] = await p.receive(sub, 1)
    client, real, went = await _slowed(p, kind, before, after)
    settling = asyncio.create_task(p.settle([Settlement(first, _decision(kind))]))
    others = []
    for _ in range(8):  # past the first hold and beyond: the original stays hidden (a copy may come)
        await asyncio.sleep(0.3)
        others += await p.receive(sub, 5)
    await settling
    client.send_message = real
    assert not first.refused
    assert len(went) == 1
    others += await p.receive(sub, 5) if kind == "release" else []
    assert all(d.handle.id != first.handle.id for d in others)  # never the original
    if kind == "dead-letter":
        assert others == []
        assert await _depths(p, sub.queue) == (0, 1)
    else:
        # the fresh copy, one queue message (received again here as each of its leases ran out)
        assert len({d.handle.id for d in others}) == 1
        again = others[0]
        assert again.envelope is not None
        assert first.envelope is not None
        assert again.envelope.message_id == first.envelope.message_id


@pytest.mark.parametrize("kind", ["dead-letter", "release"])
async def test_a_copy_is_given_up_when_its_hold_cannot_be_renewed(
    provider: StorageQueueProvider, kind: str
) -> None:
    """The copy takes 2.5 s and the service stops answering renewals: the copy is given up before the
    hold ends (cancelled before it goes out). The original comes back and another run completes it;
    the stale run's settlement, tried again, is refused, and no copy stands beside the success."""
    p = provider
    app = p._app
    assert app is not None
    sub = app.subscription(Job.type_name())
    await app.enqueue(Job(n=1))
    [stale] = await p.receive(sub, 1)
    client, real, went = await _slowed(p, kind, 2.5)
    main = await p._ensure(p.physical(sub.queue))
    real_update = main.update_message
    hides = 0

    async def update_message(*args: Any, **kwargs: Any) -> Any:
        nonlocal hides
        hides += 1
        if hides > 1:  # the hold before the copy is given; its renewals are not answered
            raise ServiceRequestError("the service does not answer")
        return await real_update(*args, **kwargs)

    main.update_message = update_message
    with pytest.raises(ProviderUnavailable, match="hold nearly over"):
        await p.settle([Settlement(stale, _decision(kind))])
    main.update_message = real_update
    client.send_message = real
    live = await _received(p, sub)
    await p.settle([Settlement(live, Complete())])
    assert not live.refused
    # the settler tries the stale run's settlement again: its receipt is gone, so nothing is written
    await p.settle([Settlement(stale, _decision(kind))])
    assert stale.refused
    await asyncio.sleep(2.5)  # as long as the cancelled copy would have taken to land
    assert went == []
    assert await _depths(p, sub.queue) == (0, 0)
    assert await p.receive(sub, 5) == []


async def _received(p: StorageQueueProvider, sub: Any) -> Any:
    for _ in range(40):
        got = await p.receive(sub, 1)
        if got:
            return got[0]
        await asyncio.sleep(0.1)
    raise AssertionError("the original did not come back after its hold")


async def test_a_slow_copy_does_not_hold_up_the_renewal_of_the_workers_other_messages(
    provider: StorageQueueProvider,
) -> None:
    """The worker's renewal round renews every message it has in flight together. A settlement whose
    copy is slow holds its message's turn; a renewal that waited its turn behind it held up the whole
    round, and the other messages' leases ran out while their handlers still ran (found in review).
    The worker's own renewal loop runs here over A (settling, its dead letter taking 4 s) and B (its
    handler still running): no other run receives B meanwhile."""
    p = provider
    app = p._app
    assert app is not None
    sub = app.subscription(Job.type_name())
    await app.enqueue_many([Job(n=1), Job(n=2)])
    a, b = await p.receive(sub, 2)
    client, real, went = await _slowed(p, "dead-letter", 4.0)
    worker = types.SimpleNamespace(
        runtime=types.SimpleNamespace(provider=p), subscriptions=lambda: [sub], _in_flight={1: a, 2: b}
    )
    renewing = asyncio.create_task(Worker._renew_loop(worker))  # type: ignore[arg-type]
    try:
        settling = asyncio.create_task(p.settle([Settlement(a, _decision("dead-letter"))]))
        others = []
        while not settling.done():
            await asyncio.sleep(0.3)
            others += await p.receive(sub, 5)  # another worker
        await settling
    finally:
        renewing.cancel()
        await asyncio.wait({renewing})
    client.send_message = real
    assert others == []
    assert not a.refused
    assert len(went) == 1


@queue("slow.delete", lease_duration=timedelta(seconds=6))
class Held(QueueMessage):
    n: int


async def test_a_delete_tried_again_after_the_copy_keeps_the_original_renewed(
    provider: StorageQueueProvider,
) -> None:
    """The dead letter is written; then the original's delete fails for 10 s (the service answers
    renewals all the while) and the settler tries again with its pauses. Between the tries the
    worker's renewals keep the original hidden: no other run receives it (passed over for the whole
    settlement, renewals let the hold lapse between the tries, and another run ran the message beside
    its letter: found in review)."""
    p = provider
    app = p._app
    assert app is not None
    app.message(Held)
    sub = app.subscription(Held.type_name())
    await p._ensure(p.physical(sub.queue))
    await app.enqueue(Held(n=1))
    [a] = await p.receive(sub, 1)
    main = await p._ensure(p.physical(sub.queue))
    real_delete = main.delete_message
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def delete_message(*args: Any, **kwargs: Any) -> Any:
        if loop.time() - start < 10:
            raise ServiceRequestError("the service does not answer deletes")
        return await real_delete(*args, **kwargs)

    main.delete_message = delete_message
    worker = types.SimpleNamespace(
        runtime=types.SimpleNamespace(provider=p), subscriptions=lambda: [sub], _in_flight={1: a}
    )
    renewing = asyncio.create_task(Worker._renew_loop(worker))  # type: ignore[arg-type]
    others: list[Any] = []

    async def another_worker() -> None:
        while True:
            await asyncio.sleep(0.3)
            others.extend(await p.receive(sub, 5))

    polling = asyncio.create_task(another_worker())
    try:
        for attempt in range(1, 6):  # the settler's tries and pauses
            try:
                await p.settle([Settlement(a, _decision("dead-letter"))])
                break
            except ProviderUnavailable:
                await asyncio.sleep(min(5.0, 0.2 * 2**attempt))
    finally:
        renewing.cancel()
        polling.cancel()
        await asyncio.wait({renewing, polling})
        main.delete_message = real_delete
        await p.client(p.physical(sub.queue)).delete_queue()
        await p.client(p.poison_name(sub.queue)).delete_queue()
    assert others == []
    assert not a.refused
