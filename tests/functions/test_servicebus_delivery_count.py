"""Service Bus attempts as the Functions host delivers them: messages built from AMQP bytes in the host's
shape and decoded by the binding extension's own decoder, never by hand (see servicebus_host.py)."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
import uamqp
from azure.servicebus import ServiceBusSubQueue

from functions import build_app
from functions.host import FunctionsHost
from functions.servicebus_delivery import capture_delivery_counts, delivery_number
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.settings import QueueingSettings
from queueing_core.testing import in_memory_servicebus

from .conftest import functions_of, user
from .servicebus_host import (
    CAPTURED_CONTENT,
    HostActions,
    amqp_bytes,
    as_delivered,
    decode_as_worker,
    host_delivers,
)

MAX_ATTEMPTS = 4
ENV = {
    "QueueingServiceBus": "Endpoint=sb://fake/;SharedAccessKeyName=k;SharedAccessKey=v",
    "QueueingStorage": "UseDevelopmentStorage=true",
}


@queue("fn-count", max_attempts=MAX_ATTEMPTS, lease_duration=timedelta(seconds=30))
class Flaky(QueueMessage):
    n: int = 0


class Crash(BaseException):
    """The worker process dying mid-handler: nothing in the kit catches it, nothing is settled."""


def test_host_bytes_match_the_payload_the_extension_was_captured_with() -> None:
    # the extension's own test payload, captured from the host, decoded by the extension ...
    captured = decode_as_worker(CAPTURED_CONTENT, None)
    header = uamqp.Message().decode_from_bytes(CAPTURED_CONTENT[16:]).header
    # ... and the same message written by this suite's host stand-in
    ours = decode_as_worker(
        captured.lock_token.bytes_le
        + amqp_bytes(
            delivery_count=header.delivery_count,
            lock_token=captured.lock_token,
            body=b"".join(captured.body),
            message_id=captured.message_id,
            sequence_number=captured.sequence_number,
            enqueued_time=captured.enqueued_time_utc,
            locked_until=captured.locked_until_utc,
            time_to_live_ms=header.time_to_live,
        ),
        None,
    )
    for name in ("message_id", "sequence_number", "lock_token", "enqueued_time_utc", "locked_until_utc"):
        assert getattr(ours, name) == getattr(captured, name), name
    assert b"".join(ours.body) == b"".join(captured.body) == b"hello"
    # the captured header says delivery 1 (.NET counts from 1); the extension drops it for both
    assert header.delivery_count == 1
    assert captured.delivery_count is None
    assert ours.delivery_count is None


def _content(delivery_count: int) -> bytes:
    token = uuid.uuid4()
    return token.bytes_le + amqp_bytes(
        delivery_count=delivery_count,
        lock_token=token,
        body=b"{}",
        message_id="m-1",
        sequence_number=5,
        enqueued_time=datetime(2026, 1, 1, tzinfo=UTC),
        locked_until=datetime(2026, 1, 1, 0, 1, tzinfo=UTC),
    )


@pytest.mark.parametrize(
    ("header", "metadata", "expected"),
    [
        (3, 3, 3),  # the host passes both; they agree
        (3, None, 3),  # no trigger metadata: the header, read from the host's bytes
        (1, 2, 2),  # the trigger metadata wins
    ],
)
def test_the_delivery_number_survives_the_extensions_decoder(header, metadata, expected) -> None:
    capture_delivery_counts()
    capture_delivery_counts()  # idempotent: one wrapper, not two
    msg = decode_as_worker(_content(header), metadata)
    assert msg.delivery_count is None  # what the extension alone gives
    assert delivery_number(msg) == expected


@pytest.fixture
async def flaky_host():
    clock = FakeClock(datetime.now(UTC))
    ns = FakeServiceBusNamespace(clock=clock)
    app = QueueingApp("fn-count")
    attempts: list[int] = []
    crash_until = {"attempt": 0}

    @app.handler()
    async def handle(msg: Flaky, ctx) -> None:
        attempts.append(ctx.attempt)
        raise RuntimeError(f"failed on attempt {ctx.attempt}")

    rt = in_memory_servicebus(app, ns)
    decide = rt.pipeline.process

    async def dies_after_the_run(delivery, **kwargs):
        # (the process dies after the handler ran, before anything is settled; a handler's own raise of
        # any kind is a failed attempt the kit settles)
        before = len(attempts)
        decision = await decide(delivery, **kwargs)
        if len(attempts) > before and attempts[-1] <= crash_until["attempt"]:
            raise Crash
        return decision

    rt.pipeline.process = dies_after_the_run
    cfg = QueueingSettings(provider="servicebus")
    host = FunctionsHost(app, cfg, runtime=rt)
    fn = user(functions_of(build_app(cfg, app, host=host, env=ENV))["servicebus_fn_count"])
    await rt.open()
    receiver = rt.provider.client.get_queue_receiver("fn-count")
    yield SimpleNamespace(
        app=app, rt=rt, fn=fn, receiver=receiver, clock=clock, attempts=attempts, crash_until=crash_until
    )
    await receiver.close()
    await rt.close()


async def test_a_redelivered_message_counts_an_attempt_and_is_dead_lettered_after_max_attempts(flaky_host):
    h = flaky_host
    h.crash_until["attempt"] = MAX_ATTEMPTS - 1  # the process dies holding it, then fails for good
    sent = await h.app.enqueue(Flaky())
    for _ in range(MAX_ATTEMPTS - 1):
        with pytest.raises(Crash):
            await host_delivers(h.receiver, h.fn)
        h.clock.advance(timedelta(seconds=31))  # the lock lapses; the broker counts the delivery
    actions = await host_delivers(h.receiver, h.fn)

    assert h.attempts == [1, 2, 3, 4]
    [(action, _, kw)] = actions.done
    assert action == "deadletter"
    assert kw["reason"] == "MaxDeliveryAttemptsExceeded"
    assert f"attempt {MAX_ATTEMPTS} of {MAX_ATTEMPTS}" in kw["error_description"]
    async with h.rt.provider.client.get_queue_receiver(
        "fn-count", sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as r:
        [dead] = await r.peek_messages(max_message_count=5)
    assert dead.dead_letter_reason == "MaxDeliveryAttemptsExceeded"
    assert (await h.rt.tracker.get(sent.message_id)).status == "DeadLettered"


async def test_copies_carry_their_attempts_and_redeliveries_of_a_copy_add_to_them(flaky_host):
    h = flaky_host
    await h.app.enqueue(Flaky())
    actions = await host_delivers(h.receiver, h.fn)  # attempt 1 fails: a copy scheduled for the backoff
    assert [a for a, _, _ in actions.done] == ["complete"]
    h.clock.advance(timedelta(minutes=10))  # the copy's schedule comes due
    h.crash_until["attempt"] = 2
    with pytest.raises(Crash):
        await host_delivers(h.receiver, h.fn)  # the copy's first delivery: attempt 2, and the process dies
    h.clock.advance(timedelta(seconds=31))
    actions = await host_delivers(h.receiver, h.fn)  # the copy redelivered: attempt 3, a retry again
    assert h.attempts == [1, 2, 3]
    assert [a for a, _, _ in actions.done] == ["complete"]


async def test_without_trigger_metadata_the_header_in_the_hosts_bytes_still_counts(flaky_host):
    h = flaky_host
    h.crash_until["attempt"] = 1
    await h.app.enqueue(Flaky())
    with pytest.raises(Crash):
        await host_delivers(h.receiver, h.fn, metadata=False)
    h.clock.advance(timedelta(seconds=31))
    await host_delivers(h.receiver, h.fn, metadata=False)
    assert h.attempts == [1, 2]


async def test_the_decoded_message_is_the_sdks_own_with_the_brokers_lock_token(flaky_host):
    h = flaky_host
    sent = await h.app.enqueue(Flaky(n=7))
    [received] = await h.receiver.receive_messages(max_message_count=1, max_wait_time=1)
    msg = as_delivered(received)
    from azure.servicebus import ServiceBusReceivedMessage

    assert type(msg) is ServiceBusReceivedMessage
    assert msg.lock_token == received.lock_token
    assert msg.message_id == str(sent.message_id)
    assert delivery_number(msg) == 1


async def test_settlement_calls_run_off_the_event_loop(flaky_host):
    """``ServiceBusMessageActions`` blocks on gRPC: on the loop it would stall every other invocation."""
    h = flaky_host
    loop_thread = threading.get_ident()
    threads: list[int] = []

    class BlockingActions(HostActions):
        def _record(self, action, message, **kw):
            threads.append(threading.get_ident())
            super()._record(action, message, **kw)

    await h.app.enqueue(Flaky())
    [received] = await h.receiver.receive_messages(max_message_count=1, max_wait_time=1)
    actions = BlockingActions()
    await h.fn(as_delivered(received), actions)
    assert [a for a, _, _ in actions.done] == ["complete"]
    assert threads
    assert loop_thread not in threads


async def test_a_message_whose_every_run_dies_is_dead_lettered_by_the_kit_with_its_reason(flaky_host):
    """Every run dies holding the message (the process, a timeout, a lost lock): nothing is settled.
    With the queue's max delivery count equal to max_attempts the broker moved it to the dead-letter
    queue itself after the last run (MaxDeliveryCountExceeded), and its history stayed Pending (a
    review found it). One delivery more reaches the kit, which dead-letters it with its reason and
    records it, running nothing."""
    h = flaky_host
    h.crash_until["attempt"] = 100
    sent = await h.app.enqueue(Flaky())
    for _ in range(MAX_ATTEMPTS):
        with pytest.raises(Crash):
            await host_delivers(h.receiver, h.fn)
        h.clock.advance(timedelta(seconds=31))  # the lock lapses; the broker counts the delivery
    actions = await host_delivers(h.receiver, h.fn)
    assert h.attempts == [1, 2, 3, 4]  # the last delivery runs nothing
    [(action, _, kw)] = actions.done
    assert action == "deadletter"
    assert kw["reason"] == "MaxDeliveryAttemptsExceeded"
    assert f"delivered {MAX_ATTEMPTS} times for {MAX_ATTEMPTS} attempts" in kw["error_description"]
    assert (await h.rt.tracker.get(sent.message_id)).status == "DeadLettered"


async def test_a_brief_outage_of_the_kits_store_is_waited_out_within_the_invocation(flaky_host, monkeypatch):
    """The control store (Azure Tables) away for a moment: the invocation raised at once, the host
    handed the message back at once with a delivery counted, and within milliseconds every delivery
    was spent and the broker dead-lettered it, unrun and unrecorded (a review found it). The
    invocation now waits the outage out; a longer one still raises, to the host's retry."""
    import functions.host as host_module
    from queueing_core.errors import ProviderUnavailable

    h = flaky_host
    inner = h.rt.control.inner
    real_state = inner.state
    down = {"calls": 2}

    async def tables_down_for_two_reads():
        if down["calls"]:
            down["calls"] -= 1
            raise ProviderUnavailable("Tables: connection refused")
        return await real_state()

    monkeypatch.setattr(inner, "state", tables_down_for_two_reads)
    h.rt.control.invalidate()
    await h.app.enqueue(Flaky())
    actions = await host_delivers(h.receiver, h.fn)  # no raise: waited out
    assert down["calls"] == 0
    assert h.attempts == [1]  # the handler ran (and failed: a retry copy)
    assert [a for a, _, _ in actions.done] == ["complete"]

    monkeypatch.setattr(host_module, "KIT_OUTAGE_WAIT", 1.0)
    down["calls"] = 1_000  # a long outage
    h.clock.advance(timedelta(minutes=10))  # the retry copy comes due
    h.rt.control.invalidate()
    with pytest.raises(ProviderUnavailable):
        await host_delivers(h.receiver, h.fn)
    assert h.attempts == [1]


