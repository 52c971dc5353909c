"""Storage Queues: a delay a run asks for beyond the 7-day visibility limit (a handler returning a due
time 10 days ahead, or ``Retry(after=10 days)``). The service shows the message when the limit ends;
before, nothing on it said when it was due, so it ran then, early. Now the copy carries its due time
(``not_before``): an early arrival is hidden again until it is due, and with the delayed store the
copy waits there instead. The end-to-end cases scale the service's limit down to 3 s (the same code
paths on a clock free of days)."""

from __future__ import annotations

import base64
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, QueueNaming, Retry, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import Envelope
from queueing_core.providers import storage_queue
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until

WEEK = 7 * 24 * 3600


@queue("long.delay")
class Job(QueueMessage):
    n: int
    how: str  # "sleep" (return a later time) or "retry" (raise Retry(after=...))


def _make(azurite: Any, later: timedelta, runs: list[float], **provider_kw: Any) -> Runtime:
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("long", naming=QueueNaming(prefix=f"d{tag}-"))

    @app.handler()
    async def handle(msg: Job) -> Any:
        runs.append(time.monotonic())
        if len(runs) == 1:
            if msg.how == "sleep":
                return utcnow() + later
            raise Retry(after=later)
        return None

    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string),
        control_table=f"dc{tag}",
        tracker_table=f"dh{tag}",
        **provider_kw,
    )
    return Runtime(app, provider)


async def _drop(rt: Runtime) -> None:
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    for name in (p.physical("long.delay"), p.poison_name("long.delay")):
        await p.client(name).delete_queue()
    await rt.close()


def _spy_sends(p: StorageQueueProvider) -> list[tuple[str, dict[str, Any]]]:
    client = p.client(p.physical("long.delay"))
    real = client.send_message
    sent: list[tuple[str, dict[str, Any]]] = []

    async def send_message(content: str, **kwargs: Any) -> Any:
        sent.append((content, kwargs))
        return await real(content, **kwargs)

    client.send_message = send_message  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("how", ["sleep", "retry"])
async def test_a_run_asking_for_ten_days_sends_a_copy_that_carries_its_due_time(azurite, how):
    runs: list[float] = []
    rt = _make(azurite, timedelta(days=10), runs)
    await rt.open()
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        sent = _spy_sends(p)
        await rt.app.enqueue(Job(n=1, how=how))
        sub = rt.app.subscription(Job.type_name())
        assert sub is not None
        [d] = await p.receive(sub, 1)
        s = await rt.process(d)
        asked = utcnow() + timedelta(days=10)
        await p.settle([s])
        assert not d.refused
        content, kwargs = sent[-1]
        copy = Envelope.decode(base64.b64decode(content).decode())
        assert kwargs["visibility_timeout"] == WEEK  # as long as the service hides a message
        assert copy.not_before is not None, "the copy shown after 7 days carries no due time: it runs early"
        assert abs((copy.not_before - asked).total_seconds()) < 60
        # a retry's attempt is counted in the copy (a fresh copy's dequeue count starts again)
        assert copy.attempt == (1 if how == "retry" else 0)
        assert await p.depth("long.delay") == 1  # the copy alone: the original is deleted
    finally:
        await _drop(rt)


@pytest.mark.parametrize("how", ["sleep", "retry"])
async def test_scaled_a_run_asking_for_longer_than_the_limit_runs_when_due(azurite, monkeypatch, how):
    monkeypatch.setattr(storage_queue, "MAX_VISIBILITY", timedelta(seconds=3))
    runs: list[float] = []
    rt = _make(azurite, timedelta(seconds=9), runs)  # 9 s against 3, as 10 days against 7
    await rt.open()
    try:
        await rt.app.enqueue(Job(n=2, how=how))
        async with running(rt):
            await wait_until(lambda: len(runs) >= 2, timeout=30, what="the second run")
        gap = runs[1] - runs[0]
        assert gap >= 8.5, f"asked for 9 s (the limit 3 s), ran again after {gap:.1f} s"
    finally:
        await _drop(rt)


async def test_with_the_delayed_store_a_ten_day_retry_waits_there(azurite, tmp_path: Path):
    """A retry's delay beyond the limit was a re-hide cut to 7 days, never in the delayed store."""
    from queueing_core.providers.sql.history import SideStores

    runs: list[float] = []
    rt = _make(
        azurite,
        timedelta(days=10),
        runs,
        delayed_stores=SideStores(f"sqlite:///{tmp_path / 'delayed.db'}"),
    )
    await rt.open()
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        await rt.app.enqueue(Job(n=3, how="retry"))
        sub = rt.app.subscription(Job.type_name())
        assert sub is not None
        [d] = await p.receive(sub, 1)
        s = await rt.process(d)
        await p.settle([s])
        assert not d.refused
        assert p.delayed is not None
        assert await p.delayed.counts() == {p.physical("long.delay"): 1}
        assert await p.depth("long.delay") == 0
    finally:
        await _drop(rt)


async def test_the_functions_host_sends_the_copy_with_its_due_time(azurite):
    from functions.host import settle_storage

    runs: list[float] = []
    rt = _make(azurite, timedelta(days=10), runs)
    await rt.open()
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        sent = _spy_sends(p)
        await rt.app.enqueue(Job(n=4, how="retry"))
        sub = rt.app.subscription(Job.type_name())
        assert sub is not None
        [d] = await p.receive(sub, 1)
        s = await rt.process(d)
        await settle_storage(p, s)
        content, kwargs = sent[-1]
        copy = Envelope.decode(base64.b64decode(content).decode())
        assert kwargs["visibility_timeout"] == WEEK
        assert copy.not_before is not None, "the Functions host's copy carries no due time: it runs early"
        assert copy.attempt == 1
    finally:
        await _drop(rt)
