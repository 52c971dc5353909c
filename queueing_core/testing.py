"""Helpers for your own tests: an in-process runtime and ``run_until_idle``.

runtime = in_process(app)
await app.enqueue(OrderPlaced(order_id="1"))
await run_until_idle(runtime)          # re-raises the first handler exception
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .decisions import Defer, Release
from .hooks import Event, Observation
from .runtime import Runtime

if TYPE_CHECKING:
    from .app import QueueingApp


class HandlerFailed(AssertionError):
    """Raised by :func:`run_until_idle` when a handler failed and the caller asked to see it."""


def in_process(app: QueueingApp, **kwargs: Any) -> Runtime:
    """A runtime on the in-process provider with in-memory control and history."""
    from .providers.inprocess import InProcessProvider

    return Runtime(app, InProcessProvider(), **kwargs)


async def run_until_idle(runtime: Runtime, *, raise_errors: bool = True, max_messages: int = 100_000) -> int:
    """Process every message that is due now, one at a time, until none is left; return the count.

    Messages deferred or retried into the future are left for later (use a short retry policy or
    ``Retry(after=0)`` to see retries run within one call). With ``raise_errors`` the first exception
    a handler raised is re-raised here, with the original as its cause.
    """
    await runtime.open()
    errors: list[BaseException] = []

    def capture(obs: Observation) -> None:
        if obs.error is not None:
            errors.append(obs.error)

    hooks = runtime.app.hooks
    hooks.on(Event.FAILED, Event.DEAD_LETTERED)(capture)
    processed = 0
    try:
        progress = True
        while progress and processed < max_messages:
            progress = False
            for sub in runtime.app.subscriptions():
                if sub.handler is None:
                    continue
                for delivery in await runtime.provider.receive(sub, 100):
                    settlement = await runtime.process_and_settle(delivery)
                    processed += 1
                    # a message handed back for "now" would spin forever; only real work is progress
                    if not isinstance(settlement.decision, Defer | Release):
                        progress = True
                    if errors and raise_errors:
                        raise HandlerFailed(f"handler failed: {errors[0]!r}") from errors[0]
    finally:
        hooks.off(capture)
    return processed


def in_memory_servicebus(app: QueueingApp, namespace: Any = None, **kwargs: Any) -> Runtime:
    """A runtime on the real Service Bus provider pointed at :class:`FakeServiceBusNamespace`, an
    in-memory stand-in that keeps Service Bus's peek-lock, delivery count, dead-letter, TTL and
    scheduling semantics. Control state and history are in memory unless given."""
    from .control import MemoryControlStore
    from .fakes.servicebus import (
        FakeServiceBusAdministrationClient,
        FakeServiceBusClient,
        FakeServiceBusNamespace,
    )
    from .providers.servicebus import ServiceBusProvider
    from .tracking import MemoryTracker

    # ``is None``, not ``or``: an empty tracker has no length, and was taken for "not given"
    ns = FakeServiceBusNamespace() if namespace is None else namespace
    control, tracker = kwargs.pop("control", None), kwargs.pop("tracker", None)
    provider = ServiceBusProvider(
        client=FakeServiceBusClient(ns),
        admin=FakeServiceBusAdministrationClient(ns),
        control=MemoryControlStore() if control is None else control,
        tracker=MemoryTracker() if tracker is None else tracker,
        **kwargs.pop("provider_options", {}),
    )
    return Runtime(app, provider, **kwargs)


__all__ = ["HandlerFailed", "in_memory_servicebus", "in_process", "run_until_idle"]
