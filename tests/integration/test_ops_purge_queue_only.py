"""A purge filtered only by its queue leaves what a worker holds; emptying the queue whole is asked for.

A purge whose only filter was the queue emptied the transport's queue whole: on SQS a PurgeQueue,
which deletes the messages workers hold with the rest (their runs' outcomes then refused), while the
dashboard's confirmation said "Messages a worker holds are left alone", the CLI "never those a worker
holds", and the HTTP API's page that the whole queue goes only with ``all=true``. Now the queue is
emptied whole only when asked for: ``all=true`` with the queue alone, ``queueing purge --queue Q
--all``, the dashboard's own "Empty queue" button. (On moto's SQS, whose PurgeQueue takes in-flight
messages as SQS's does.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest

import tests.contract.harness  # noqa: F401  (first: it imports harness_sqs itself)
from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client, running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.integration.test_ops_cli import cli  # noqa: F401  (the fixture)
from tests.services import fresh_prefix

QUEUE = "Purge.QueueOnly"


@queue(QUEUE, lease_duration=timedelta(seconds=20))
class Held(QueueMessage):
    n: int


@dataclass
class HeldRun:
    rt: Runtime
    provider: SqsProvider
    client: httpx.AsyncClient
    message_id: Any
    go: asyncio.Event
    runs: list[int]

    async def status(self) -> str | None:
        rec = await self.rt.tracker.get(self.message_id)
        return rec.status if rec is not None else None

    async def depth(self) -> int:
        return sum((await self.provider.depth(QUEUE)).values())


@contextlib.asynccontextmanager
async def _a_held_run(tmp_path: Any) -> AsyncIterator[HeldRun]:
    """A message a worker holds (its handler waits for ``go``), with the ops API over it; the worker
    stops (its run settled) before the context ends."""
    prefix = fresh_prefix()
    sqs = sqs_client()
    app = QueueingApp("queue-only", naming=QueueNaming(prefix=prefix))
    started, go = asyncio.Event(), asyncio.Event()
    runs: list[int] = []

    async def handle(msg: Held, ctx: Any) -> None:
        runs.append(ctx.attempt)
        await ctx.report_progress(1, 2, "started")
        started.set()
        await go.wait()

    app.handler(Held)(handle)
    provider = SqsProvider(sqs, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    await rt.open()
    try:
        r = await app.enqueue(Held(n=1))
        async with running(rt), ops_client(rt) as client:
            held = HeldRun(rt, provider, client, r.message_id, go, runs)
            await asyncio.wait_for(started.wait(), 20)
            await wait_until(
                lambda: _is(held, MessageStatus.LEASED.value), what="the run's progress recorded"
            )
            try:
                yield held
            finally:
                go.set()  # (the worker's shutdown waits for the run)
    finally:
        await rt.close()
        for url in sqs.list_queues(QueueNamePrefix=prefix).get("QueueUrls", []):
            sqs.delete_queue(QueueUrl=url)


async def _is(held: HeldRun, status: str) -> bool:
    return await held.status() == status


async def _purge(held: HeldRun, way: str, *, whole: bool) -> dict[str, Any]:
    """Purge the queue the way an operator would; the counts of the answer."""
    if way == "api":
        res = await held.client.delete(
            "/messages", params={"queue": QUEUE, **({"all": "true"} if whole else {})}
        )
        assert res.status_code == 200, res.text
        return dict(res.json())
    form = {"queue": QUEUE, "action": "purge", "step": "confirm"}
    confirm = (await held.client.post("/ui/bulk", data=form)).text
    count = re.search(r"Delete <strong>(\d+)</strong>", confirm)
    assert count is not None, confirm
    # the confirmation says what each button does: the purge leaves held ones, emptying takes them
    assert "Messages a worker holds are left alone" in confirm, confirm
    assert 'id="bulk-empty" name="whole" value="true"' in confirm, confirm
    assert "and so do <strong>the messages a worker holds</strong>" in confirm, confirm
    selection = re.search(r'name="selection" value="([^"]*)"', confirm)
    assert selection is not None, confirm
    run = {
        **form,
        "step": "run",
        "expected": count.group(1),
        "selection": selection.group(1),
        **({"whole": "true"} if whole else {}),
    }
    done = (await held.client.post("/ui/bulk", data=run)).text
    found = re.search(r"[Dd]eleted (\d+) message\(s\)(?:; (\d+) held by a worker)?", done)
    assert found is not None, done
    assert ("Emptied queue " + QUEUE in done) == whole, done
    return {"deleted": int(found.group(1)), "skipped_leased": int(found.group(2) or 0)}


@pytest.mark.parametrize("way", ["api", "dashboard"])
async def test_a_purge_of_a_queue_alone_leaves_the_message_a_worker_holds(tmp_path, way) -> None:
    async with _a_held_run(tmp_path) as held:
        done = await _purge(held, way, whole=False)
        assert (done["deleted"], done["skipped_leased"]) == (0, 1), done
        assert await held.depth() == 1  # SQS still holds it for its worker
        assert await held.status() == MessageStatus.LEASED.value
        held.go.set()
        # the run's outcome applies: its completion is taken, and recorded
        await wait_until(lambda: _is(held, MessageStatus.SUCCEEDED.value), what="the run's success")
        assert held.runs == [1]
        assert await held.depth() == 0


@pytest.mark.parametrize("way", ["api", "dashboard"])
async def test_emptying_the_queue_whole_is_asked_for_and_takes_the_held_message(tmp_path, way) -> None:
    async with _a_held_run(tmp_path) as held:
        done = await _purge(held, way, whole=True)
        assert (done["deleted"], done["skipped_leased"]) == (1, 0), done
        assert await held.depth() == 0
        assert await held.status() is None


async def test_all_with_another_filter_than_the_queue_is_refused(tmp_path) -> None:
    async with _a_held_run(tmp_path) as held:
        res = await held.client.delete(
            "/messages", params={"queue": QUEUE, "status": "Pending", "all": "true"}
        )
        assert res.status_code == 422, res.text
        assert "queue alone" in res.text
        assert await held.depth() == 1


def test_the_cli_asks_to_empty_a_queue_whole_only_with_all(cli) -> None:  # noqa: F811
    assert cli("enqueue", "OrderPlaced", "--example").returncode == 0
    plain = cli("purge", "--queue", "order-placed", stdin="n\n")
    assert "delete the messages with queue order-placed (never those a worker holds)?" in plain.stdout
    whole = cli("purge", "--queue", "order-placed", "--all", stdin="n\n")
    assert whole.returncode == 1, whole.stdout + whole.stderr
    assert "empty queue order-placed whole" in whole.stdout, whole.stdout
    mixed = cli("purge", "--queue", "order-placed", "--status", "Pending", "--all", "--yes")
    assert mixed.returncode == 2, mixed.stdout + mixed.stderr
    assert "--queue alone" in mixed.stderr
    assert cli("purge", "--queue", "order-placed", "--all", "--yes").returncode == 0
    assert json.loads(cli("stats", "--json").stdout)["order-placed"] == {}
