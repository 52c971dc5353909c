"""Idempotent types: a changed body enqueued over a waiting version with other timing runs as it was
enqueued, on every transport. On SQL the waiting row kept the replaced version's expiry and delay (a
review found v2 expired unrun, or slept an hour, where other transports ran it at once)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from queueing_core import MessageStatus, QueueMessage, queue
from tests.contract.harness import running


@queue("review-prices", idempotent=True, identity="sku")
class Price(QueueMessage):
    sku: str
    cents: int


def price_app(harness):
    app = harness.app()
    seen: list[int] = []

    @app.handler()
    async def handle(msg: Price, ctx):
        seen.append(msg.cents)
        return msg.cents

    return app, seen


async def test_a_changed_version_without_a_ttl_is_not_expired_with_the_version_it_replaced(harness):
    """docs/concepts/jobs.md: "one with a changed body makes the handler run once, with the latest
    version ... a requested run is never lost". On SQL the new version only replaced the waiting row's
    body: the row kept the old version's expiry, so the new version (enqueued with no ttl of its own:
    the queue's default, hours away) expired with it and never ran. The other transports send the new
    version as it was enqueued: it runs."""
    app, seen = price_app(harness)
    rt = await harness.runtime(app)
    old = await app.enqueue(Price(sku="T", cents=100), ttl=timedelta(seconds=2))
    new = await app.enqueue(Price(sku="T", cents=90))  # no expiry asked for
    assert new.outcome in ("replaced", "enqueued")
    assert new.expires_at is None or new.expires_at > old.expires_at  # (the queue's default)
    await asyncio.sleep(2.5)  # the old version's expiry passes before any host looks
    async with running(rt):
        try:
            got = await app.result(new.tracking_id, timeout=15)
        except Exception as exc:
            got = f"{type(exc).__name__}: {exc}"
    assert got == 90, (got, seen, old.message_id)
    assert seen == [90]


async def test_a_changed_version_due_now_does_not_wait_for_the_delay_of_the_version_it_replaced(harness):
    """The same on timing: a version enqueued with a long delay, then a changed version due now. The
    receipt says Pending (due now); on SQL the row keeps the old version's not-before and sleeps an
    hour, while on the other transports the new version runs at once."""
    app, seen = price_app(harness)
    rt = await harness.runtime(app)
    await app.enqueue(Price(sku="D", cents=100), delay=timedelta(hours=1))
    new = await app.enqueue(Price(sku="D", cents=80))
    assert new.status == MessageStatus.PENDING  # what the caller is told
    async with running(rt):
        try:
            got = await app.result(new.tracking_id, timeout=10)
        except TimeoutError as exc:
            got = f"TimeoutError: {exc}"
    assert got == 80, (got, seen)
