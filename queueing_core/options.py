"""Per-type queue options, the retry policy and the circuit-breaker settings.

Options are declared partially (``@queue(max_attempts=3)``) and resolved against the app's defaults,
so a deployment can change a default for every type while one type keeps its own value.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Health(StrEnum):
    HEALTHY = "Healthy"
    DEGRADED = "Degraded"
    UNHEALTHY = "Unhealthy"


class RetryPolicy(BaseModel):
    """Exponential backoff with proportional jitter: ``base * factor**(attempt-1)``, capped, ±jitter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: timedelta = timedelta(seconds=1)
    factor: float = Field(default=2.0, ge=1.0)
    max_delay: timedelta = timedelta(minutes=5)
    jitter: float = Field(default=0.2, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check(self) -> Self:
        # a negative wait was clamped to "retry at once" where it was used: refused here instead,
        # where the mistake is made, so a policy means what it says
        if self.base < timedelta(0):
            raise ValueError("retry base must not be negative")
        if self.max_delay < timedelta(0):
            raise ValueError("retry max_delay must not be negative")
        return self

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> timedelta:
        """Delay before the retry that follows failed attempt number ``attempt`` (1-based)."""
        exponent = max(0, attempt - 1)
        # Cap the exponent before raising so a large attempt count cannot overflow a float.
        raw = min(
            self.base.total_seconds() * self.factor ** min(exponent, 64), self.max_delay.total_seconds()
        )
        spread = raw * self.jitter
        seconds = min(self.max_delay.total_seconds(), max(0.0, raw - spread + 2 * spread * rand()))
        try:
            return timedelta(seconds=seconds)
        except OverflowError:
            # a cap of ``timedelta.max`` ("no cap"), whose seconds as a float round past it: raised
            # here, it failed the pipeline on every run of the message (the pipeline bounds it)
            return self.max_delay


class CircuitBreakerOptions(BaseModel):
    """Open after ``failure_threshold`` consecutive failures; hold work for ``cooldown``; then one probe."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    failure_threshold: int = Field(default=5, ge=1)
    cooldown: timedelta = timedelta(seconds=30)
    #: how long a half-open probe may run before another message may probe instead; at least 5 s, so
    #: that the probe a late report names (its time, kept to the second by some stores) is told apart
    #: from the one that replaced it
    probe_timeout: timedelta = Field(default=timedelta(minutes=5), ge=timedelta(seconds=5))

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.cooldown < timedelta(0):
            raise ValueError("circuit breaker cooldown must not be negative")
        return self


LeaseExpiry = Literal["retry", "abandon"]

#: FastEndpoints' default: work not done within four hours is stale.
DEFAULT_EXPIRATION = timedelta(hours=4)


class QueueOptions(BaseModel):
    """Options of one message type's queue. Unset fields inherit the app's defaults.

    ``expiration=None`` means messages never expire; ``time_limit=None`` means no execution limit.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str | None = Field(default=None, description="logical queue name; default: the type name")
    type_name: str | None = Field(default=None, description="name on the wire; default: the class name")
    category: str | None = None
    max_attempts: int = Field(default=5, ge=1, le=10_000)
    retry: RetryPolicy = RetryPolicy()
    expiration: timedelta | None = DEFAULT_EXPIRATION
    lease_duration: timedelta = timedelta(seconds=30)
    lease_expired: LeaseExpiry = "retry"
    max_concurrency: int = Field(default_factory=lambda: os.cpu_count() or 1, ge=1, le=10_000)
    time_limit: timedelta | None = None
    #: how long a handler whose message is cancelled may take to stop by itself (it sees
    #: ``ctx.cancelled``) before it is cancelled as an asyncio task
    cancel_grace: timedelta = timedelta(seconds=10)
    ordered: bool = False
    idempotent: bool = False
    #: an idempotent type's identity: a field name of the message, or a function of the message
    identity: str | Callable[[Any], Any] | None = None
    keep_processed_for: timedelta | None = None
    default_status: str = "Pending"
    health_when_errors: Health = Health.UNHEALTHY
    circuit_breaker: CircuitBreakerOptions | None = None
    example: Any = Field(default=None, description="an example body (dict) shown by the ops API")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.lease_duration <= timedelta(0):
            raise ValueError("lease_duration must be positive")
        if self.time_limit is not None and self.time_limit <= timedelta(0):
            raise ValueError("time_limit must be positive or None")
        if self.cancel_grace < timedelta(0):
            raise ValueError("cancel_grace must not be negative")
        if self.idempotent and self.identity is None:
            raise ValueError("idempotent types need an identity: a field name or a function of the message")
        if self.expiration is not None and self.expiration <= timedelta(0):
            raise ValueError("expiration must be positive or None")
        if self.keep_processed_for is not None and self.keep_processed_for < timedelta(0):
            raise ValueError("keep_processed_for must not be negative")
        if self.ordered and self.max_concurrency != 1 and "max_concurrency" in self.model_fields_set:
            raise ValueError("ordered queues process one message at a time: max_concurrency must be 1")
        return self

    def merged_over(self, defaults: QueueOptions) -> QueueOptions:
        """These options with every field not explicitly set taken from ``defaults``."""
        update = {k: getattr(self, k) for k in self.model_fields_set}
        merged = defaults.model_copy(update=update)
        if merged.ordered:
            merged = merged.model_copy(update={"max_concurrency": 1})
        # re-validate the combination (model_copy skips validation)
        return QueueOptions.model_validate(merged.model_dump(exclude_unset=False))
