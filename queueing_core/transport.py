"""The provider seam (DESIGN.md): small, named by intent, with declared capabilities.

Providers implement :class:`Provider`; the pipeline and the hosts use only this module's names, so
``pause``, retries, expiry and the rest are written once for every transport.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .clock import utcnow
from .decisions import Decision, Defer, counts_attempt
from .envelope import Envelope
from .errors import MalformedEnvelope
from .naming import Transport

_log = logging.getLogger("queueing.settle")

if TYPE_CHECKING:
    from .app import QueueingApp, Subscription


@dataclass(frozen=True, slots=True)
class Capabilities:
    #: longest delay the transport holds natively; None = unbounded, timedelta(0) = none
    max_delay: timedelta | None = None
    lock_renewal: bool = False
    native_dead_letter: bool = False
    #: the provider can wake a waiting consumer when work arrives (NOTIFY, an in-memory event)
    push_wakeups: bool = False
    #: the provider keeps message history itself (SQL); others feed a tracker
    durable_history: bool = False
    transactions: bool = False
    #: largest encoded envelope the transport accepts
    max_message_bytes: int | None = None
    #: the longest lease (lock) the transport gives a message (Service Bus: 5 minutes); a type's longer
    #: ``lease_duration`` is held by renewing it within this
    longest_lease: timedelta | None = None
    #: the longest a run may go on from its receive before the transport takes the message back itself,
    #: however its lease is renewed (RabbitMQ: the broker's consumer timeout): see :class:`RunBound`
    longest_run: RunBound | None = None
    #: the provider's receive already leaves out paused queues/types (SQL filters in the claim)
    filters_paused: bool = False
    #: two receives for one subscription may run at once, each taking different messages (SQL: each
    #: claim skips the rows another holds), so a worker may keep a second one in flight
    overlapping_receives: bool = False
    #: a batch of settlements stands or falls as one call (SQL: one transaction on its hot path): one
    #: the store refuses fails the others with it, so the worker settles such a batch one by one when
    #: it fails (the brokers settle each message apart already, failing only when every one failed)
    settles_as_one: bool = False
    #: a purge of a whole queue removes the messages workers hold too (Storage's Clear Messages): their
    #: history goes with the rest, and their holders' settlements are refused
    purge_takes_held: bool = False
    #: the statuses whose messages wait in a dead-letter queue that never drops them: their history is
    #: not pruned by age (the letter would stay in no listing, and could never be retried)
    dead_letters_kept: tuple[str, ...] = ()


#: the shortest :class:`RunBound`
SHORTEST_BOUND = timedelta(seconds=2)


@dataclass(frozen=True, slots=True)
class RunBound:
    """The longest a run may go on from its receive wherever it runs, whatever its type's
    ``time_limit``: past it the transport or the host takes the message back itself, and not only
    that one (RabbitMQ's consumer timeout closes the channel, and every message of the queue held on
    it is delivered again while its run goes on; the Functions host's ``functionTimeout`` restarts
    the worker process, ending every invocation in it). A run still going when its bound is near is
    cut as at its own time limit (a failed attempt) and settled before that happens."""

    limit: timedelta
    #: the run's cut, in words, for its error: what the bound is and the setting that moves it
    because: str

    def __post_init__(self) -> None:
        # a shorter one left a run no time to start: every message deferred, for ever (review)
        if self.limit < SHORTEST_BOUND:
            raise ValueError(f"a run bound of {self.limit.total_seconds():g} s is too short: {self.because}")

    def tighter(self, other: RunBound | None) -> RunBound:
        return self if other is None or self.limit <= other.limit else other


@dataclass(slots=True)
class Delivery:
    """One received message: the decoded envelope (or why it is not one) plus transport bookkeeping."""

    queue: str  # logical queue name
    raw: bytes | str
    envelope: Envelope | None
    malformed: MalformedEnvelope | None
    #: this delivery's attempt number, 1-based, counting earlier counted attempts
    attempt: int
    handle: Any = None  # whatever the provider needs to settle (a row id, a lock token, a receipt)
    received_at: datetime = field(default_factory=utcnow)
    lease_until: datetime | None = None
    #: set by ``settle`` when the transport refused this delivery's settlement because its lease had
    #: passed to another run (released, swept, expired): its outcome was not applied and must not be
    #: recorded as if it had been
    refused: bool = False
    #: set by ``settle`` beside ``refused`` where the refusal may hide this run's own settlement: an
    #: earlier try was applied but its answer lost, and the try after it found the lock gone because
    #: the message had left the queue (Service Bus). The runtime records the outcome unless a later run
    #: of the message has recorded its own
    unconfirmed: bool = False
    #: set by ``settle`` when this delivery's outcome went on in a copy but the original could not be
    #: removed (the transport's id of the original): it may come back, and is then a known duplicate
    left_behind: str | None = None
    #: set by ``settle`` when this delivery's settlement took effect at the transport (its original
    #: deleted) although the call failed for others of its batch: if the settler gives the batch up,
    #: this one's outcome is recorded all the same (it will not come back to be recorded by another run)
    applied: bool = False
    #: set by the runtime when this delivery is a known duplicate (a repeated forward whose outcome is
    #: already recorded): it is completed without running, and counted in history instead of recorded
    duplicate: bool = False
    #: whether every earlier delivery that ``attempt`` counts was handed to a worker to run (or held
    #: under a lease that lapsed): then attempts past the last were used by runs that never settled,
    #: and the pipeline dead-letters the message rather than run it again. RabbitMQ says only
    #: "redelivered", which a message merely buffered by a consumer whose connection dropped is too
    runs_counted: bool = True

    @classmethod
    def of(
        cls,
        raw: bytes | str,
        *,
        queue: str,
        delivery_count: int = 1,
        handle: Any = None,
        lease_until: datetime | None = None,
        received_at: datetime | None = None,
    ) -> Delivery:
        """Decode ``raw``; ``delivery_count`` is the transport's own count for this copy (1 = first);
        ``received_at``: when the transport handed it over (now, unless it waited in a buffer since)."""
        when = received_at or utcnow()
        try:
            env = Envelope.decode(raw)
        except MalformedEnvelope as exc:
            return cls(queue, raw, None, exc, max(1, delivery_count), handle, when, lease_until)
        return cls(queue, raw, env, None, env.attempt + max(1, delivery_count), handle, when, lease_until)

    @property
    def type_name(self) -> str | None:
        return self.envelope.type if self.envelope else None

    def attempts_used(self, decision: Decision) -> int:
        """Attempts consumed once ``decision`` is settled (what a re-sent copy's envelope carries)."""
        if getattr(decision, "reset_attempts", False):
            return 0
        return self.attempt if counts_attempt(decision) else self.attempt - 1

    def copy_after(self, decision: Decision, attempts: int | None = None) -> Envelope:
        """The envelope of the copy that carries ``decision`` on: the attempts it used (``attempts``
        where the transport knows better) and, for a run asked for later, its new expiry."""
        env = self.envelope
        assert env is not None, "malformed messages are always dead-lettered"
        used = self.attempts_used(decision) if attempts is None else attempts
        if isinstance(decision, Defer) and decision.reset_attempts:
            return env.with_attempt(used, expires_at=decision.expires_at)
        return env.with_attempt(used)

    def text(self) -> str:
        raw = self.raw
        return raw if isinstance(raw, str) else raw.decode("utf-8", errors="replace")

    def refuse(self, why: str) -> None:
        """The transport refused this delivery's settlement: its lease had passed to another run
        (``why`` says how the transport knows). Nothing was applied; the run holding it now decides."""
        self.refused = True
        env = self.envelope
        _log.warning(
            "lease lost on %s before settling (%s): this run's outcome is not applied",
            self.queue,
            why,
            extra={
                "message_id": str(env.message_id) if env else None,
                "correlation_id": env.correlation_id if env else None,
            },
        )


@dataclass(frozen=True, slots=True)
class Settlement:
    delivery: Delivery
    decision: Decision


def settled_each(settlements: Sequence[Settlement], results: Sequence[object], transport: str) -> None:
    """After settling a batch message by message: raise when every one failed (the caller tries the
    batch again); otherwise the ones that failed were not applied. They come back when their lease
    lapses and run again, so their outcome must not be recorded as if it had been (it is treated as a
    refused settlement: not recorded, not journaled as applied)."""
    failures: list[tuple[Settlement, BaseException]] = [
        (s, r) for s, r in zip(settlements, results, strict=True) if isinstance(r, BaseException)
    ]
    for _, exc in failures:
        _log.warning("settling a %s message failed: %s", transport, (str(exc) or repr(exc)).splitlines()[0])
    if failures and len(failures) == len(settlements):
        raise failures[0][1]
    for s, _ in failures:
        s.delivery.refused = True  # not applied: it comes back, and the run that gets it records it


@runtime_checkable
class Provider(Protocol):
    transport: Transport
    capabilities: Capabilities

    async def open(self, app: QueueingApp) -> None:
        """Connect and make sure the app's queues exist (when allowed)."""

    async def close(self) -> None: ...

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        """Send; with ``wait`` return only once the transport has durably accepted every envelope."""

    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        """Take up to ``max_messages`` available now (leased to this consumer); never blocks long."""
        ...

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, returning early when the provider learns of new work."""

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        """Carry out the pipeline's decisions."""

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        """Extend the leases of in-flight deliveries; return the ones whose lease was lost."""
        ...


@runtime_checkable
class Maintains(Protocol):
    """A provider with periodic upkeep (the SQL provider's lease sweeper and retention)."""

    maintenance_interval: float

    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]: ...


