"""The multi-step sequences of the fault suite: how each is set up and what its one action is.

A sequence is one operation that takes several calls to stores and brokers: a worker receiving, renewing
and settling a run (success, retry by copy, a paused type's wait by copy, dead-lettering, expiry, an
idempotent message's expiry), an operator's action (retry, bringing a waiting retry forward, purge of
dead letters, of waiting messages and of a whole queue, archive, lease release, cancel), the delayed
store's forward (of a row whose text is no envelope, too), and an enqueue with its history record. Some
run with a call the transport refuses throughout (``Sequence.refused``: a forward or a retry's copy
whose send fails, for an outage or a denial, an ack that fails), so that their steps are the paths that
handle that first fault: a release, a failure counted, a hand-back, a give-back.
``prepare`` brings one message to the state the operation starts from (no faults), ``act`` is the
operation itself (every call it makes is a step of the table), ``final`` the state it must end in once
the operator's action is repeated and the workers drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from queueing_core import NonRetryableError, QueueingApp, QueueMessage, Retry, RetryPolicy, queue
from queueing_core.clock import utcnow
from queueing_core.decisions import RetryAfter
from queueing_core.envelope import Envelope
from queueing_core.ops import OpsService
from queueing_core.providers.dead_letters import whole_queue
from queueing_core.providers.sql.rows import Lease
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery, record_from_envelope
from queueing_core.transport import Delivery, Settlement
from queueing_core.worker import Settler

from .kits import KITS

QUEUE = "faults"
#: a retry that waits this long is still waiting when the sequence acts (a retry due within SQS's own
#: delay waits in SQS, which cannot be shortened: this one waits in the kit's delayed store)
WAITS = timedelta(hours=1)
FAST = RetryPolicy(base=timedelta(milliseconds=20), factor=1.0, jitter=0)


@queue(QUEUE, max_attempts=5, retry=FAST, lease_duration=timedelta(seconds=1))
class Work(QueueMessage):
    key: str


VERSIONS = "faults-versions"


#: an idempotent type (a queue of its own, as every type has): where the transport keeps no SQL row,
#: its identity's document lives in the control store, and a run that finds a message past its expiry
#: marks it started there (a compare-and-set) before it expires it
@queue(VERSIONS, idempotent=True, identity="key", retry=FAST, lease_duration=timedelta(seconds=1))
class Version(QueueMessage):
    key: str


@dataclass
class Ctx:
    app: QueueingApp
    rt: Runtime
    mode: dict[str, str] = field(default_factory=lambda: {"handler": "ok"})
    message_id: uuid.UUID | None = None
    delivery: Delivery | None = None
    settlement: Settlement | None = None
    ran: list[int] = field(default_factory=list)

    @property
    def mid(self) -> uuid.UUID:
        assert self.message_id is not None, "the message was never given an id"
        return self.message_id


def fault_app(app: QueueingApp, ctx_mode: dict[str, str], ran: list[int], sent: list[uuid.UUID]) -> None:
    @app.handler()
    async def handle(msg: Work, ctx: Any) -> None:
        ran.append(ctx.attempt)
        if ctx_mode["handler"] == "fail":
            raise RuntimeError("injected handler failure (retry)")
        if ctx_mode["handler"] == "fatal":
            raise NonRetryableError("injected handler failure (dead-letter)")
        if ctx_mode["handler"] == "later":
            raise Retry(WAITS, "injected: try again in an hour")

    @app.handler()
    async def handle_version(msg: Version, ctx: Any) -> None:
        ran.append(ctx.attempt)

    @app.use_enqueue_middleware
    async def remember(env: Envelope, call_next: Callable[[Envelope], Awaitable[Envelope]]) -> Envelope:
        sent.append(env.message_id)  # the id is known even when enqueue itself fails
        return await call_next(env)


async def claim(rt: Runtime, mid: uuid.UUID, timeout: float = 30.0, *, type_name: str = "Work") -> Delivery:
    sub = rt.app.subscription(type_name)
    assert sub is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in await rt.provider.receive(sub, 10):
            assert d.envelope is not None
            assert d.envelope.message_id == mid, "one message per queue"
            return d
        await rt.provider.wait_for_work(sub, 0.1)
    raise AssertionError(f"message {mid} was not delivered within {timeout}s")


async def settle(rt: Runtime, *settlements: Settlement) -> None:
    """Settle and record as a worker does: through its settler (retries included), in one batch. A
    history write that a loaded store did not take goes to the backlog: the sequence starts once it
    has landed."""
    settler = Settler(rt, linger=0)
    for one in settlements:  # (before it starts: one batch)
        settler.add(one)
    settler.start()
    await settler.close()
    assert await rt.history.settle(30.0), "the history of the prepared message did not land"


async def enqueue(ctx: Ctx, **options: Any) -> None:
    receipt = await ctx.app.enqueue(Work(key=uuid.uuid4().hex[:8]), **options)
    ctx.message_id = receipt.message_id


async def processed(ctx: Ctx, handler: str, **options: Any) -> None:
    """A message delivered and run, its settlement decided but not yet carried out."""
    await enqueue(ctx, **options)
    d = await claim(ctx.rt, ctx.mid)
    ctx.mode["handler"] = handler
    ctx.settlement = await ctx.rt.process(d)
    ctx.mode["handler"] = "ok"


async def finished(ctx: Ctx, handler: str) -> None:
    """A message run and settled (no faults yet). The queue's lease is 1 s, so that the steps of an
    operation see a lapse quickly; a loaded machine can stall a run that long, and then its
    settlement is refused (the lease passed on): see :func:`run_again_until_settled`."""
    await processed(ctx, handler)
    assert ctx.settlement is not None
    await settle(ctx.rt, ctx.settlement)
    if ctx.settlement.delivery.refused:
        await run_again_until_settled(ctx, handler)


async def run_again_until_settled(ctx: Ctx, handler: str = "ok") -> None:
    """The message's settlement was refused (its lease lapsed): it comes back and is run and settled
    again, as a worker would, until one settlement holds."""
    for _ in range(5):
        d = await claim(ctx.rt, ctx.mid)
        ctx.mode["handler"] = handler
        ctx.settlement = await ctx.rt.process(d)
        ctx.mode["handler"] = "ok"
        await settle(ctx.rt, ctx.settlement)
        if not ctx.settlement.delivery.refused:
            return
    raise AssertionError("the prepared message's lease ran out before its settlement five times in a row")


async def _paused_run(ctx: Ctx) -> None:
    await enqueue(ctx)
    d = await claim(ctx.rt, ctx.mid)
    await ctx.rt.control.set_paused("type", "Work", True)
    ctx.rt.control.invalidate()
    ctx.settlement = await ctx.rt.process(d)
    await ctx.rt.control.set_paused("type", "Work", False)
    ctx.rt.control.invalidate()


async def _expired_run(ctx: Ctx) -> None:
    await enqueue(ctx, ttl=timedelta(milliseconds=300))
    d = await claim(ctx.rt, ctx.mid)
    await asyncio.sleep(0.4)  # expires while held: the run sees it and expires it
    ctx.settlement = await ctx.rt.process(d)


async def _expired_version(ctx: Ctx) -> None:
    """An idempotent message held past its expiry, not yet run."""
    receipt = await ctx.app.enqueue(Version(key=uuid.uuid4().hex[:8]), ttl=timedelta(milliseconds=300))
    ctx.message_id = receipt.message_id
    ctx.delivery = await claim(ctx.rt, ctx.mid, type_name="Version")
    await asyncio.sleep(0.4)


async def _run_and_settle(ctx: Ctx) -> None:
    """The run itself (which reads the identity's document and marks it started before it expires
    the message), then its settlement."""
    assert ctx.delivery is not None
    ctx.settlement = await ctx.rt.process(ctx.delivery)
    await settle(ctx.rt, ctx.settlement)


async def _due_in_store(ctx: Ctx) -> None:
    """A message waiting in the delayed store and due now, as its producer recorded it."""
    prov: Any = ctx.rt.provider
    env = ctx.rt.producer.envelope_for(Work(key="delayed"))
    ctx.message_id = env.message_id
    now = utcnow()
    await ctx.rt.tracker.upsert([record_from_envelope(env, "Sleeping", now)])
    await prov.delayed.store(env, prov.physical(QUEUE), now)


async def _damaged_in_store(ctx: Ctx) -> None:
    """A row of the delayed store whose text is not an envelope (damaged, or written by another
    version), due now: its forward sends the text as it was stored to the dead-letter queue, under the
    row's message id, and the history records it there."""
    await _due_in_store(ctx)
    store: Any = ctx.rt.provider.delayed
    async with store.sql.engine.begin() as conn:
        await conn.execute(
            sa.update(store._t).where(store._t.c.message_id == ctx.mid).values(envelope="not an envelope")
        )