async def test_a_brief_outage_of_service_bus_as_a_copy_is_sent_is_waited_out_within_the_invocation(
    flaky_host,
):
    """A paused type's message is deferred by a copy for later; Service Bus throttling that send for a
    moment raised out of the invocation at once, the host handed the message back with a delivery
    counted, and a few such moments let the broker dead-letter a paused message that never ran (found
    in review). The send is now waited out as the kit's stores' outages are."""
    from queueing_core.errors import ProviderUnavailable

    h = flaky_host
    await h.rt.control.set_paused("type", "Flaky", True)
    real = h.rt.provider.send_copy
    tries: list[str] = []

    async def busy_twice(*args, **kwargs):
        tries.append("send_copy")
        if len(tries) <= 2:
            raise ProviderUnavailable("Service Bus unreachable or busy during re-sending: ServerBusy")
        return await real(*args, **kwargs)

    h.rt.provider.send_copy = busy_twice
    await h.app.enqueue(Flaky())
    actions = await host_delivers(h.receiver, h.fn)  # no raise: waited out
    assert tries == ["send_copy"] * 3
    assert [a for a, _, _ in actions.done] == ["complete"]
    assert h.attempts == []  # paused: nothing ran
    props = await h.rt.provider.admin.get_queue_runtime_properties("fn-count")
    assert (props.active_message_count, props.scheduled_message_count) == (0, 1)  # the copy, for later
