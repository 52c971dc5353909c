"""Idempotent types on transports that cannot edit a queued message: two hosts enqueueing one identity
at the same moment, ordered by the compare-and-set on the identity's document."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.control import MemoryControlStore
from queueing_core.envelope import Envelope
from queueing_core.idempotency import IdentityGuard, body_hash
from queueing_core.pipeline import decode_message
from queueing_core.testing import in_process


@queue("race-prices", idempotent=True, identity="sku")
class Price(QueueMessage):
    sku: str
    cents: int


class Gated:
    """A provider whose sends wait until both hosts have sent: each has read the identity's document
    before either writes it."""

    def __init__(self, inner: Any, hosts: int) -> None:
        self.inner = inner
        self.barrier = asyncio.Barrier(hosts)

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        await self.inner.send(envelopes, wait=wait)
        await self.barrier.wait()


@pytest.mark.parametrize("same_body", [False, True], ids=["changed-body", "same-body"])
async def test_two_hosts_enqueueing_one_identity_at_once_leave_exactly_one_version_to_run(same_body):
    app = QueueingApp("race")
    app.message(Price)
    rt = in_process(app)
    await rt.open()
    store = MemoryControlStore()  # the store both hosts share
    gated = Gated(rt.provider, 2)
    hosts = [IdentityGuard(app, store, rt.tracker, gated) for _ in range(2)]  # type: ignore[arg-type]
    envs = [rt.producer.envelope_for(Price(sku="A", cents=1 if same_body else c)) for c in (1, 2)]
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(h.send_idempotent([e], ["A"]) for h, e in zip(hosts, envs, strict=True))), 30
    )
    # neither saw the other's version waiting: both sent
    assert [o[0].outcome for o in outcomes] == ["enqueued", "enqueued"]
    found = await store.identity_doc("Price", "A")
    assert found is not None
    doc = found[0]
    ids = {str(e.message_id) for e in envs}
    newest = doc["waiting"][0]
    assert newest in ids
    (older,) = ids - {newest}
    # the writer that came second superseded the first: never both, never neither
    assert doc["superseded"] == {older: newest}
    sub = app.subscription("Price")
    assert sub is not None
    verdicts = {str(e.message_id): await hosts[0].superseded_by(sub, decode_message(sub, e)) for e in envs}
    assert verdicts[newest] is None
    assert str(verdicts[older]) == newest
    assert doc["waiting"][2] == body_hash(next(e for e in envs if str(e.message_id) == newest).body)
    await rt.close()


def test_the_body_hash_ignores_key_order_and_sees_every_value():
    assert body_hash({"a": 1, "b": [1, 2]}) == body_hash({"b": [1, 2], "a": 1})
    assert body_hash({"a": 1}) != body_hash({"a": 1.5})
    assert body_hash({"a": "x"}) != body_hash({"a": "x", "b": None})