async def _settle_it(ctx: Ctx) -> None:
    assert ctx.settlement is not None
    await settle(ctx.rt, ctx.settlement)


async def _settle_beside_a_refused_one(ctx: Ctx) -> None:
    """As a worker's settler does when the batch also holds a settlement that cannot be made (a retry
    due after a delay no timestamp holds, refused before any statement): the batch fails, and each
    settles on its own; the prepared message's settlement is the one step, and must still hold."""
    assert ctx.settlement is not None
    nowhere = Delivery(QUEUE, "", None, None, 1, handle=Lease(row=-1, token=0))  # (no such row)
    refused = Settlement(nowhere, RetryAfter(timedelta.max, "a delay no timestamp holds"))
    await settle(ctx.rt, refused, ctx.settlement)


async def _settle_with_claim(ctx: Ctx) -> None:
    """As a worker's consumer does where the provider settles with its claims: its claim takes the
    settler's buffered settlement into the claim's transaction; a claim that fails gives it back to
    the settler (the consumer backs off), which settles it on its own as it closes."""
    assert ctx.settlement is not None
    ctx.rt.provider.settle_with_claims = True  # type: ignore[attr-defined]  # (off by default)
    sub = ctx.rt.app.subscription("Work")
    assert sub is not None
    settler = Settler(ctx.rt, linger=0)
    settler.start()
    settler.add(ctx.settlement)
    try:
        await settler.claim_with(sub, 10)  # the message's retry is not due yet: nothing to claim
    except Exception:
        pass  # the worker logs it and backs off; the settlement went back to the settler
    finally:
        await settler.close()


