"""Service Bus: a receiver whose handler a connection error shut down.

The SDK closes a receiver's handler when an operation fails with a connection error, and from then on
refuses every renewal and settlement with a ValueError ("Failed to renew the message as the handler has
already been shutdown.") before trying to reconnect; only a receive or a management call (a peek)
opens it again (``tests/unit/test_servicebus_sdk_fidelity.py`` holds the stand-in to that against the
SDK's own receiver). The provider did not handle the refusal: it left ``renew`` and ended every later
round of renewals, and the worker receives only when a slot is free, so with every slot held by a long
run nothing opened the receiver again: the lock lapsed under the running handler and the message ran a
second time. A settlement raised the SDK's bare ValueError (found in review).

Errors are the SDK's own exception, raised in place of the stand-in's call as the fault suite raises
them; the stand-in then leaves its receiver as the SDK would.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from azure.core.exceptions import ClientAuthenticationError
from azure.servicebus import ServiceBusSubQueue
from azure.servicebus.exceptions import ServiceBusConnectionError

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.errors import ProviderError, ProviderUnavailable
from queueing_core.fakes.servicebus import FakeServiceBusNamespace, FakeServiceBusReceiver
from queueing_core.providers import servicebus as sb_provider
from queueing_core.testing import in_memory_servicebus
from queueing_core.transport import Settlement
from tests.contract.harness import record, running, wait_until


@queue("sb-shut-work", lease_duration=timedelta(seconds=3), max_concurrency=1, max_attempts=3)
class Work(QueueMessage):
    n: int = 0


def _connection_lost() -> ServiceBusConnectionError:
    return ServiceBusConnectionError(message="injected: connection reset by peer")


@contextlib.contextmanager
def _fails(monkeypatch: pytest.MonkeyPatch, operation: str, times: int = 1) -> Iterator[list[int]]:
    """The receiver's ``operation`` fails with a connection error its next ``times`` calls (the SDK's
    retries used up); yields the count of calls made to it."""
    real = getattr(FakeServiceBusReceiver, operation)
    calls: list[int] = []

    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            raise _connection_lost()
        return await real(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(FakeServiceBusReceiver, operation, call)
        yield calls


async def _runtime(handler: Any = None) -> Any:
    app = QueueingApp("sb-shut")

    async def handle(msg: Work) -> None:
        return None

    app.handler()(handler or handle)
    rt = in_memory_servicebus(app, FakeServiceBusNamespace(), provider_options={"receive_wait": 0.1})
    await rt.open()
    return rt


async def _held(rt: Any, n: int) -> list[Any]:
    for i in range(n):
        await rt.app.enqueue(Work(n=i))
    got = await rt.provider.receive(rt.app.subscription("Work"), n)
    assert len(got) == n
    return sorted(got, key=lambda d: d.handle.message.sequence_number)


async def _shut_down(rt: Any, monkeypatch: pytest.MonkeyPatch, held: Any) -> None:
    """One renewal fails with a connection error: the receiver's handler is shut down."""
    with _fails(monkeypatch, "renew_message_lock"):
        assert await rt.provider.renew([held]) == [held]  # (that round's renewal failed)
    with pytest.raises(ValueError, match="handler has already been shutdown"):
        await held.handle.receiver.renew_message_lock(held.handle.message)


async def test_a_long_run_keeps_its_lock_through_a_connection_error_on_a_renewal(monkeypatch) -> None:
    runs: list[int] = []

    async def handle(msg: Work, ctx: Any) -> None:
        runs.append(ctx.attempt)
        await asyncio.sleep(6)  # twice the lock: renewals keep it, the worker's only slot held

    rt = await _runtime(handle)
    try:
        receipt = await rt.app.enqueue(Work())
        with _fails(monkeypatch, "renew_message_lock") as renewals:
            async with running(rt):

                async def settled() -> bool:
                    return (await record(rt, receipt.message_id)).status == MessageStatus.SUCCEEDED

                await wait_until(settled, timeout=30)
        assert len(renewals) > 2  # (the failed renewal, and the ones after it)
        assert runs == [1], "the lock lapsed under the running handler and the message ran again"
        physical = rt.provider.physical("sb-shut-work")
        props = await rt.provider.admin.get_queue_runtime_properties(physical)
        assert (props.active_message_count, props.dead_letter_message_count) == (0, 0)
    finally:
        await rt.close()