@runtime_checkable
class HasBackgroundTasks(Protocol):
    """A provider with long-running companions (the delayed-message dispatcher): the worker runs
    each coroutine function as a task for its lifetime and cancels it at shutdown."""

    def background_tasks(self) -> list[Callable[[], Coroutine[Any, Any, None]]]: ...


@runtime_checkable
class SettlesWithClaims(Protocol):
    """A provider that can settle a batch and claim the next one in one transaction (one round trip,
    one commit): the settlements and the claim are committed together or not at all, so a failure
    leaves nothing settled and nothing claimed, and the caller may hand the settlements to ``settle``
    again. Refused settlements (their lease had passed to another run) are marked on the deliveries
    exactly as ``settle`` marks them; a refusal fails nothing and the claim still happens.

    ``settles_with_claims`` says whether the combined call is offered right now (it may depend on how
    the provider was opened and configured); the worker asks once it is open."""

    def settles_with_claims(self) -> bool: ...

    async def settle_and_receive(
        self, settlements: Sequence[Settlement], sub: Subscription, max_messages: int
    ) -> list[Delivery]:
        """``settle(settlements)`` and then ``receive(sub, max_messages)``, in one transaction."""
        ...


@runtime_checkable
class KnowsClaimers(Protocol):
    """A provider that can tell whether this worker is the only one holding leases on its server (the
    SQL provider on PostgreSQL): a worker with ``receives_in_flight="auto"`` keeps a second claim in
    flight only then (see ``queueing_core.overlap``)."""

    async def sole_claimer(self) -> bool: ...


@runtime_checkable
class OwnsLeases(Protocol):
    """A provider that claims under an owner id of its own (the SQL provider's ``locked_by``): a worker
    on it takes that id, so the worker id in the logs is the lease owner in the database."""

    worker_id: str
