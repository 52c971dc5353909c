"""Storage Queues: another producer's envelope of 48-64 KiB of plain text (the v12 SDK's default, no
encoding). The kit reads it, but every copy it sent was base64, a third larger: over 64 KiB, refused
(413) on every try, so a deferral (not due yet, paused, a retry by copy) never went out; the message
came back with its dequeue count raised until the attempts guard dead-lettered it unrun, with a reason
that was not the cause. Its copy is now sent as plain text; one too large for that as well is
dead-lettered on receipt, with the reason said."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from azure.storage.queue.aio import QueueClient

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.clock import utcnow
from queueing_core.providers.storage_queue import (
    MAX_WIRE_BYTES,
    StorageConnection,
    StorageQueueProvider,
    wire_text,
)
from queueing_core.runtime import Runtime
from tests.contract.harness import running, wait_until


@queue("plain.big", max_attempts=2, lease_duration=timedelta(seconds=2))
class Big(QueueMessage):
    pad: str


async def _runtime(azurite: Any, ran: list[int]) -> Runtime:
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("plain", naming=QueueNaming(prefix=f"p{tag}-"))

    @app.handler()
    async def handle(msg: Big) -> None:
        ran.append(len(msg.pad))

    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"pc{tag}", tracker_table=f"ph{tag}"
    )
    rt = Runtime(app, provider)
    await rt.open()
    return rt


async def _drop(rt: Runtime) -> None:
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    for name in (p.physical("plain.big"), p.poison_name("plain.big")):
        await p.client(name).delete_queue()
    await rt.close()


async def _send_plain(azurite: Any, p: StorageQueueProvider, text: str) -> None:
    """As another producer: the text as it is, no base64."""
    async with QueueClient.from_connection_string(azurite.connection_string, p.physical("plain.big")) as c:
        await c.send_message(text)


async def test_a_large_plain_envelope_not_yet_due_is_copied_and_runs_when_due(azurite):
    ran: list[int] = []
    rt = await _runtime(azurite, ran)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        env = rt.app.producer.envelope_for(Big(pad="x" * 54_000))
        env = env.model_copy(update={"not_before": utcnow() + timedelta(seconds=4)})
        text = env.encode_text()
        assert 48 * 1024 < len(text.encode()) < MAX_WIRE_BYTES  # too large for base64, not for plain text
        await _send_plain(azurite, p, text)
        async with running(rt):
            await wait_until(lambda: ran, timeout=25, what="the run once due")
            await wait_until(
                lambda: _status(rt, env.message_id, MessageStatus.SUCCEEDED), timeout=10, what="Succeeded"
            )
        assert ran == [54_000]
        rec = await rt.tracker.get(env.message_id)
        assert rec is not None
        # its wait was a copy that used no attempt (each refused copy left it to come back, one used)
        assert rec.attempt == 1, f"ran at attempt {rec.attempt}: its wait used attempts"
        assert await p.depth("plain.big", poison=True) == 0
    finally:
        await _drop(rt)


async def test_a_plain_envelope_too_large_for_any_copy_is_dead_lettered_with_its_reason(azurite):
    ran: list[int] = []
    rt = await _runtime(azurite, ran)
    p = rt.provider
    assert isinstance(p, StorageQueueProvider)
    try:
        # at the limit, its ninth attempt used: a copy carries ten or more, a digit longer than it
        env = rt.app.producer.envelope_for(Big(pad="")).with_attempt(9)
        room = MAX_WIRE_BYTES - len(env.encode_text().encode())
        env = env.model_copy(update={"body": {"pad": "x" * room}})
        text = env.encode_text()
        assert len(text.encode()) == MAX_WIRE_BYTES
        await _send_plain(azurite, p, text)
        async with running(rt):
            await wait_until(
                lambda: _status(rt, env.message_id, MessageStatus.DEAD_LETTERED),
                timeout=20,
                what="DeadLettered",
            )
        assert ran == []
        rec = await rt.tracker.get(env.message_id)
        assert rec is not None
        assert rec.attempt <= 10, "it came back and used attempts before it was dead-lettered"
        assert "does not fit in a queue message" in (rec.description or "")
        assert await p.depth("plain.big", poison=True) == 1
    finally:
        await _drop(rt)


async def _status(rt: Runtime, message_id: uuid.UUID, want: MessageStatus) -> bool:
    rec = await rt.tracker.get(message_id)
    return rec is not None and rec.status == want


def test_plain_text_is_sent_only_where_the_service_keeps_it_unchanged():
    big = "x" * (50 * 1024)
    assert wire_text("{}") == "e30="  # base64 whenever it fits
    assert wire_text(big) == big
    assert wire_text(big + "\x01") is None  # no place in XML text
    assert wire_text(big + "\r") is None  # the XML parser would turn it into a LF
    assert wire_text("x" * (MAX_WIRE_BYTES + 1)) is None


def test_an_envelope_whose_copies_fit_is_not_refused_for_a_copy_it_never_sends():
    """The check on receipt sized a copy with a due time and six more attempt digits than any copy
    within the visibility limit carries, and dead-lettered, unrun, envelopes up to about 40 bytes under
    the limit whose copies fit (found in review). A copy for later than the limit that does not fit with
    its due time goes without it (it shows after 7 days, early, rather than never)."""
    from queueing_core.envelope import Envelope
    from queueing_core.providers.storage_queue import copy_for_later, too_large_to_copy

    mid = uuid.uuid4()
    env = Envelope(
        type="Big", queue="plain.big", body={"pad": ""}, message_id=mid, tracking_id=mid, created_at=utcnow()
    )
    room = MAX_WIRE_BYTES - len(env.encode_text().encode()) - 20  # 20 bytes under the limit
    env = env.model_copy(update={"body": {"pad": "x" * room}})
    text = env.encode_text()
    assert too_large_to_copy(env, text, attempt=1) is None
    now = env.created_at
    later = copy_for_later(env.with_attempt(1), now + timedelta(days=10), now)
    assert wire_text(later.encode_text()) is not None
    assert later.not_before is None  # (no room for it)
