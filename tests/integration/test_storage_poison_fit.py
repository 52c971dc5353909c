"""Storage Queues: a dead-letter copy always fits in one queue message (64 KiB of base64), and a
malformed one is found by the id its history gives it. Before (found in review): a copy over the limit
was refused (413), every settlement of the message failed, and it came back and ran again for ever;
and the wrapper of a body that is not an envelope carried no id, so a purge of it deleted its history
and left the letter in the poison queue for good."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.connections import StorageConnection
from queueing_core.decisions import DeadLetter, DeadLetterReason
from queueing_core.envelope import DESCRIPTION, REASON, Envelope, malformed_id
from queueing_core.errors import MessageTooLarge
from queueing_core.ops import OpsService
from queueing_core.providers.storage_queue import MAX_TEXT_BYTES, StorageQueueProvider, poison_text
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from queueing_core.transport import Delivery
from tests.contract.harness import running, wait_until


@queue("Fit.Big", max_attempts=3, lease_duration=timedelta(seconds=5))
class Big(QueueMessage):
    blob: str


def _runtime(azurite, runs: list[int]) -> Runtime:
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("fit", naming=QueueNaming(prefix=f"f{tag}-"))

    @app.handler()
    async def handle(msg: Big) -> None:
        runs.append(1)
        raise NonRetryableError("bad invoice: " + "é" * 4000)

    provider = StorageQueueProvider(
        StorageConnection(azurite.connection_string), control_table=f"ctl{tag}", tracker_table=f"hist{tag}"
    )
    return Runtime(app, provider)


async def _letters(rt: Runtime) -> list[str]:
    p = rt.provider
    poison = await p._ensure(p.poison_name("Fit.Big"))
    return [base64.b64decode(m.content).decode() for m in await poison.peek_messages(max_messages=32)]


async def _cleanup(rt: Runtime) -> None:
    p = rt.provider
    for name in (p.physical("Fit.Big"), p.poison_name("Fit.Big")):
        await p.client(name).delete_queue()
    await rt.close()


async def test_a_large_envelope_with_a_long_reason_is_dead_lettered_once_with_its_body_whole(azurite):
    runs: list[int] = []
    rt = _runtime(azurite, runs)
    await rt.open()
    try:
        sent = await rt.app.enqueue(Big(blob="x" * (46 * 1024)))  # under the envelope limit
        async with running(rt):
            await wait_until(lambda: rt.provider.depth("Fit.Big", poison=True), what="the dead letter")
        [letter] = await _letters(rt)
        env = Envelope.decode(letter)
        assert env.message_id == sent.message_id
        assert env.body["blob"] == "x" * (46 * 1024)
        assert env.headers[REASON] == DeadLetterReason.NON_RETRYABLE.value
        description = env.headers[DESCRIPTION]
        assert description.startswith("NonRetryableError: bad invoice: é")
        assert len(description) < 4000  # cut to fit
        assert runs == [1]
        assert await rt.provider.depth("Fit.Big") == 0
    finally:
        await _cleanup(rt)


async def test_a_malformed_body_near_the_limit_is_dead_lettered_cut_and_purged_by_its_id(azurite):
    rt = _runtime(azurite, [])
    await rt.open()
    p = rt.provider
    try:
        raw = "not an envelope! " * 2900  # ~49 KB of text: a message the service takes, not base64
        live = await p._ensure(p.physical("Fit.Big"))
        await live.send_message(raw)
        mid = malformed_id(raw)
        async with running(rt):
            await wait_until(lambda: p.depth("Fit.Big", poison=True), what="the dead letter")
        [letter] = await _letters(rt)
        wrapper = json.loads(letter)
        assert wrapper["message_id"] == str(mid)
        assert wrapper["raw_truncated"] is True
        assert wrapper["raw_length"] == len(raw)
        assert wrapper["raw_sha256"] == hashlib.sha256(raw.encode()).hexdigest()
        assert raw.startswith(wrapper["raw"])
        record = await rt.tracker.get(mid)
        assert record is not None
        assert record.status == MessageStatus.DEAD_LETTERED
        # the purge finds the letter by that id: the letter and its history go together
        purged = await OpsService(rt).purge(MessageQuery(queue="Fit.Big", status=("DeadLettered",)))
        assert purged.deleted == 1
        assert await p.depth("Fit.Big", poison=True) == 0
        assert await rt.tracker.get(mid) is None
    finally:
        await _cleanup(rt)


@pytest.mark.parametrize("size", [0, 1000, 30_000, 47_000, 48 * 1024, 64 * 1024])
@pytest.mark.parametrize("text", ["plain", "escaped"])
def test_a_poison_copy_never_exceeds_one_queue_message(size, text):
    now = datetime.now(UTC)
    decision = DeadLetter(DeadLetterReason.MALFORMED_ENVELOPE, "why: " + "\u0001é" * 4000)
    body = ("a" if text == "plain" else '\u0001"é') * size
    d = Delivery.of(body, queue="fit")
    out = poison_text(d, decision, now)
    assert len(out.encode()) <= MAX_TEXT_BYTES
    assert json.loads(out)["message_id"] == str(malformed_id(body))


async def test_an_envelope_without_room_for_its_dead_letter_marks_is_refused_at_enqueue(azurite):
    rt = _runtime(azurite, [])
    await rt.open()
    try:
        with pytest.raises(MessageTooLarge):
            await rt.app.enqueue(Big(blob="x" * (MAX_TEXT_BYTES - 200)))
    finally:
        await _cleanup(rt)


def test_a_poison_copy_of_a_message_of_wide_characters_ends_and_fits():
    """Characters beyond the BMP were written as 12-byte escapes, so a wrapper with an empty text
    could still be too large and the cut never ended, on the event loop (found in review)."""
    emoji = "\U0001f600"
    raw = json.dumps({"v": emoji * 4100, "type": emoji * 256}, ensure_ascii=False)
    assert len(raw.encode()) <= MAX_TEXT_BYTES  # a message the queue holds
    d = Delivery.of(raw, queue="fit")
    assert d.malformed is not None
    decision = DeadLetter(DeadLetterReason.MALFORMED_ENVELOPE, d.malformed.reason)
    out = poison_text(d, decision, datetime.now(UTC))
    assert len(out.encode()) <= MAX_TEXT_BYTES
    assert json.loads(out)["message_id"] == str(malformed_id(raw))


async def test_a_malformed_letter_an_older_version_wrapped_without_an_id_is_found_by_its_text(azurite):
    rt = _runtime(azurite, [])
    await rt.open()
    p = rt.provider
    try:
        raw = "not an envelope, from before"
        old = {"dead_letter": {"reason": "malformed-envelope", "description": "?", "at": "x"}, "raw": raw}
        poison = await p._ensure(p.poison_name("Fit.Big"))
        await poison.send_message(base64.b64encode(json.dumps(old).encode()).decode(), time_to_live=-1)
        mid = malformed_id(raw)
        assert await p._dead_letters("Fit.Big", {str(mid)}, remove=False) == {str(mid)}
        assert await p._dead_letters("Fit.Big", {str(mid)}) == {str(mid)}
        assert await p.depth("Fit.Big", poison=True) == 0
    finally:
        await _cleanup(rt)
