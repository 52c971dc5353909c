"""What a handler gets besides its message."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from .envelope import Envelope
from .storable import storable

if TYPE_CHECKING:
    from .app import Subscription
    from .messages import QueueMessage
    from .producer import EnqueueReceipt, Producer


#: the trace of the host invocation feeding this message, ``(traceparent, tracestate)``, when the host
#: has one (Azure Functions): tracing continues it instead of starting a trace of its own
host_trace: ContextVar[tuple[str, str] | None] = ContextVar("queueing_host_trace", default=None)
#: seconds between two stored progress reports of one run
PROGRESS_INTERVAL = 1.0
#: longest progress text kept
MAX_PROGRESS_TEXT = 1000


@dataclass(slots=True)
class HandlerContext:
    envelope: Envelope
    attempt: int
    subscription: Subscription
    message: QueueMessage
    #: set when the host wants the handler to stop (shutdown); check it in long loops
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    log: logging.LoggerAdapter[logging.Logger] = field(
        default_factory=lambda: logging.LoggerAdapter(logging.getLogger("queueing.handler"), {})
    )
    producer: Producer | None = None
    items: dict[str, Any] = field(default_factory=dict)  # for middleware to pass things along
    #: idempotent types: the last successfully processed version of this identity (None: none yet)
    previous: QueueMessage | None = None
    #: the last progress the handler reported (``{"step", "total", "text"}``), stored or not yet
    progress: dict[str, Any] | None = None
    #: where reported progress is stored (the host binds it); None keeps it on the context only
    store_progress: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    _progress_saved_at: float = -PROGRESS_INTERVAL
    _progress_unsaved: bool = False

    @property
    def message_id(self) -> UUID:
        return self.envelope.message_id

    @property
    def tracking_id(self) -> UUID:
        return self.envelope.tracking_id

    @property
    def correlation_id(self) -> str | None:
        return self.envelope.correlation_id

    @property
    def headers(self) -> dict[str, str]:
        return self.envelope.headers

    @property
    def max_attempts(self) -> int:
        return self.subscription.options.max_attempts

    async def report_progress(self, step: int, total: int | None = None, text: str | None = None) -> None:
        """Say how far the handler is (``step`` of ``total``, a short ``text``). Stored with the message
        at most once per :data:`PROGRESS_INTERVAL` seconds (the last report is stored when the handler
        ends); readable by tracking id from code, the ops API and ``queueing show``."""
        if step < 0 or (total is not None and total < 0):
            raise ValueError("progress step and total must not be negative")
        kept = storable((text or "")[:MAX_PROGRESS_TEXT])[0]  # (storable.py: what no store keeps)
        self.progress = {"step": step, "total": total, "text": kept or None}
        self._progress_unsaved = True
        now = time.monotonic()
        if now - self._progress_saved_at >= PROGRESS_INTERVAL or (total is not None and step >= total):
            await self.flush_progress()

    async def flush_progress(self) -> None:
        """Store the last report if it is not stored yet (the pipeline calls this when the run ends)."""
        if not self._progress_unsaved or self.progress is None or self.store_progress is None:
            return
        self._progress_unsaved = False
        self._progress_saved_at = time.monotonic()
        try:
            await self.store_progress(self.progress)
        except Exception as exc:  # progress is advisory: a store outage must not fail the message
            self.log.warning("could not store progress (%s: %s)", type(exc).__name__, exc)

    async def enqueue(self, message: QueueMessage, **kwargs: Any) -> EnqueueReceipt:
        """Enqueue follow-up work; the correlation id flows on unless given."""
        if self.producer is None:
            raise RuntimeError("this context has no producer (the host did not bind one)")
        kwargs.setdefault("correlation_id", self.correlation_id or str(self.message_id))
        return await self.producer.enqueue(message, **kwargs)
