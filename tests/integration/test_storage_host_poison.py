"""Letters the Azure Functions host moves to ``<queue>-poison`` itself, on Azurite.

After ``maxDequeueCount`` invocations that all failed in the kit (its Tables unreachable, say), the
host's queue extension copies the message to ``<queue>-poison`` (``SendMessageAsync(body)``: no
time-to-live, so the service's default of 7 days) and deletes the original; the history still shows
the last run the kit recorded (Failed, with its retry's due time). Left so, the letter vanished after
7 days and the history, not DeadLettered, was pruned too; an operator's retry refused it as "hidden
in its queue". The maintenance pass keeps such letters for good and records them DeadLettered; an
operator's retry finds them in the poison queue whatever the history says.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import azure.functions.queue as azq
import pytest
from azure.functions.timer import TimerRequest
from azure.storage.queue.aio import QueueClient

from functions import build_app
from functions.host import FunctionsHost
from queueing_core import QueueingApp, QueueMessage, Retry, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import REASON
from queueing_core.errors import InvalidOperation, ProviderUnavailable
from queueing_core.ops.service import OpsService
from queueing_core.runtime import Runtime
from tests.functions.conftest import functions_of, storage_settings


@queue("host-poison", max_attempts=3)
class HostPoisoned(QueueMessage):
    n: int = 0


@dataclass
class Moved:
    rt: Runtime
    message_id: uuid.UUID
    queue: QueueClient
    poison: QueueClient
    #: the Functions app's functions, by name
    fns: dict[str, Any]


def never_expires(letter: Any) -> bool:
    """Sent without a time-to-live: the service (and Azurite) report 9999-12-31 as its expiry."""
    return letter.expires_on.year == 9999


def _text(content: str) -> dict[str, Any]:
    return json.loads(base64.b64decode(content))


@pytest.fixture
async def host_moved(azurite: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Moved]:
    """A message whose first invocation failed (history: Failed, a retry due), then moved to the
    poison queue by the host exactly as its queue extension does, after its dequeue limit."""
    cfg = storage_settings(azurite, monkeypatch)
    app = QueueingApp("host-poison")

    @app.handler()
    async def handle(msg: HostPoisoned) -> None:
        raise Retry(after=timedelta(0), reason="not yet")

    host = FunctionsHost(app, cfg)
    fns = functions_of(build_app(cfg, app, host=host))
    on_message = fns["queue_host_poison"].get_user_function()
    rt = await host.runtime()
    name = rt.provider.physical("host-poison")  # type: ignore[attr-defined]
    client = QueueClient.from_connection_string(azurite.connection_string, name)
    poison = QueueClient.from_connection_string(azurite.connection_string, f"{name}-poison")
    try:
        sent = await app.enqueue(HostPoisoned())
        # invocation 1: the handler asks for a retry; the kit sends a copy and returns, the host deletes
        [m] = [m async for m in client.receive_messages(max_messages=1, visibility_timeout=30)]
        await on_message(
            azq.QueueMessage(
                id=m.id,
                body=m.content.encode(),
                dequeue_count=m.dequeue_count,
                pop_receipt=m.pop_receipt,
                insertion_time=m.inserted_on,
            )
        )
        await client.delete_message(m.id, m.pop_receipt)
        assert (await rt.tracker.get(sent.message_id)).status == "Failed"  # type: ignore[union-attr]
        # the copy's invocations all fail in the kit; at the dequeue limit the host moves it
        copies = [c async for c in client.receive_messages(max_messages=5, visibility_timeout=30)]
        assert len(copies) == 1
        [c] = copies
        await poison.send_message(c.content)  # AddMessageAndCreateIfNotExistsAsync: no time-to-live
        await client.delete_message(c.id, c.pop_receipt)
        [letter] = await poison.peek_messages(max_messages=5)
        assert not never_expires(letter)  # the service's default: it would be gone in 7 days
        yield Moved(rt, sent.message_id, client, poison, fns)
    finally:
        await client.close()
        await poison.close()
        await rt.close()


async def test_the_maintenance_pass_keeps_a_host_moved_letter_for_good_and_records_it(host_moved: Moved):
    rt, mid, poison = host_moved.rt, host_moved.message_id, host_moved.poison
    # a letter without a time-to-live (as the kit sends its own) beside it: passed over, left as it is
    kits = await poison.send_message(
        base64.b64encode(json.dumps({"message_id": str(uuid.uuid4())}).encode()).decode(), time_to_live=-1
    )

    # the Functions app's retention timer (hourly by default) runs the pass
    await host_moved.fns["queueing_retention"].get_user_function()(TimerRequest(past_due=False))

    letters = await poison.peek_messages(max_messages=32)
    assert kits.id in {m.id for m in letters}  # handed back: visible at once, not left hidden
    [kept] = [m for m in letters if m.id != kits.id]
    assert never_expires(kept)
    env = _text(kept.content)
    assert env["message_id"] == str(mid)
    assert env["headers"][REASON] == "max-attempts-exceeded"
    rec = await rt.tracker.get(mid)
    assert rec is not None
    assert rec.status == "DeadLettered"
    assert "moved to the poison queue by the Functions host" in (rec.description or "")
    assert rec.status in rt.provider.capabilities.dead_letters_kept  # never pruned now

    # a later pass finds nothing left to keep, and changes nothing
    rt.provider._host_letters_at = None  # type: ignore[attr-defined]  # (a pass is once per 30 minutes)
    assert (await rt.provider.maintain(rt.app))["host_letters_kept"] == 0  # type: ignore[attr-defined]
    assert {m.id for m in await poison.peek_messages(max_messages=32)} == {kits.id, kept.id}


async def test_a_pass_whose_history_write_fails_leaves_the_letter_for_the_next(
    host_moved: Moved, monkeypatch: pytest.MonkeyPatch
):
    rt, poison = host_moved.rt, host_moved.poison
    provider: Any = rt.provider
    tracker = provider.tracker()

    async def refused(records: Any) -> None:
        raise ProviderUnavailable("Tables unreachable")

    with monkeypatch.context() as patched:
        patched.setattr(tracker, "upsert", refused)
        with pytest.raises(ProviderUnavailable):
            await provider.maintain(rt.app)
    # nothing copied, and the letter handed back: as it was, for the next pass
    [letter] = await poison.peek_messages(max_messages=5)
    assert not never_expires(letter)

    assert (await provider.maintain(rt.app))["host_letters_kept"] == 1
    [kept] = await poison.peek_messages(max_messages=5)
    assert never_expires(kept)
    assert (await rt.tracker.get(host_moved.message_id)).status == "DeadLettered"  # type: ignore[union-attr]


async def test_an_operator_retry_finds_a_host_moved_letter_whose_history_says_failed(host_moved: Moved):
    rt, mid = host_moved.rt, host_moved.message_id
    assert (await rt.tracker.get(mid)).status == "Failed"  # type: ignore[union-attr]

    result = await OpsService(rt).retry(mid)

    assert result.status == "Pending"
    assert await host_moved.poison.peek_messages(max_messages=5) == []  # the letter left it
    [copy] = await host_moved.queue.peek_messages(max_messages=5)
    assert _text(copy.content)["message_id"] == str(mid)
    assert never_expires(copy)
    rec = await rt.tracker.get(mid)
    assert rec is not None
    assert (rec.status, rec.attempt) == ("Pending", 0)


async def test_a_failed_message_not_in_the_poison_queue_is_still_refused(host_moved: Moved):
    # the letter back in its queue (as if never moved): it waits there, hidden until its retry is due
    [letter] = [m async for m in host_moved.poison.receive_messages(max_messages=1, visibility_timeout=30)]
    await host_moved.queue.send_message(letter.content, visibility_timeout=300, time_to_live=-1)
    await host_moved.poison.delete_message(letter.id, letter.pop_receipt)

    with pytest.raises(InvalidOperation, match="hidden in its queue"):
        await OpsService(host_moved.rt).retry(host_moved.message_id)


async def test_a_failed_message_still_waiting_for_its_retry_is_refused_without_a_look(
    host_moved: Moved, monkeypatch: pytest.MonkeyPatch
):
    """The host moves a message only once its copy became visible: one whose retry is not due yet
    waits in its queue. Its retry was refused after a read of the whole poison queue, every letter
    hidden meanwhile (a dashboard's bulk retry paid it once for each; found in review)."""
    rt: Any = host_moved.rt
    rec = await rt.tracker.get(host_moved.message_id)
    await rt.tracker.reopen(rec.model_copy(update={"not_before": utcnow() + timedelta(hours=1)}))
    looked: list[Any] = []

    async def look(*args: Any, **kwargs: Any) -> set[str]:
        looked.append(args)
        return set()

    monkeypatch.setattr(rt.provider, "_dead_letters", look)

    with pytest.raises(InvalidOperation, match="hidden in its queue"):
        await OpsService(rt).retry(host_moved.message_id)
    assert looked == []


async def test_a_letter_whose_message_finished_is_left_to_its_time_to_live(host_moved: Moved):
    """A message whose history says it succeeded (its host failed after recording it, say) and that
    the host moved all the same: the letter is a leftover, not a dead letter. Recorded DeadLettered,
    its outcome and result were overwritten (found in review)."""
    rt: Any = host_moved.rt
    rec = await rt.tracker.get(host_moved.message_id)
    await rt.tracker.reopen(rec.model_copy(update={"status": "Succeeded", "result": {"invoice": 42}}))

    assert (await rt.provider.maintain(rt.app))["host_letters_kept"] == 0
    [letter] = await host_moved.poison.peek_messages(max_messages=5)
    assert not never_expires(letter)  # left as the host sent it
    after = await rt.tracker.get(host_moved.message_id)
    assert (after.status, after.result) == ("Succeeded", {"invoice": 42})


async def test_a_letter_whose_first_keeping_failed_after_its_history_is_kept_by_the_next_look(
    host_moved: Moved, monkeypatch: pytest.MonkeyPatch
):
    """A look wrote the history DeadLettered, then its copy failed (Storage away a moment): the next
    look took that record, newer than the letter, for the message having moved on, and left the
    letter to expire while the history listed it for good (found in review)."""
    from queueing_core.providers import storage_queue

    rt: Any = host_moved.rt
    provider = rt.provider
    real = provider.dead_letter

    async def refused(*args: Any, **kwargs: Any) -> None:
        raise ProviderUnavailable("Storage away a moment")

    with monkeypatch.context() as patched:
        patched.setattr(provider, "dead_letter", refused)
        with pytest.raises(ProviderUnavailable):
            await provider.maintain(rt.app)
    assert provider.dead_letter == real
    assert (await rt.tracker.get(host_moved.message_id)).status == "DeadLettered"
    [letter] = await host_moved.poison.peek_messages(max_messages=5)
    assert not never_expires(letter)

    # (the next look long after: the first look's record is newer than the letter by more than the slack)
    monkeypatch.setattr(storage_queue, "CLOCKS_APART", timedelta(seconds=-60))
    assert (await provider.maintain(rt.app))["host_letters_kept"] == 1
    [kept] = await host_moved.poison.peek_messages(max_messages=5)
    assert never_expires(kept)
