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
from queueing_core.messages import MessageStatus
from queueing_core.pipeline import decode_message
from queueing_core.testing import in_process, run_until_idle


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
    verdicts = {str(e.message_id): await hosts[0].check_start(sub, decode_message(sub, e)) for e in envs}
    assert verdicts[newest] is None
    assert str(verdicts[older]) == newest
    assert doc["waiting"][2] == body_hash(next(e for e in envs if str(e.message_id) == newest).body)
    await rt.close()


def test_the_body_hash_ignores_key_order_and_sees_every_value():
    assert body_hash({"a": 1, "b": [1, 2]}) == body_hash({"b": [1, 2], "a": 1})
    assert body_hash({"a": 1}) != body_hash({"a": 1.5})
    assert body_hash({"a": "x"}) != body_hash({"a": "x", "b": None})


# -- versions on an in-process host: every requested run happens --------------------------------------


@queue("cycle-prices", idempotent=True, identity="sku")
class CyclePrice(QueueMessage):
    sku: str
    cents: int


async def test_the_same_json_enqueued_while_its_version_runs_runs_again():
    app = QueueingApp("running")
    seen: list[int] = []
    started, gate = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def h(msg: CyclePrice, ctx: Any) -> None:
        seen.append(msg.cents)
        started.set()
        await gate.wait()

    rt = in_process(app)
    await rt.open()
    r1 = await app.enqueue(CyclePrice(sku="B", cents=5))
    first = asyncio.create_task(run_until_idle(rt, max_messages=1))
    await asyncio.wait_for(started.wait(), 30)
    rec = await rt.tracker.get(r1.message_id)
    assert rec is not None
    assert rec.status in MessageStatus.runnable()
    r2 = await app.enqueue(CyclePrice(sku="B", cents=5))  # the data changed after the run read it
    assert r2.outcome == "enqueued"
    assert r2.message_id != r1.message_id
    gate.set()
    await asyncio.wait_for(first, 30)
    await run_until_idle(rt)
    assert seen == [5, 5]
    await rt.close()


async def test_a_discard_and_a_start_of_the_waiting_version_are_ordered_by_the_document():
    """The enqueue read the document before a host began the waiting version; its discard must fail
    and the new version be sent."""
    app = QueueingApp("order")
    app.message(CyclePrice)
    rt = in_process(app)
    await rt.open()
    guard = rt.identities
    assert guard is not None
    r1 = await app.enqueue(CyclePrice(sku="C", cents=7))
    sub = app.subscription("CyclePrice")
    assert sub is not None
    store = guard.store
    real_read = store.identity_doc
    began = False

    async def read_then_start(type_name: str, identity: str) -> Any:
        nonlocal began
        found = await real_read(type_name, identity)
        if not began:  # a host begins r1 right after the enqueue read the document
            began = True
            store.identity_doc = real_read  # type: ignore[method-assign]
            assert (
                await guard.check_start(sub, CyclePrice(sku="C", cents=7, message_id=r1.message_id)) is None
            )
        return found

    store.identity_doc = read_then_start  # type: ignore[method-assign]
    r2 = await app.enqueue(CyclePrice(sku="C", cents=7))
    assert began
    assert r2.outcome == "enqueued"
    assert r2.message_id != r1.message_id
    await rt.close()


@queue("flaky-prices", idempotent=True, identity="sku", max_concurrency=1)
class FlakyPrice(QueueMessage):
    sku: str
    cents: int


async def test_a_failed_previous_lookup_runs_the_handler_and_returns_the_concurrency_slot():
    app = QueueingApp("flaky")
    seen: list[tuple[int, Any]] = []

    @app.handler()
    async def h(msg: FlakyPrice, ctx: Any) -> None:
        seen.append((msg.cents, ctx.previous))

    rt = in_process(app)
    await rt.open()

    async def broken(sub: Any, message: Any) -> None:
        raise ConnectionError("control store blip")

    rt.pipeline.previous_lookup = broken
    for sku, cents in (("A", 1), ("B", 2), ("C", 3)):
        await app.enqueue(FlakyPrice(sku=sku, cents=cents))
    await asyncio.wait_for(run_until_idle(rt), 30)
    assert sorted(seen) == [(1, None), (2, None), (3, None)]
    sub = app.subscription("FlakyPrice")
    assert sub is not None
    assert not rt.pipeline.limiter(sub).locked()
    await rt.close()


@queue("dead-prices", idempotent=True, identity="sku", max_attempts=1)
class DeadPrice(QueueMessage):
    sku: str
    cents: int


