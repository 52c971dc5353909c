"""What a handler gets besides its message."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from uuid import UUID

from .envelope import Envelope

if TYPE_CHECKING:
    from .app import Subscription
    from .messages import QueueMessage
    from .producer import EnqueueReceipt, Producer


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

    async def enqueue(self, message: QueueMessage, **kwargs: Any) -> EnqueueReceipt:
        """Enqueue follow-up work; the correlation id flows on unless given."""
        if self.producer is None:
            raise RuntimeError("this context has no producer (the host did not bind one)")
        kwargs.setdefault("correlation_id", self.correlation_id or str(self.message_id))
        return await self.producer.enqueue(message, **kwargs)
