"""A serverless queueing kit: single-consumer work queues over SQL, Azure Service Bus, Azure Storage
Queues, RabbitMQ and SQS, with one decision pipeline for every transport and host.

Delivery is at-least-once: a handler can run more than once for the same message (a host can crash
after the handler's side effects and before the result is recorded). Write idempotent handlers.
"""

from importlib.metadata import PackageNotFoundError, version

from .app import QueueingApp, Router, Subscription
from .context import HandlerContext
from .decisions import Complete, DeadLetter, DeadLetterReason, Decision, Defer, Expire, Release, RetryAfter
from .envelope import Envelope
from .errors import (
    ConfigurationError,
    DuplicateHandlerError,
    MalformedEnvelope,
    MessageTooLarge,
    NonRetryableError,
    QueueingError,
    RegistrationError,
    Retry,
)
from .hooks import Event, Observation
from .messages import MessageStatus, QueueMessage, queue
from .naming import QueueNaming, Transport
from .options import CircuitBreakerOptions, Health, QueueOptions, RetryPolicy
from .producer import EnqueueReceipt

try:
    __version__ = version("queueing-kit")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0+source"

__all__ = [
    "CircuitBreakerOptions",
    "Complete",
    "ConfigurationError",
    "DeadLetter",
    "DeadLetterReason",
    "Decision",
    "Defer",
    "DuplicateHandlerError",
    "EnqueueReceipt",
    "Envelope",
    "Event",
    "Expire",
    "HandlerContext",
    "Health",
    "MalformedEnvelope",
    "MessageStatus",
    "MessageTooLarge",
    "NonRetryableError",
    "Observation",
    "QueueMessage",
    "QueueNaming",
    "QueueOptions",
    "QueueingApp",
    "QueueingError",
    "RegistrationError",
    "Release",
    "Retry",
    "RetryAfter",
    "RetryPolicy",
    "Router",
    "Subscription",
    "Transport",
    "__version__",
    "queue",
]