async def _receive_run_settle(ctx: Ctx) -> None:
    """A worker's whole turn with one message: received (SQS: its lease row taken beside the receive),
    run, settled."""
    d = await claim(ctx.rt, ctx.mid, timeout=5.0)
    ctx.settlement = await ctx.rt.process(d)
    await settle(ctx.rt, ctx.settlement)


async def _renew_then_settle(ctx: Ctx) -> None:
    """As a worker does while a handler runs: the lease renewed (a renewal that fails is tried again at
    the next interval, one reported lost is only logged: the run goes on), then the run settled."""
    assert ctx.delivery is not None
    with contextlib.suppress(Exception):
        await ctx.rt.provider.renew([ctx.delivery])
    ctx.settlement = await ctx.rt.process(ctx.delivery)
    await settle(ctx.rt, ctx.settlement)


async def _forward(ctx: Ctx) -> None:
    await ctx.rt.provider.dispatcher.dispatch_once()  # type: ignore[attr-defined]


async def _settle_then_give_back(ctx: Ctx) -> None:
    """As RabbitMQ's provider does when a settlement's ack fails: unless a later try completes it, the
    message is given back (nacked to its queue) ``give_back_after`` seconds later; a try after that is
    refused (the message went back). A give-back that fails leaves it on the channel, which returns it
    when it closes."""
    assert ctx.settlement is not None
    prov: Any = ctx.rt.provider
    prov.give_back_after = 0.05
    # the message given back comes to this idle consumer again, whose janitor would hand it back in
    # turn (a publish and an ack of its own): a sequence of its own, not this one's steps
    prov.idle_timeout = 3600.0
    with contextlib.suppress(Exception):
        await prov.settle([ctx.settlement])  # the first try
    handle = ctx.settlement.delivery.handle
    deadline = time.monotonic() + 30
    while not handle.given_back and time.monotonic() < deadline:  # (then the give-back's nack ran)
        await asyncio.sleep(0.02)
    assert handle.given_back, "the message was never given back"
    with contextlib.suppress(Exception):
        await prov.settle([ctx.settlement])  # the settler's next try: refused, it went back
    assert ctx.settlement.delivery.refused, "a try after the give-back was not refused"


