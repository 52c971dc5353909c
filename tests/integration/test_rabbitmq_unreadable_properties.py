"""A message whose AMQP properties the client library cannot decode, on the real broker: a message id or
a header name that is not UTF-8 (AMQP's short strings are octets, and the broker passes them on), a
timestamp in microseconds (Go's ``time.UnixMicro``) and a header table nested hundreds deep. Each one
raised in the connection's frame reader: the whole connection closed and reconnected, the broker
delivered the message again, and so for ever. The queue behind it stopped, the runs in flight on that
connection ran again, and an operator's scan of a dead-letter queue holding one lost its connection
(found in review). Now each reaches the worker, which dead-letters it as malformed, its body kept."""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import aio_pika
import pamqp.frame
import pytest

from queueing_core import MessageStatus
from queueing_core.envelope import DESCRIPTION, REASON
from queueing_core.ops import OpsService
from queueing_core.producer import build_envelope
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, running, wait_until
from tests.integration.test_rabbitmq import Invoice, downstream, make, physical, take_all
from tests.services import RABBITMQ_URL, require

SENT_ID = "ZZZZ-UNREADABLE-ZZZZ"
SENT_TS = datetime(2001, 9, 9, 1, 46, 40, tzinfo=UTC)  # 1,000,000,000 s
#: deeper than the interpreter's stack lets a recursive decoder go (each level is two calls)
NESTED = 600


@pytest.fixture(autouse=True)
def _broker() -> None:
    require("RabbitMQ", "127.0.0.1", 5672)


@contextlib.contextmanager
def rewritten(old: bytes, new: bytes) -> Iterator[None]:
    """Frames marshalled meanwhile carry ``new`` where they had ``old`` (as long): what another AMQP
    client (a Go or Java publisher) puts on the wire, which this one would refuse to write."""
    real = pamqp.frame.marshal

    def marshal(frame: Any, channel_id: int) -> bytes:
        return real(frame, channel_id).replace(old, new)

    pamqp.frame.marshal = marshal
    try:
        yield
    finally:
        pamqp.frame.marshal = real


def _nested() -> dict[str, Any]:
    table: dict[str, Any] = {"leaf": 1}
    for _ in range(NESTED):
        table = {"k": table}
    return table


#: the property damaged, the properties sent, the bytes sent for them and those put on the wire, and
#: what the dead letter's description names
CASES: dict[str, tuple[dict[str, Any], bytes, bytes, str]] = {
    "message_id": (dict(message_id=SENT_ID), SENT_ID.encode(), b"\xff" * len(SENT_ID), "message_id"),
    "timestamp": (
        dict(timestamp=SENT_TS),
        struct.pack(">Q", 1_000_000_000),
        struct.pack(">Q", 1_700_000_000_000_000),
        "timestamp",
    ),
    "header_name": (dict(headers={SENT_ID: 1}), SENT_ID.encode(), b"\xfe" * len(SENT_ID), "header name"),
    "nested_headers": (dict(headers={"deep": _nested()}), b"", b"", "nested"),
}


async def publish_damaged(name: str, case: str, body: bytes) -> None:
    props, old, new, _ = CASES[case]
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()  # publisher confirms: the broker took it
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20 * NESTED))  # (this client encodes tables recursively)
        try:
            with rewritten(old, new) if old else contextlib.nullcontext():
                await channel.default_exchange.publish(aio_pika.Message(body, **props), routing_key=name)
        finally:
            sys.setrecursionlimit(limit)


async def delete_queues(rt: Runtime) -> None:
    async with await aio_pika.connect(RABBITMQ_URL) as conn:
        channel = await conn.channel()
        for name in (physical(rt), f"{physical(rt)}.dead-letter"):
            await channel.queue_delete(name)


def connection_losses(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "connection to RabbitMQ" in r.getMessage()]