async def test_a_renewal_after_the_receiver_was_shut_down_opens_it_again_once(monkeypatch) -> None:
    rt = await _runtime()
    try:
        first, second = await _held(rt, 2)
        await _shut_down(rt, monkeypatch, first)
        before = (first.lease_until, second.lease_until)
        peeks: list[Any] = []
        real_peek = FakeServiceBusReceiver.peek_messages

        async def peek(self: Any, *args: Any, **kwargs: Any) -> Any:
            peeks.append(kwargs.get("sequence_number"))
            found = await real_peek(self, *args, **kwargs)
            assert found == [], "opening the receiver again must find (and lock) nothing"
            return found

        monkeypatch.setattr(FakeServiceBusReceiver, "peek_messages", peek)
        await asyncio.sleep(0.01)
        assert await rt.provider.renew([first, second]) == []
        assert (first.lease_until, second.lease_until) != before
        assert first.lease_until > before[0]
        assert second.lease_until > before[1]
        assert peeks == [2**63 - 1], "one peek opens the receiver for every renewal of the round"
    finally:
        await rt.close()


async def test_a_settlement_after_the_receiver_was_shut_down_goes_through(monkeypatch) -> None:
    rt = await _runtime()
    try:
        [held] = await _held(rt, 1)
        await _shut_down(rt, monkeypatch, held)
        await rt.provider.settle([Settlement(held, Complete())])
        assert not held.refused
        physical = rt.provider.physical("sb-shut-work")
        props = await rt.provider.admin.get_queue_runtime_properties(physical)
        assert props.active_message_count == 0, "the completion was not applied"
    finally:
        await rt.close()


async def test_when_the_receiver_cannot_be_opened_again_the_kit_says_the_service_is_away(monkeypatch) -> None:
    rt = await _runtime()
    try:
        [held] = await _held(rt, 1)
        await _shut_down(rt, monkeypatch, held)
        with _fails(monkeypatch, "peek_messages", times=10):  # still away: opening it again fails
            with pytest.raises(ProviderUnavailable):
                await rt.provider.settle([Settlement(held, Complete())])
            assert await rt.provider.renew([held]) == [held]
        # once it answers again, the message is still held and settles
        await rt.provider.settle([Settlement(held, Complete())])
        async with rt.provider.client.get_queue_receiver(
            rt.provider.physical("sb-shut-work"), sub_queue=ServiceBusSubQueue.DEAD_LETTER
        ) as r:
            assert await r.peek_messages(max_message_count=5) == []
    finally:
        await rt.close()


def test_the_sdks_refusal_of_a_shut_down_receiver_is_the_service_being_away() -> None:
    refusal = ValueError(
        "Failed to complete the message as the handler has already been shutdown."
        "Please use ServiceBusClient to create a new instance."
    )
    with pytest.raises(ProviderUnavailable), sb_provider._boundary("settling messages"):
        raise refusal
    # a receiver the kit closed itself is not the service's doing: left as it is
    closed = ValueError(
        "The handler has already been shutdown. Please use ServiceBusClient to create a new instance."
    )
    with pytest.raises(ValueError, match="The handler") as caught, sb_provider._boundary("settling"):
        raise closed
    assert caught.value is closed


async def test_a_renewal_failing_otherwise_ends_only_its_own_renewal() -> None:
    """One delivery's renewal failing with an error that is not Service Bus's (here azure-core's: the
    credential could not get a token while the link opened again) left ``renew`` and ended the round:
    the other deliveries' results were dropped."""
    rt = await _runtime()
    try:
        first, second = await _held(rt, 2)
        receiver = first.handle.receiver
        real = receiver.renew_message_lock

        async def renew(message: Any, *, timeout: float | None = None) -> Any:
            if message.sequence_number == first.handle.message.sequence_number:
                raise ClientAuthenticationError("injected: could not get a token")
            return await real(message, timeout=timeout)

        receiver.renew_message_lock = renew
        before = second.lease_until
        await asyncio.sleep(0.01)
        assert await rt.provider.renew([first, second]) == [first]
        assert second.lease_until > before
        # every one of a round failing so: the round fails, in the kit's terms
        with pytest.raises(ProviderError, match="signing in"):
            await rt.provider.renew([first])
    finally:
        await rt.close()