async def _claimed(ctx: Ctx) -> None:
    await enqueue(ctx)
    ctx.delivery = await claim(ctx.rt, ctx.mid)


async def _nothing(ctx: Ctx) -> None:
    return None


async def _enqueue_one(ctx: Ctx) -> None:
    await enqueue(ctx)


async def _retry_it(ctx: Ctx) -> None:
    await OpsService(ctx.rt).retry(ctx.mid)


async def _cancel(ctx: Ctx) -> None:
    await OpsService(ctx.rt).cancel(ctx.mid)


@dataclass(frozen=True)
class Sequence:
    name: str
    prepare: Callable[[Ctx], Awaitable[None]]
    act: Callable[[Ctx], Awaitable[None]]
    #: the state once the operator's action is repeated and workers drained: the message ran
    #: ("succeeded"), it is gone from the transport and the history ("gone"), it is "archived", it
    #: ended without running ("cancelled"), or it is a dead letter and nothing else ("dead")
    final: str = "succeeded"
    #: the operator's action, repeated in recovery
    repeat: str | None = None
    #: provider -> why the sequence does not exist there
    absent: dict[str, str] = field(default_factory=dict)
    #: the queue its message is on
    queue: str = QUEUE
    #: what the operator purges where the final state is "gone" (the sequence's action, repeated)
    purges: MessageQuery = field(default_factory=lambda: MessageQuery(queue=QUEUE, status=("DeadLettered",)))
    #: call points the transport refuses at every call while the sequence acts: a first fault, whose
    #: handling is the sequence (a step's fault is then a second fault, in that handling)
    refused: tuple[str, ...] = ()
    #: the refusal is a denial (the service answers no: a missing right, a nacked publish), not the
    #: call point's own error (an outage)
    denied: bool = False
    #: an operator's action the refusal makes fail (it raises), and the history's status it leaves
    #: (its baseline checks both at once); None: the refusal is handled without raising
    refusal_leaves: str | None = None


_NOT_COMBINED = "the provider does not settle with its claims (no SettlesWithClaims)"
_ONLY_SQL = {p: _NOT_COMBINED for p in ("inprocess", "storage_queue", "servicebus", "rabbitmq", "sqs")}
_APART = "the transport settles each message of a batch apart (not settles_as_one): nothing to split"
_CLOUD_LOCKS = "the transport's lease belongs to its receiver: the ops API refuses to release it"
_NATIVE_DELAY = "the transport holds delays itself: there is no delayed store to forward from"
_HIDDEN = {
    "storage_queue": "a retry waits hidden in its queue, which cannot bring it forward (the ops API refuses)",
    "servicebus": "a retry waits as a scheduled message, which cannot be brought forward (ops API refuses)",
}
#: every transport's sends (a name a provider has no call point of is none of its steps)
_SENDS = (
    *("queue.send_message", "sb.send_messages", "amqp.publish"),
    *("sqs.send_message", "sqs.send_message_batch"),
)
_NO_SEND = "in memory: nothing can refuse a send"
_NO_COPY = "an operator's retry makes the dead row due again, in one statement: no copy is sent"
_NO_GIVE_BACK = (
    "a settlement that fails leaves the message to its lease, which lapses by itself: no call follows"
)
_NO_RENEWAL = "AMQP holds a delivery until it is settled or its channel closes: there is no lease to renew"
#: a whole queue: its live messages, its dead letters and what waits for it in the delayed store
_WHOLE_QUEUE = whole_queue(MessageQuery(queue=QUEUE))