@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_message_with_unreadable_properties_is_dead_lettered_as_malformed_and_the_queue_goes_on(
    tmp_path, caplog, case
):
    """Its body a valid envelope, so only the properties are wrong: it is not run (what a header the
    client could not read said is unknown), and its letter says which property could not be read."""
    caplog.set_level(logging.WARNING, logger="queueing.rabbitmq")
    app, rt, calls = make(tmp_path)
    await rt.open()
    try:
        damaged = build_envelope(app, Invoice(n=99), datetime.now(UTC))
        await publish_damaged(physical(rt), case, damaged.encode())
        good = await app.enqueue(Invoice(n=1))
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [good.message_id], MessageStatus.SUCCEEDED),
                timeout=20,
                what="the good one",
            )
            await wait_until(
                lambda: all_have(rt, [damaged.message_id], MessageStatus.DEAD_LETTERED),
                timeout=20,
                what="the damaged one dead-lettered",
            )
        assert connection_losses(caplog) == []
        assert calls == [(1, 1)]  # the damaged one never ran
        rec = await rt.tracker.get(damaged.message_id)
        assert rec is not None
        assert rec.reason == "malformed-envelope"
        assert "AMQP properties" in (rec.description or "")
        assert CASES[case][3] in (rec.description or "")
        [letter] = await take_all(f"{physical(rt)}.dead-letter")
        assert letter.body == damaged.encode()  # byte for byte
        assert letter.headers[REASON] == "malformed-envelope"
        assert CASES[case][3] in str(letter.headers[DESCRIPTION])
        assert letter.message_id == str(damaged.message_id)  # the id its history has
    finally:
        await rt.close()
        await delete_queues(rt)


async def test_a_run_in_flight_is_not_run_again_when_an_unreadable_message_arrives(tmp_path, caplog):
    """The connection a damaged message closed took back every message its consumers held: a run in
    flight ran again, and its own settlement was refused."""
    caplog.set_level(logging.WARNING)
    app, rt, calls = make(tmp_path)
    downstream.update(slow=3.0, free_runs=None)
    await rt.open()
    try:
        slow = await app.enqueue(Invoice(n=1, mode="slow"))
        async with running(rt):
            await wait_until(lambda: len(calls) == 1, what="the slow run")
            await publish_damaged(physical(rt), "message_id", b"not an envelope")
            await wait_until(
                lambda: all_have(rt, [slow.message_id], MessageStatus.SUCCEEDED),
                timeout=20,
                what="the slow run",
            )
            await wait_until(lambda: _dead(rt, 1), what="the damaged one dead-lettered")
        assert calls == [(1, 1)]
        assert connection_losses(caplog) == []
        assert not [r for r in caplog.records if "lease lost" in r.getMessage()]
    finally:
        downstream.update(slow=0.05)
        await rt.close()
        await delete_queues(rt)


async def test_a_message_with_unreadable_properties_handed_back_unrun_is_not_made_readable(tmp_path):
    """A consumer nobody asks for work hands its buffered messages back as copies of their envelopes:
    such a copy would carry none of the properties that could not be read, and run."""
    app, rt, calls = make(tmp_path)
    await rt.open()
    try:
        damaged = build_envelope(app, Invoice(n=99), datetime.now(UTC))
        await publish_damaged(physical(rt), "message_id", damaged.encode())
        sub = app.subscription("Invoice")
        assert sub is not None
        await rt.provider.receive(sub, 0)  # the consumer starts; the broker pushes it into its buffer
        consumer = rt.provider._consumers[physical(rt)]
        await wait_until(lambda: len(consumer.buffer) == 1, what="prefetch")
        await wait_until(lambda: consumer.tag is None, what="the hand-back")  # (nobody asked for work)
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [damaged.message_id], MessageStatus.DEAD_LETTERED),
                what="the damaged one dead-lettered",
            )
        assert calls == []
        [letter] = await take_all(f"{physical(rt)}.dead-letter")
        assert letter.headers[REASON] == "malformed-envelope"
    finally:
        await rt.close()
        await delete_queues(rt)


async def _dead(rt: Runtime, n: int) -> bool:
    return await rt.provider.depth(physical(rt), dead=True) == n


async def test_an_operators_scan_reads_past_a_dead_letter_with_unreadable_properties(tmp_path):
    """A letter with such properties in the dead-letter queue (the broker's own dead-lettering moves a
    message as it came) dropped the scan's connection at every read: no retry, purge or lookup of a
    letter behind it could finish."""
    app, rt, calls = make(tmp_path)
    await rt.open()
    try:
        dead = f"{physical(rt)}.dead-letter"
        await publish_damaged(dead, "header_name", json.dumps({"not": "an envelope"}).encode())
        declined = await app.enqueue(Invoice(n=7, mode="fatal"))
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [declined.message_id], MessageStatus.DEAD_LETTERED), what="dead-lettered"
            )
            downstream["declines"] = False
            await OpsService(rt).retry(declined.message_id)
            await wait_until(
                lambda: all_have(rt, [declined.message_id], MessageStatus.SUCCEEDED), what="the retried run"
            )
        assert calls == [(7, 1), (7, 1)]
        [left] = await take_all(dead)  # the damaged letter stays where it was
        assert left.body == b'{"not": "an envelope"}'
    finally:
        await rt.close()
        await delete_queues(rt)
