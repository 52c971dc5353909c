"""When the worker renews a lease: by each message's own lease as the transport holds it.

Judged by the app's shortest lease, a message of a type with a long lease was renewed only once less
than two thirds of the *shortest* lease was left of it: a 6 s lease beside a 1.5 s one had under 1 s
to spare, and a stall of the event loop lost it (the sweep dead-lettered a message whose handler then
succeeded). And a lease the transport caps (Service Bus locks a message at most 5 minutes) was first
renewed a third of the type's own lease later: a 20-minute lease after 400 s, its lock lapsed at 300
(both found by reviews)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.runtime import Runtime
from queueing_core.transport import Capabilities, Delivery
from queueing_core.worker import Worker
from tests.envelopes import an_envelope


@queue("renew-long", lease_duration=timedelta(seconds=6))
class LongLease(QueueMessage):
    n: int = 0


@queue("renew-short", lease_duration=timedelta(seconds=1.5))
class ShortLease(QueueMessage):
    n: int = 0


@queue("renew-report", lease_duration=timedelta(minutes=20))
class LongReport(QueueMessage):
    n: int = 0


class Renews:
    """A provider that only renews (what the renewal loop asks of it), recording what it was asked."""

    def __init__(self, longest_lease: timedelta | None = None) -> None:
        self.capabilities = Capabilities(longest_lease=longest_lease)
        self.renewed: list[list[Delivery]] = []

    async def renew(self, deliveries: list[Delivery]) -> list[Delivery]:
        self.renewed.append(list(deliveries))
        return []


def held(type_name: str, left: timedelta) -> Delivery:
    env = an_envelope(type_name, "q")
    return Delivery("q", env.encode(), env, None, 1, lease_until=utcnow() + left)


async def ticks(worker: Worker, monkeypatch: pytest.MonkeyPatch, count: int) -> list[float]:
    """Run the renewal loop for ``count`` ticks, its sleeps not waited; return what it slept."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > count:
            raise asyncio.CancelledError
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await worker._renew_loop()
    monkeypatch.setattr(asyncio, "sleep", real_sleep)
    return slept


def worker_of(provider: Renews, *types: type[QueueMessage]) -> Worker:
    app = QueueingApp("renewal")
    for t in types:
        _handle(app, t)
    return Worker(Runtime(app, provider))  # type: ignore[arg-type]


def _handle(app: QueueingApp, message_type: type[QueueMessage]) -> None:
    async def handle(msg) -> None:
        return None

    handle.__annotations__ = {"msg": message_type, "return": None}
    app.handler()(handle)


async def test_a_long_lease_is_renewed_by_its_own_length_beside_a_short_one(monkeypatch) -> None:
    provider = Renews()
    worker = worker_of(provider, LongLease, ShortLease)
    # 2.1 s into its 6 s lease: past a third of it, so renewed now; judged by the 1.5 s lease it was
    # left until under 1 s remained
    d = held("LongLease", timedelta(seconds=3.9))
    worker._in_flight[id(d)] = d
    await ticks(worker, monkeypatch, 1)
    assert [d in batch for batch in provider.renewed] == [True]


async def test_a_lease_the_transport_caps_is_renewed_within_the_cap(monkeypatch) -> None:
    provider = Renews(longest_lease=timedelta(minutes=5))
    worker = worker_of(provider, LongReport)
    d = held("LongReport", timedelta(seconds=150))  # half of its 5-minute lock left
    worker._in_flight[id(d)] = d
    slept = await ticks(worker, monkeypatch, 1)
    # the first renewal comes within a third of the lock, not a third of the 20-minute lease (400 s:
    # the lock had lapsed at 300)
    assert slept[0] <= 100
    assert [d in batch for batch in provider.renewed] == [True]


def test_service_bus_says_how_long_it_locks_a_message_at_most() -> None:
    # (what the worker's renewal is timed by: a queue's lock is its type's lease, capped at this)
    from queueing_core.infra import MAX_LOCK
    from queueing_core.testing import in_memory_servicebus

    app = QueueingApp("renewal")
    _handle(app, LongReport)
    assert in_memory_servicebus(app).provider.capabilities.longest_lease == MAX_LOCK == timedelta(minutes=5)