def _whole_queue_purge(name: str, handler: str, absent: dict[str, str] | None = None) -> Sequence:
    """A whole queue purged, its one message run first by ``handler`` (dead-lettered, or waiting)."""
    return Sequence(
        name,
        lambda c: finished(c, handler),
        lambda c: OpsService(c.rt).purge(_WHOLE_QUEUE),
        final="gone",
        repeat="purge",
        purges=_WHOLE_QUEUE,
        absent=absent or {},
    )


def _operator_retry(name: str, handler: str, **options: Any) -> Sequence:
    """An operator's retry of the one message, run first by ``handler`` (dead-lettered, or waiting)."""
    return Sequence(name, lambda c: finished(c, handler), _retry_it, repeat="retry", **options)


_NO_FORWARD = {
    "inprocess": _NATIVE_DELAY,
    "sqlite": "a delayed SQL row waits in its own table until due: nothing is forwarded",
    "postgres": "a delayed SQL row waits in its own table until due: nothing is forwarded",
    "servicebus": _NATIVE_DELAY + " (scheduled messages)",
}


SEQUENCES: list[Sequence] = [
    # the commonest settlement of all: a run that succeeded, its message completed (deleted, acked)
    Sequence("succeed", lambda c: processed(c, "ok"), _settle_it),
    Sequence("retry_by_copy", lambda c: processed(c, "fail"), _settle_it),
    # a success whose ack the broker refuses: the message given back (RabbitMQ has no lease to lapse)
    Sequence(
        "give_back",
        lambda c: processed(c, "ok"),
        _settle_then_give_back,
        refused=("amqp.ack",),
        absent={p: _NO_GIVE_BACK for p in KITS if p != "rabbitmq"},
    ),
    Sequence("pause_by_copy", _paused_run, _settle_it),
    Sequence("dead_letter", lambda c: processed(c, "fatal"), _settle_it, repeat="retry"),
    Sequence("retry_with_claim", lambda c: processed(c, "fail"), _settle_with_claim, absent=_ONLY_SQL),
    Sequence(
        "retry_beside_a_refused_one",
        lambda c: processed(c, "fail"),
        _settle_beside_a_refused_one,
        absent={p: _APART for p in ("inprocess", "storage_queue", "servicebus", "rabbitmq", "sqs")},
    ),
    Sequence(
        "dead_letter_with_claim",
        lambda c: processed(c, "fatal"),
        _settle_with_claim,
        repeat="retry",
        absent=_ONLY_SQL,
    ),
    Sequence("expiry", _expired_run, _settle_it, repeat="retry"),
    Sequence(
        "idempotent_expiry",
        _expired_version,
        _run_and_settle,
        repeat="retry",
        queue=VERSIONS,
        absent={
            p: "the identity is kept on the message's row, and an enqueue discarded against it moves "
            "the row's expiry: the run reads no document (the expiry row covers the settlement)"
            for p in ("sqlite", "postgres")
        },
    ),
    _operator_retry("operator_retry", "fatal"),
    # the same, the transport refusing the copy's send: the dead letter the scan located (held by it)
    # is handed back (Service Bus's abandon, AMQP's nack, SQS's and Storage's visibility reset)
    _operator_retry(
        "retry_refused",
        "fatal",
        refused=_SENDS,
        # not Pending, as if a copy waited: the dead-letter list still lists it, for a new retry
        refusal_leaves="DeadLettered",
        absent={"inprocess": _NO_SEND, "sqlite": _NO_COPY, "postgres": _NO_COPY},
    ),
    Sequence(
        "purge",
        lambda c: finished(c, "fatal"),
        lambda c: OpsService(c.rt).purge(MessageQuery(queue=QUEUE, status=("DeadLettered",))),
        final="gone",
        repeat="purge",
    ),
    Sequence(
        "archive",
        lambda c: finished(c, "ok"),
        lambda c: OpsService(c.rt).archive(c.mid),
        final="archived",
        repeat="archive",
    ),
    Sequence(
        "lease_release",
        _claimed,
        lambda c: OpsService(c.rt).release_lease(c.mid),
        absent={
            "inprocess": "nothing outside the process holds a message: there is no lease to release",
            "storage_queue": _CLOUD_LOCKS,
            "servicebus": _CLOUD_LOCKS,
            "rabbitmq": _CLOUD_LOCKS,
            "sqs": _CLOUD_LOCKS,
        },
    ),
    Sequence("delayed_forward", _due_in_store, _forward, absent=_NO_FORWARD),
    # the same forward, the transport unreachable for the send: the row released to be forwarded again
    # later; or denying it: a failure counted on the row, which is tried again after a while
    Sequence("forward_refused", _due_in_store, _forward, absent=_NO_FORWARD, refused=_SENDS),
    Sequence("forward_denied", _due_in_store, _forward, absent=_NO_FORWARD, refused=_SENDS, denied=True),
    # a damaged row forwarded: its text to the dead-letter queue (confirmed), its history, its removal
    Sequence("damaged_forward", _damaged_in_store, _forward, final="dead", absent=_NO_FORWARD),
    # a message waiting an hour for its retry, brought forward by an operator: a copy sent now, and
    # only then the waiting one taken from the delayed store (SQL: the row made due, one statement)
    _operator_retry("bring_forward", "later", absent=_HIDDEN),
    # the same waiting message purged (by its status): taken from the delayed store, then its history
    Sequence(
        "purge_waiting",
        lambda c: finished(c, "later"),
        lambda c: OpsService(c.rt).purge(MessageQuery(queue=QUEUE, status=("Failed",))),
        final="gone",
        repeat="purge",
        purges=MessageQuery(queue=QUEUE, status=("Failed",)),
        absent={
            "storage_queue": "a message hidden in its queue cannot be picked out (the purge leaves it)",
            "servicebus": "a scheduled message is left to run (the purge leaves it)",
        },
    ),
    # a whole queue purged, a dead letter in it: the delayed store's part, the queue and its dead
    # letters cleared (Storage's clear, SQS's purge, AMQP's purge, Service Bus's drain), then history
    _whole_queue_purge("purge_queue", "fatal"),
    # the same, a message waiting in it for its retry: its row and its history go in one transaction
    _whole_queue_purge("purge_queue_waiting", "later"),
    # a message received, run and settled: the receive's own steps (a lease row beside it on SQS)
    Sequence("receive", _enqueue_one, _receive_run_settle),
    # a held message's lease renewed while it runs, then the run settled
    Sequence(
        "renew",
        _claimed,
        _renew_then_settle,
        absent={"rabbitmq": _NO_RENEWAL, "inprocess": "nothing outside the process holds a message"},
    ),
    Sequence("enqueue_history", _nothing, _enqueue_one),
    # a message waiting on its queue, cancelled: the request, then the row (SQL) or the history's record
    # (the others, where a host that receives it settles it without running it)
    Sequence("cancel", _enqueue_one, _cancel, final="cancelled", repeat="cancel"),
]
BY_NAME = {s.name: s for s in SEQUENCES}