async def test_an_operators_retry_of_a_superseded_version_that_was_dead_lettered_runs_it():
    from queueing_core.ops import OpsService

    app = QueueingApp("dead")
    seen: list[int] = []
    started, gate = asyncio.Event(), asyncio.Event()
    fail = True

    @app.handler()
    async def h(msg: DeadPrice, ctx: Any) -> None:
        seen.append(msg.cents)
        if msg.cents == 1 and fail:
            started.set()
            await gate.wait()
            raise RuntimeError("boom")

    rt = in_process(app)
    await rt.open()
    r1 = await app.enqueue(DeadPrice(sku="A", cents=1))
    first = asyncio.create_task(run_until_idle(rt, raise_errors=False, max_messages=1))
    await asyncio.wait_for(started.wait(), 30)
    r2 = await app.enqueue(DeadPrice(sku="A", cents=2))  # m1 is running: superseded, runs to its end
    assert r2.supersedes == r1.message_id
    gate.set()
    await asyncio.wait_for(first, 30)
    await run_until_idle(rt, raise_errors=False)
    rec = await rt.tracker.get(r1.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.DEAD_LETTERED
    fail = False
    await OpsService(rt).retry(r1.message_id)
    await run_until_idle(rt, raise_errors=False)
    rec = await rt.tracker.get(r1.message_id)
    assert rec is not None
    assert rec.status == MessageStatus.SUCCEEDED, (rec.status, rec.reason)
    assert seen == [1, 2, 1]
    await rt.close()


@queue("guest-invoices", idempotent=True, identity="customer")
class Invoice(QueueMessage):
    customer: str | None
    total: int


async def test_an_identity_of_none_is_refused_before_anything_is_sent():
    """A review found None taken as the text 'None': every guest's invoice shared one identity, the
    second superseded the first, and one invoice never ran. An enqueue of a message whose identity is
    None now fails with a clear error, before any send; a message with one goes as before."""
    from queueing_core.errors import InvalidArgument

    app = QueueingApp("guests")
    ran: list[int] = []

    @app.handler()
    async def handle(msg: Invoice) -> None:
        ran.append(msg.total)

    rt = in_process(app)
    await rt.open()
    try:
        with pytest.raises(InvalidArgument, match="identity"):
            await app.enqueue(Invoice(customer=None, total=10))
        with pytest.raises(InvalidArgument, match="is None"):
            await app.enqueue_many([Invoice(customer="c1", total=5), Invoice(customer=None, total=20)])
        await app.enqueue(Invoice(customer="c2", total=7))
        assert await run_until_idle(rt) == 1
        assert ran == [7]  # nothing of the refused calls was sent
    finally:
        await rt.close()


async def test_a_version_past_its_expiry_expires_only_once_marked_started_and_runs_when_unsure():
    """``IdentityGuard.expires``, each of its answers against the identity's document in a real control
    store: past its own expiry with no longer life, the waiting version is marked started (so that an
    enqueue from then on sends instead of discarding) and expires; a life made longer by a discarded
    enqueue keeps it; a store that fails, or a document that changes at every read, runs it."""
    from datetime import timedelta

    from queueing_core.clock import utcnow

    app = QueueingApp("expiring")
    app.message(CyclePrice)
    rt = in_process(app)
    await rt.open()
    try:
        guard = rt.identities
        assert guard is not None
        sub = app.subscription("CyclePrice")
        assert sub is not None
        store = guard.store

        async def started() -> str | None:
            found = await store.identity_doc("CyclePrice", "E")
            assert found is not None
            return found[0].get("started")

        first = await app.enqueue(CyclePrice(sku="E", cents=1), ttl=timedelta(minutes=5))
        msg = CyclePrice(sku="E", cents=1, message_id=first.message_id)
        now = utcnow()
        soon = now - timedelta(seconds=1)  # (its own expiry, passed)

        # an identical enqueue with a later expiry was discarded against it: it lives on
        again = await app.enqueue(CyclePrice(sku="E", cents=1), ttl=timedelta(hours=1))
        assert again.outcome == "discarded"
        assert await guard.expires(sub, msg, soon, now) is False
        assert await started() is None  # (nothing marked)
        # ... until that longer life has passed too: then it is marked started, and expires
        later = now + timedelta(hours=2)
        assert await guard.expires(sub, msg, soon, later) is True
        assert await started() == str(first.message_id)

        # the store failing: it runs (it may have been made to live longer)
        real_read, real_put = store.identity_doc, store.put_identity_doc

        async def down(*args: Any) -> Any:
            raise ConnectionError("control store unreachable")

        store.identity_doc = down  # type: ignore[method-assign]
        assert await guard.expires(sub, msg, soon, later) is False
        store.identity_doc = real_read  # type: ignore[method-assign]

        # a document that another writer changes before every write: it runs, after the tries
        newer = await app.enqueue(CyclePrice(sku="E", cents=2), ttl=timedelta(minutes=5))
        newest = CyclePrice(sku="E", cents=2, message_id=newer.message_id)
        tries = 0

        async def always_beaten(*args: Any) -> bool:
            nonlocal tries
            tries += 1
            return False

        store.put_identity_doc = always_beaten  # type: ignore[method-assign]
        assert await guard.expires(sub, newest, soon, later) is False
        assert tries > 1  # (read again after each lost write)
        store.put_identity_doc = real_put  # type: ignore[method-assign]
        assert await guard.expires(sub, newest, soon, later) is True
        # a version that is not the identity's newest expires without a mark of its own
        assert await guard.expires(sub, msg, soon, later) is True
        assert await started() == str(newer.message_id)
    finally:
        await rt.close()


async def test_the_enqueued_hook_is_not_told_of_a_discarded_version():
    """Where the identity's document decides (every transport but SQL): a discarded enqueue added no
    message, and the ``enqueued`` hook is not told of it; a changed version, sent, is."""
    from queueing_core import Event

    app = QueueingApp("hooked")
    app.message(CyclePrice)
    told: list[int] = []
    app.hooks.on(Event.ENQUEUED)(lambda obs: told.append(obs.envelope.body["cents"]))
    rt = in_process(app)
    await rt.open()
    try:
        assert (await app.enqueue(CyclePrice(sku="H", cents=1))).outcome == "enqueued"
        assert (await app.enqueue(CyclePrice(sku="H", cents=1))).outcome == "discarded"
        assert told == [1]
        changed = await app.enqueue(CyclePrice(sku="H", cents=2))
        assert changed.outcome == "enqueued"
        assert changed.supersedes is not None
        assert told == [1, 2]
    finally:
        await rt.close()


async def _prices(name: str, gate: Any = None) -> tuple[Any, list[int]]:
    """An opened in-process runtime whose handler of ``CyclePrice`` notes each price it runs;
    ``gate``, if given, is awaited before noting one (its argument: the message)."""
    app = QueueingApp(name)
    seen: list[int] = []

    @app.handler()
    async def handle(msg: CyclePrice) -> None:
        if gate is not None:
            await gate(msg)
        seen.append(msg.cents)

    rt = in_process(app)
    await rt.open()
    return rt, seen


def _guard_and_sub(rt: Any) -> tuple[IdentityGuard, Any]:
    """The runtime's identity guard and its subscription of ``CyclePrice``."""
    guard, sub = rt.identities, rt.app.subscription("CyclePrice")
    assert guard is not None
    assert sub is not None
    return guard, sub


async def _status(rt: Any, message_id: Any) -> str | None:
    """The status the history records for ``message_id`` (None: no record)."""
    rec = await rt.tracker.get(message_id)
    return None if rec is None else rec.status


async def test_a_replayed_send_of_a_replaced_version_does_not_supersede_the_newer_one():
    """A review inferred it: a schedule's tick (or an outbox) that sent a version, then crashed before
    it noted the send, sends it again under the same id once its claim lapses. If a newer version came
    in between, the replay marked that newer one superseded by the older request, which then ran in its
    place: the newer body never ran. A replay of a version the identity has since replaced now sends
    nothing, and the newer version runs."""
    rt, seen = await _prices("replays")
    app = rt.app
    try:
        producer = rt.producer
        older = producer.envelope_for(CyclePrice(sku="R", cents=1))
        first = await producer.send_prepared([older], identities=["R"])
        assert first[0].outcome == "enqueued"
        newer = await app.enqueue(CyclePrice(sku="R", cents=2))
        assert newer.supersedes == older.message_id
        replay = await producer.send_prepared([older], identities=["R"])  # the same envelope again
        assert replay[0].outcome == "discarded"
        assert replay[0].message_id == newer.message_id  # (the version that covers it)
        await run_until_idle(rt)
        assert seen == [2]  # the newer body ran; the older, superseded, did not
        assert await _status(rt, older.message_id) == MessageStatus.CANCELLED.value
    finally:
        await rt.close()


async def test_a_replay_is_known_as_older_only_by_what_the_document_ordered():
    """Two cases a review found around the replay rule. A version that finished before a newer one
    replaced it, and whose start marker the newer one's start then took: its replay is still older
    (the document lists every replaced version, finished or not). A version whose pointing
    never landed (its sender crashed after the send) and that a host ran meanwhile, while an older
    version stayed the newest: its replay is the newer request, so it is sent and supersedes that one,
    rather than being discarded against it."""
    rt, seen = await _prices("replays-ordered")
    app = rt.app
    try:
        producer, guard = rt.producer, rt.identities
        assert guard is not None
        # 1: T ran and finished; N replaced it, then N started (the marker moved on to N)
        older = producer.envelope_for(CyclePrice(sku="F", cents=1))
        await producer.send_prepared([older], identities=["F"])
        await run_until_idle(rt)
        newer = await app.enqueue(CyclePrice(sku="F", cents=2))
        assert newer.supersedes is None  # (T had finished: nothing left to supersede)
        await run_until_idle(rt)
        assert seen == [1, 2]
        replay = await producer.send_prepared([older], identities=["F"])
        assert (replay[0].outcome, replay[0].message_id) == ("discarded", newer.message_id)
        assert await run_until_idle(rt) == 0
        assert seen == [1, 2]

        # 2: W waits; X was sent but its sender crashed before the document pointed at it, and X ran
        seen.clear()
        waiting = await app.enqueue(CyclePrice(sku="G", cents=1))
        x = producer.envelope_for(CyclePrice(sku="G", cents=2))
        point_at = guard._point_at

        async def crashed(*args: Any, **kwargs: Any) -> None:
            return None  # (the document never pointed at X)

        guard._point_at = crashed  # type: ignore[method-assign]
        try:
            await producer.send_prepared([x], identities=["G"])
        finally:
            guard._point_at = point_at  # type: ignore[method-assign]
        sub = app.subscription("CyclePrice")
        assert sub is not None
        for d in await rt.provider.receive(sub, 10):  # X runs (a host got it first); W goes back
            assert d.envelope is not None
            if d.envelope.message_id == x.message_id:
                await rt.process_and_settle(d)
            else:
                from queueing_core.decisions import Release
                from queueing_core.transport import Settlement

                await rt.provider.settle([Settlement(d, Release("not yet"))])
        assert seen == [2]
        replay = await producer.send_prepared([x], identities=["G"])  # the sender's tick, again
        assert replay[0].outcome == "enqueued"
        assert replay[0].supersedes == waiting.message_id
        await run_until_idle(rt)
        assert 1 not in seen  # the older body did not run after the newer one
        assert await _status(rt, waiting.message_id) == MessageStatus.CANCELLED.value
    finally:
        await rt.close()


async def test_a_replay_stays_older_after_its_success_and_after_many_finished_versions():
    """A second review of the replay rule. (a) A version running when a newer one came, then
    succeeding (its success takes it off the superseded), and the newer one begun: its replay was sent
    and superseded the newer one. (b) A version still queued (a retry's backoff) while 64 newer ones
    ran one after another: had finished versions filled the superseded list, it would have been pushed
    out and run its older body after them. (c) A replay racing a newer enqueue: sent while it was the
    newest, its pointing then found the newer one there, and pointed back at itself."""
    from queueing_core.idempotency import MAX_SUPERSEDED

    began, gate = asyncio.Event(), asyncio.Event()

    async def hold(msg: CyclePrice) -> None:
        if msg.sku == "S" and msg.cents == 1:
            began.set()
            await gate.wait()

    rt, seen = await _prices("replays-again", hold)
    app = rt.app
    try:
        producer, (guard, sub) = rt.producer, _guard_and_sub(rt)

        # (a) T runs; N comes meanwhile; T succeeds; N begins (its start marker); T is sent again
        t = producer.envelope_for(CyclePrice(sku="S", cents=1))
        await producer.send_prepared([t], identities=["S"])
        [d] = await rt.provider.receive(sub, 10)
        running = asyncio.create_task(rt.process_and_settle(d))
        await asyncio.wait_for(began.wait(), 10)
        n = await app.enqueue(CyclePrice(sku="S", cents=2))
        assert n.supersedes == t.message_id
        gate.set()  # (T was begun before N came: it runs to its end)
        await running
        [d] = await rt.provider.receive(sub, 10)
        assert await guard.check_start(sub, CyclePrice(sku="S", cents=2, message_id=n.message_id)) is None
        replay = await producer.send_prepared([t], identities=["S"])
        assert (replay[0].outcome, replay[0].message_id) == ("discarded", n.message_id)
        await rt.process_and_settle(d)
        assert await run_until_idle(rt) == 0
        assert seen == [1, 2]

        # (b) Q waits, superseded by V1; V1 .. V64 each run before the next comes
        seen.clear()
        await rt.control.set_paused("type", "CyclePrice", True)
        q = await app.enqueue(CyclePrice(sku="Q", cents=0))
        await rt.control.set_paused("type", "CyclePrice", False)
        [held] = await rt.provider.receive(sub, 10)  # (Q held aside, as a retry's backoff would)
        for cents in range(1, MAX_SUPERSEDED + 2):
            await app.enqueue(CyclePrice(sku="Q", cents=cents))
            await run_until_idle(rt)
        assert held.envelope is not None
        assert held.envelope.message_id == q.message_id
        await rt.process_and_settle(held)  # Q comes back at last
        assert 0 not in seen  # still known superseded: its older body did not run
        assert seen == list(range(1, MAX_SUPERSEDED + 2))

        # (c) R waits, begun; its replay sends a copy; N2 is pointed at before the replay's pointing
        seen.clear()
        r = producer.envelope_for(CyclePrice(sku="R2", cents=1))
        await producer.send_prepared([r], identities=["R2"])
        assert await guard.check_start(sub, CyclePrice(sku="R2", cents=1, message_id=r.message_id)) is None
        store = guard.store
        put = store.put_identity_doc
        raced: list[Any] = []

        async def newer_first(type_name: str, identity: str, doc: Any, token: Any) -> bool:
            if not raced:  # the replay's first write: a newer version is enqueued just before it
                store.put_identity_doc = put  # type: ignore[method-assign]
                raced.append(await app.enqueue(CyclePrice(sku="R2", cents=2)))
            return await put(type_name, identity, doc, token)

        store.put_identity_doc = newer_first  # type: ignore[method-assign]
        try:
            again = await producer.send_prepared([r], identities=["R2"])
        finally:
            store.put_identity_doc = put  # type: ignore[method-assign]
        assert again[0].supersedes is None  # it did not point back at itself over the newer one
        found = await store.identity_doc("CyclePrice", "R2")
        assert found is not None
        assert found[0]["waiting"][0] == str(raced[0].message_id)
        await run_until_idle(rt)
        assert 2 in seen  # the newer body ran
    finally:
        await rt.close()


async def test_a_resent_copy_that_finds_a_newer_version_pointed_at_marks_itself_superseded():
    """A third review: R ran and succeeded, and is still its identity's newest version; a tick sends
    it again (a copy goes: a host had begun it), and a newer version N is pointed at while the replay
    points the document. The replay stopped without marking its copy, and R's copy, received after N,
    ran its older body last. It is now marked superseded by N. (A newer version that comes after the
    replay has pointed does not: R's history says it finished, and the kit cannot tell the queued copy
    from the finished run; see docs/concepts/jobs.md.)"""
    rt, seen = await _prices("resent")
    app = rt.app
    try:
        producer, (guard, sub) = rt.producer, _guard_and_sub(rt)
        r = producer.envelope_for(CyclePrice(sku="RS", cents=1))
        await producer.send_prepared([r], identities=["RS"])
        await run_until_idle(rt)  # R ran and succeeded
        store, put = guard.store, guard.store.put_identity_doc
        newer: list[Any] = []

        async def newer_first(type_name: str, identity: str, doc: Any, token: Any) -> bool:
            if not newer:
                store.put_identity_doc = put  # type: ignore[method-assign]
                newer.append(await app.enqueue(CyclePrice(sku="RS", cents=2)))
            return await put(type_name, identity, doc, token)

        store.put_identity_doc = newer_first  # type: ignore[method-assign]
        try:
            again = await producer.send_prepared([r], identities=["RS"])  # the tick, again
        finally:
            store.put_identity_doc = put  # type: ignore[method-assign]
        assert again[0].outcome == "enqueued"  # (a copy went: it had been begun)
        deliveries = await rt.provider.receive(sub, 10)
        assert len(deliveries) == 2
        deliveries.sort(key=lambda d: d.envelope.body["cents"] if d.envelope else 0, reverse=True)
        for d in deliveries:  # the newer one first, as a transport without order may deliver them
            await rt.process_and_settle(d)
        assert seen == [1, 2]  # R's copy did not run after N
    finally:
        await rt.close()
