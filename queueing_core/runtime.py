"""The runtime: one app bound to one provider, with its control store, tracker, pipeline and producer.

Hosts (the worker, the Azure Functions triggers, the test helpers) all go through
:meth:`Runtime.record` after settling, so history and the outcome log line are written in one place.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .clock import Clock, utcnow
from .control import CachedControlStore, ControlStore, MemoryControlStore
from .decisions import Complete, DeadLetter, Defer, Expire, Release, RetryAfter
from .envelope import malformed_identity
from .pipeline import Pipeline
from .producer import Producer
from .tracking import MemoryTracker, MessageRecord, Tracker
from .transport import Delivery, Provider, Settlement

if TYPE_CHECKING:
    from .app import QueueingApp

outcome_log = logging.getLogger("queueing.outcome")


@runtime_checkable
class ProvidesControl(Protocol):
    """A provider whose own store holds the shared pause/circuit state (the SQL provider)."""

    def control_store(self) -> ControlStore: ...


@runtime_checkable
class ProvidesTracker(Protocol):
    """A provider that is its own durable history (the SQL provider)."""

    def tracker(self) -> Tracker: ...


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Runtime:
    def __init__(
        self,
        app: QueueingApp,
        provider: Provider,
        *,
        control: ControlStore | None = None,
        tracker: Tracker | None = None,
        clock: Clock = utcnow,
        control_ttl: float = 1.0,
        pause_recheck: timedelta = timedelta(seconds=5),
        waiting_recheck: timedelta = timedelta(seconds=30),
    ) -> None:
        self.app = app
        self.provider = provider
        self.clock = clock
        if control is None:
            control = (
                provider.control_store() if isinstance(provider, ProvidesControl) else MemoryControlStore()
            )
        if tracker is None:
            tracker = provider.tracker() if isinstance(provider, ProvidesTracker) else MemoryTracker()
        self.control = CachedControlStore(control, ttl=control_ttl)
        self.tracker = tracker
        self.producer = Producer(app, provider, tracker=tracker, clock=clock, opener=self.open)
        self.pipeline = Pipeline(
            app,
            self.control,
            clock=clock,
            pause_recheck=pause_recheck,
            waiting_recheck=waiting_recheck,
            producer=self.producer,
        )
        app.bind(self.producer)
        self._opened = False

    @property
    def is_open(self) -> bool:
        return self._opened

    async def open(self) -> None:
        if not self._opened:
            await self.provider.open(self.app)
            self._opened = True

    async def close(self) -> None:
        if self._opened:
            self._opened = False
            await self.provider.close()

    async def __aenter__(self) -> Runtime:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def process(self, delivery: Delivery, **kwargs: Any) -> Settlement:
        return Settlement(delivery, await self.pipeline.process(delivery, **kwargs))

    async def process_and_settle(self, delivery: Delivery) -> Settlement:
        """Decide, settle and record one delivery (hosts without batching use this)."""
        settlement = await self.process(delivery)
        await self.provider.settle([settlement])
        await self.record([settlement])
        return settlement

    async def record(self, settlements: Sequence[Settlement]) -> None:
        """Write history (for providers without their own) and one outcome line per message. A
        settlement the transport refused (its lease had passed to another run) is not history: the
        run that holds the message now records the outcome."""
        applied = [s for s in settlements if not s.delivery.refused]
        if applied and not self.provider.capabilities.durable_history:
            now = self.clock()
            try:
                await self.tracker.upsert([history_record(s, now) for s in applied])
            except Exception:
                outcome_log.exception("could not write message history; processing is unaffected")
        for s in settlements:
            log_outcome(s)


def history_record(s: Settlement, now: Any) -> MessageRecord:
    d, decision = s.delivery, s.decision
    env = d.envelope
    fields: dict[str, Any] = {
        "status": str(decision.status),
        "attempt": d.attempts_used(decision),
        "updated_at": now,
    }
    if isinstance(decision, RetryAfter):
        fields.update(last_error=decision.error, not_before=now + decision.delay)
    elif isinstance(decision, DeadLetter):
        fields.update(reason=decision.reason.value, description=decision.description)
    elif isinstance(decision, Defer):
        fields.update(reason=decision.reason, not_before=decision.until)
    elif isinstance(decision, Complete):
        fields.update(result=jsonable(decision.result))
    elif isinstance(decision, Release):
        fields.update(reason=decision.reason)
    if env is None:
        message_id, tracking_id, type_name = malformed_identity(d.text())
        return MessageRecord(
            message_id=message_id,
            tracking_id=tracking_id,
            type=type_name,
            queue=d.queue,
            created_at=d.received_at,
            raw=d.text()[:65536],
            **fields,
        )
    return MessageRecord(
        message_id=env.message_id,
        tracking_id=env.tracking_id,
        type=env.type,
        queue=env.queue,
        correlation_id=env.correlation_id,
        created_at=env.created_at,
        expires_at=env.expires_at,
        headers=env.headers,
        body=env.body,
        **{"not_before": env.not_before, **fields},
    )


def jsonable(value: Any) -> Any:
    """A handler's result as JSON-ready data (pydantic models dumped; other objects by repr)."""
    if value is None or isinstance(value, str | int | float | bool | list | dict):
        return value
    dump = getattr(value, "model_dump", None)
    return dump(mode="json") if callable(dump) else repr(value)


def log_outcome(s: Settlement) -> None:
    d, decision = s.delivery, s.decision
    env = d.envelope
    level = logging.INFO
    detail = ""
    if d.refused:
        level, detail = logging.WARNING, " not applied: the lease had passed to another run"
    elif isinstance(decision, RetryAfter):
        level, detail = (
            logging.WARNING,
            f" retry in {decision.delay.total_seconds():.1f}s: {decision.error.splitlines()[0]}",
        )
    elif isinstance(decision, DeadLetter):
        first_line = decision.description.splitlines()[0] if decision.description else ""
        level, detail = logging.ERROR, f" {decision.reason.value}: {first_line}"
    elif isinstance(decision, Defer | Release):
        detail = f" ({decision.reason})"
    elif isinstance(decision, Expire):
        detail = f" (expired at {decision.expired_at.isoformat()})"
    if not outcome_log.isEnabledFor(level):
        return
    outcome_log.log(
        level,
        "%s %s%s",
        decision.status,
        env.type if env else "(malformed)",
        detail,
        extra={
            "message_id": str(env.message_id) if env else None,
            "correlation_id": env.correlation_id if env else None,
            "queue": d.queue,
            "attempt": d.attempt,
            "status": str(decision.status),
        },
    )
