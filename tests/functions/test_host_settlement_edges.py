"""The Functions host at the edges of a settlement, against the settlement invariant: a run whose Service
Bus lock lapsed sends no retry copy; an original left behind after its copy is completed as a known
duplicate, not run again; the retention timer prunes the Tables history on Service Bus; a body nested
deeper than ``json`` can go is dead-lettered as malformed on both triggers; a body whose model's
validator raises (not a ValidationError) is dead-lettered once, with its reason, and so is a message
whose reason is too long for the host in UTF-16 though not in code points. With the real
``azure-functions`` types and, for Service Bus, messages decoded by the binding extension's own decoder
(servicebus_host.py); Storage Queues run on Azurite."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import azure.functions.queue as azq
import pydantic
import pytest
from azure.functions.timer import TimerRequest
from azure.servicebus import ServiceBusSubQueue
from azure.storage.queue.aio import QueueClient
from azurefunctions.extensions.bindings.servicebus.serviceBusMessageActions import SettlementError

from functions import build_app
from functions.host import FunctionsHost
from queueing_core import NonRetryableError, QueueingApp, QueueMessage, Retry, queue
from queueing_core.clock import utcnow
from queueing_core.fakes.servicebus import FakeClock, FakeServiceBusNamespace
from queueing_core.providers.storage_queue import decode_body
from queueing_core.providers.tables import tables_from_connection
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from queueing_core.testing import in_memory_servicebus
from queueing_core.tracking import MessageRecord

from .conftest import functions_of, user
from .servicebus_host import as_delivered

LOCK = timedelta(seconds=30)
SB_ENV = {
    "QueueingServiceBus": "Endpoint=sb://fake/;SharedAccessKeyName=k;SharedAccessKey=v",
    "QueueingStorage": "UseDevelopmentStorage=true",
}


@queue("rv-sb", max_attempts=5, lease_duration=LOCK)
class Work(QueueMessage):
    n: int = 0


@queue("rv-st", max_attempts=5)
class Stored(QueueMessage):
    n: int = 0


# -- the host's Service Bus side, settling on the broker as it is told ----------------------------------
@dataclass
class LiveActions:
    """Stands in for ``ServiceBusMessageActions`` (whose constructor needs the worker's gRPC channel) and,
    unlike ``HostActions``, settles on the in-memory broker at once, as the real one does over gRPC: a
    lock that has lapsed fails the call there and then. Its calls are synchronous, as the real ones are;
    they must run off the event loop (the kit runs them in a thread), and do the broker's work on it.
    A failure is raised as the extension raises it: ``SettlementError``."""

    loop: asyncio.AbstractEventLoop
    receiver: Any
    received: dict[uuid.UUID, Any] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    #: completes that fail before reaching the broker (a gRPC call to the host that breaks)
    failing_completes: int = 0
    #: settlements applied on the broker whose answer is lost on the way back (raised all the same)
    lost_answers: int = 0
    #: made on the event loop's thread (the tests build it there)
    loop_thread: int = field(default_factory=threading.get_ident)

    def _run(self, method: str, message: Any, make: Any) -> None:
        if threading.get_ident() == self.loop_thread:
            raise RuntimeError(f"{method} called on the event loop: the real call would block it")
        try:
            asyncio.run_coroutine_threadsafe(make(self.received[message.lock_token]), self.loop).result(10)
        except Exception as exc:
            raise SettlementError(method, f"Failed to {method} message {message.lock_token}", exc) from exc
        self.done.append(method)
        if self.lost_answers:
            self.lost_answers -= 1
            raise SettlementError(method, f"Failed to {method} message", ConnectionError("gRPC answer lost"))

    def complete(self, message: Any) -> None:
        if self.failing_completes:
            self.failing_completes -= 1
            raise SettlementError("complete", "Failed to complete message", ConnectionError("gRPC"))
        self._run("complete", message, self.receiver.complete_message)

    def abandon(self, message: Any) -> None:
        self._run("abandon", message, self.receiver.abandon_message)

    def deadletter(
        self,
        message: Any,
        deadletter_reason: str | None = None,
        deadletter_error_description: str | None = None,
    ) -> None:
        self._run(
            "deadletter",
            message,
            lambda m: self.receiver.dead_letter_message(
                m, reason=deadletter_reason, error_description=deadletter_error_description
            ),
        )

    def renew_message_lock(self, message: Any) -> None:
        self._run("renew_message_lock", message, self.receiver.renew_message_lock)


async def invoke(fn: Any, actions: LiveActions) -> BaseException | None:
    """The host's part for one message: peek-lock it, hand it over decoded by the extension; when the
    function raises, the host's processor abandons the message (if its lock still holds)."""
    [received] = await actions.receiver.receive_messages(max_message_count=1, max_wait_time=1)
    actions.received[received.lock_token] = received
    try:
        await fn(as_delivered(received), actions)
    except Exception as exc:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(actions.abandon, as_delivered(received))
        return exc
    return None


@dataclass
class SbHost:
    app: QueueingApp
    rt: Runtime
    ns: FakeServiceBusNamespace
    clock: FakeClock
    fns: dict[str, Any]
    runs: list[int]

    async def counts(self) -> tuple[int, int]:
        props = await self.rt.provider.admin.get_queue_runtime_properties("rv-sb")
        return props.active_message_count, props.scheduled_message_count


@contextlib.asynccontextmanager
async def served(
    app: QueueingApp, *, tracker: Any = None, control: Any = None, **settings: Any
) -> AsyncIterator[SbHost]:
    """``app`` served by the Functions host on an in-memory Service Bus (opened, and closed after)."""
    clock = FakeClock(start=utcnow())
    ns = FakeServiceBusNamespace(clock=clock)
    rt = in_memory_servicebus(app, ns, tracker=tracker, control=control)
    cfg = QueueingSettings(provider="servicebus", **settings)
    host = FunctionsHost(app, cfg, runtime=rt)
    fns = functions_of(build_app(cfg, app, host=host, env=SB_ENV))
    await rt.open()
    try:
        yield SbHost(app, rt, ns, clock, fns, [])
    finally:
        await rt.close()


@contextlib.asynccontextmanager
async def sb_host(
    handler: Any, *, tracker: Any = None, control: Any = None, **settings: Any
) -> AsyncIterator[SbHost]:
    app = QueueingApp("rv")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Work, ctx: Any) -> None:
        runs.append(ctx.attempt)
        await handler(len(runs))

    async with served(app, tracker=tracker, control=control, **settings) as host:
        host.runs = runs
        yield host


def receiver_of(host: SbHost) -> Any:
    return host.rt.provider.client.get_queue_receiver("rv-sb")


# -- 1. a stale run's retry copy ----------------------------------------------------------------------
async def test_servicebus_a_run_whose_lock_lapsed_sends_no_retry_copy() -> None:
    """The host's lock renewal fails while the handler runs; the lock lapses and the message goes to
    another instance, which runs it. The first run then asks for a retry: its copy must not be sent
    (the worker's settlement renews the lock before the copy for this reason), or the message runs once
    more after the live run has settled it."""
    state: dict[str, Any] = {}

    async def handler(run: int) -> None:
        if run == 1:
            host.clock.advance(LOCK + timedelta(seconds=1))
            [again] = await state["other"].receive_messages(max_message_count=1, max_wait_time=1)
            state["live"] = again  # held by the live run
            raise Retry(after=timedelta(minutes=1), reason="downstream busy")

    async with sb_host(handler) as host:
        fn = user(host.fns["servicebus_rv_sb"])
        await host.app.enqueue(Work())
        async with receiver_of(host) as stale_receiver, receiver_of(host) as other:
            state["other"] = other
            actions = LiveActions(asyncio.get_running_loop(), stale_receiver)
            await invoke(fn, actions)
            assert "complete" not in actions.done
            # the live run's message is still there, and no copy of the stale run's retry is scheduled
            assert await host.counts() == (1, 0)
            await other.complete_message(state["live"])
        assert await host.counts() == (0, 0)


# -- 1b. a settlement applied, its answer lost ----------------------------------------------------------
@pytest.mark.parametrize(
    ("outcome", "status", "left"),
    [("ok", "Succeeded", (0, 0, 0)), ("fatal", "DeadLettered", (0, 0, 1))],
)
async def test_servicebus_a_settlement_whose_answer_was_lost_is_recorded(
    outcome: str, status: str, left: tuple[int, int, int]
) -> None:
    """The host completed (or dead-lettered) the message, and the answer was lost on its way back to the
    worker: the extension raised. The history said what it said before the run (Leased) for a message
    no longer in its queue (review). Now the message, gone from its queue, is recorded as the run ended
    (as the worker's settlement does), and the invocation ends."""

    async def handler(run: int) -> None:
        if outcome == "fatal":
            raise NonRetryableError("no good")

    async with sb_host(handler) as host:
        fn = user(host.fns["servicebus_rv_sb"])
        sent = await host.app.enqueue(Work())
        async with receiver_of(host) as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver, lost_answers=1)
            assert await invoke(fn, actions) is None
        rec = await host.rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == status
        assert (*await host.counts(), await dead_letters(host)) == left
        assert host.runs == [1]


async def test_servicebus_a_complete_that_never_reached_the_broker_is_not_recorded() -> None:
    """The other side: the call failed before the broker, the message is still in its queue (locked).
    The invocation fails, nothing is recorded, and the message runs again once the host gives it back."""

    async def handler(run: int) -> None:
        return None

    async with sb_host(handler) as host:
        fn = user(host.fns["servicebus_rv_sb"])
        sent = await host.app.enqueue(Work())
        async with receiver_of(host) as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver, failing_completes=1)
            assert isinstance(await invoke(fn, actions), SettlementError)
            rec = await host.rt.tracker.get(sent.message_id)
            assert rec is not None
            assert rec.status != "Succeeded"
            assert await invoke(fn, actions) is None  # given back, run again
        rec = await host.rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == "Succeeded"
        assert host.runs == [1, 2]
        assert await host.counts() == (0, 0)


async def dead_letters(host: SbHost) -> int:
    async with host.rt.provider.client.get_queue_receiver(
        "rv-sb", sub_queue=ServiceBusSubQueue.DEAD_LETTER
    ) as r:
        return len(await r.peek_messages(max_message_count=10))


# -- 2. a left-behind original ----------------------------------------------------------------------
async def test_servicebus_an_original_left_behind_after_its_copy_is_completed_as_a_duplicate() -> None:
    """The retry copy is sent, then completing the original fails (the gRPC call to the host breaks).
    The original comes back; the copy already carries its outcome on, so it must be completed as a
    known duplicate, not run again (the worker recognises it by ``copied_from``). Run again, it forks:
    the handler runs twice for one attempt and two copies are scheduled."""

    async def handler(run: int) -> None:
        raise Retry(after=timedelta(minutes=1), reason="downstream busy")

    async with sb_host(handler) as host:
        fn = user(host.fns["servicebus_rv_sb"])
        sent = await host.app.enqueue(Work())
        async with receiver_of(host) as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver, failing_completes=1)
            await invoke(fn, actions)
            assert await host.counts() == (1, 1)  # the original left behind, its copy scheduled
            host.clock.advance(LOCK + timedelta(seconds=1))  # unless abandoned, back once its lock lapses
            await invoke(fn, actions)
        assert host.runs == [1]
        assert await host.counts() == (0, 1)  # the original completed, one copy
        rec = await host.rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == "Failed"
        assert rec.duplicates == 1


# -- 3. history retention on Service Bus -------------------------------------------------------------
async def test_servicebus_retention_timer_prunes_the_tables_history(azurite: Any) -> None:
    """``queueing_retention`` is documented to prune the Tables history on the cloud transports; on
    Service Bus it did nothing (the provider has no ``maintain``), so the history table grew forever."""
    tag = uuid.uuid4().hex[:8]
    control, tracker = tables_from_connection(
        azurite.connection_string,
        control_table=f"rvctl{tag}",
        tracker_table=f"rvhist{tag}",
        retention=timedelta(days=1),
    )

    async def handler(run: int) -> None:
        return None

    async with sb_host(handler, tracker=tracker, control=control) as host:
        old = utcnow() - timedelta(days=3)
        doomed = MessageRecord(
            message_id=uuid.uuid4(),
            tracking_id=uuid.uuid4(),
            type="Work",
            queue="rv-sb",
            status="Succeeded",
            attempt=1,
            created_at=old,
            updated_at=old,
        )
        kept = doomed.model_copy(
            update={"message_id": uuid.uuid4(), "tracking_id": uuid.uuid4(), "updated_at": utcnow()}
        )
        await tracker.upsert([doomed, kept])
        await user(host.fns["queueing_retention"])(TimerRequest(past_due=False))
        assert await tracker.get(doomed.message_id) is None
        assert await tracker.get(kept.message_id) is not None


# -- 4. a deeply nested body ------------------------------------------------------------------------
#: 2 KB of JSON nested deeper than Python's recursion limit: ``json.loads`` raises RecursionError
NESTED = ("[" * 1200 + "]" * 1200).encode()


async def test_servicebus_deeply_nested_body_is_dead_lettered_as_malformed() -> None:
    async def handler(run: int) -> None:
        return None

    async with sb_host(handler) as host:
        from azure.servicebus import ServiceBusMessage

        async with host.rt.provider.client.get_queue_sender("rv-sb") as sender:
            await sender.send_messages(ServiceBusMessage(NESTED))
        async with receiver_of(host) as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver)
            error = await invoke(user(host.fns["servicebus_rv_sb"]), actions)
        assert error is None
        assert actions.done == ["deadletter"]


async def test_storage_deeply_nested_body_is_dead_lettered_as_malformed(
    azurite: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("QueueingStorage", azurite.connection_string)
    cfg = QueueingSettings(
        provider="storage_queue", queue_prefix=f"r{tag}-", control_table=f"c{tag}", tracker_table=f"h{tag}"
    )
    app = QueueingApp("rv")

    @app.handler()
    async def handle(msg: Stored) -> None:
        return None

    host = FunctionsHost(app, cfg)
    fn = user(functions_of(build_app(cfg, app, host=host))["queue_rv_st"])
    rt = await host.runtime()
    name = rt.provider.physical("rv-st")
    client = QueueClient.from_connection_string(azurite.connection_string, name)
    poison = QueueClient.from_connection_string(azurite.connection_string, f"{name}-poison")
    try:
        await client.send_message(base64.b64encode(NESTED).decode())
        [m] = [m async for m in client.receive_messages(max_messages=1, visibility_timeout=30)]
        body = m.content.encode()  # as the host passes it (messageEncoding "none")
        msg = azq.QueueMessage(id=m.id, body=body, dequeue_count=m.dequeue_count, pop_receipt=m.pop_receipt)
        await fn(msg)  # returns normally (then the host deletes it): no retry, no host poison
        [letter] = [decode_body(p.content) async for p in poison.receive_messages(max_messages=1)]
        assert "malformed-envelope" in letter
    finally:
        await client.close()
        await poison.close()
        await rt.close()


# -- 5. a body whose model's validator raises ---------------------------------------------------------
@queue("rv-tags", max_attempts=3, lease_duration=LOCK)
class Tagged(QueueMessage):
    tags: list[str]

    # expects text, but the envelope carries the list the producer's validation made of it: pydantic
    # lets this AttributeError through unwrapped (not a ValidationError)
    @pydantic.field_validator("tags", mode="before")
    @classmethod
    def split(cls, v: Any) -> Any:
        return [t.strip() for t in v.split(",")]


async def test_servicebus_a_body_whose_validator_raises_is_dead_lettered_once_with_its_reason() -> None:
    """Found in review: the function raised on every delivery, the host handed the message back, and
    the broker dead-lettered it itself (MaxDeliveryCountExceeded), with no reason and no history."""
    app = QueueingApp("rv")
    runs: list[Tagged] = []

    @app.handler()
    async def handle(msg: Tagged) -> None:
        runs.append(msg)

    async with served(app) as host:
        rt = host.rt
        sent = await app.enqueue(Tagged(tags="a, b"))
        async with rt.provider.client.get_queue_receiver("rv-tags") as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver)
            error = await invoke(user(host.fns["servicebus_rv_tags"]), actions)
        assert error is None
        assert actions.done == ["deadletter"]
        async with rt.provider.client.get_queue_receiver(
            "rv-tags", sub_queue=ServiceBusSubQueue.DEAD_LETTER
        ) as dlq:
            [letter] = await dlq.receive_messages(max_message_count=5, max_wait_time=1)
        assert letter.dead_letter_reason == "InvalidBody"
        assert "AttributeError" in (letter.dead_letter_error_description or "")
        rec = await rt.tracker.get(sent.message_id)
        assert rec is not None
        assert (rec.status, rec.reason) == ("DeadLettered", "invalid-body")
        assert runs == []


# -- 6. a dead letter's description beyond the Basic Multilingual Plane ---------------------------------
class DotNetActions(LiveActions):
    """``LiveActions`` with the one check the .NET SDK the host settles through makes before a dead
    letter (``AmqpReceiver.DeadLetterInternalAsync``: ``Argument.AssertNotTooLong`` of the reason and
    the description against ``Constants.MaxDeadLetterReasonLength``, 4096, on ``string.Length``, which
    counts UTF-16 code units), raised as the extension raises a failed settlement."""

    def deadletter(
        self,
        message: Any,
        deadletter_reason: str | None = None,
        deadletter_error_description: str | None = None,
    ) -> None:
        for value in (deadletter_reason, deadletter_error_description):
            if value is not None and len(value.encode("utf-16-le")) // 2 > 4096:
                raise SettlementError("deadletter", "Failed to deadletter message", ValueError("too long"))
        super().deadletter(message, deadletter_reason, deadletter_error_description)


async def test_servicebus_a_reason_in_emoji_is_dead_lettered_once_within_the_hosts_length() -> None:
    """Cut by code points, a description of 3,000 emoji passed the kit (3,000 < 4,096) and was refused
    by the host (6,000 UTF-16 units): the invocation raised, the message came back and ran again on
    every attempt, and the broker's letter said nothing of the handler's error (found in review)."""

    async def handler(run: int) -> None:
        raise NonRetryableError("🔥" * 3000)

    async with sb_host(handler) as host:
        await host.app.enqueue(Work())
        async with receiver_of(host) as receiver:
            actions = DotNetActions(asyncio.get_running_loop(), receiver)
            error = await invoke(user(host.fns["servicebus_rv_sb"]), actions)
        assert error is None
        assert actions.done == ["deadletter"]
        assert host.runs == [1]
        async with host.rt.provider.client.get_queue_receiver(
            "rv-sb", sub_queue=ServiceBusSubQueue.DEAD_LETTER
        ) as dlq:
            [letter] = await dlq.receive_messages(max_message_count=5, max_wait_time=1)
        assert letter.dead_letter_reason == "NonRetryable"
        described = letter.dead_letter_error_description or ""
        assert described.startswith("NonRetryableError: 🔥")
        assert 4090 < len(described.encode("utf-16-le")) // 2 <= 4096  # (no pair split: it encodes)


# -- 7. an invocation that finds no free slot of its type ------------------------------------------------
@queue("rv-one", max_concurrency=1, lease_duration=LOCK)
class OneAtATime(QueueMessage):
    n: int = 0


async def test_servicebus_an_invocation_that_finds_no_free_slot_defers_its_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host pushes in more invocations than a type's slots: one that waited for a slot past the
    host's functionTimeout ended the Python worker, with every other invocation of the process (found
    in review). It waits ``SLOT_WAIT`` at most, then defers its message (a copy for later, no attempt
    counted) and returns."""
    import functions.host as host_module

    monkeypatch.setattr(host_module, "SLOT_WAIT", 0.2)
    app = QueueingApp("rv")
    runs: list[int] = []
    release = asyncio.Event()

    @app.handler()
    async def handle(msg: OneAtATime) -> None:
        runs.append(msg.n)
        await release.wait()

    async with served(app) as host:
        rt, fn = host.rt, user(host.fns["servicebus_rv_one"])
        await app.enqueue(OneAtATime(n=1))
        waiting = await app.enqueue(OneAtATime(n=2))
        async with rt.provider.client.get_queue_receiver("rv-one") as receiver:
            actions = LiveActions(asyncio.get_running_loop(), receiver)
            first = asyncio.create_task(invoke(fn, actions))
            async with asyncio.timeout(30):
                while not runs:
                    await asyncio.sleep(0.01)
            assert await asyncio.wait_for(invoke(fn, actions), 10) is None  # returned, not timed out
            assert runs == [1]
            props = await rt.provider.admin.get_queue_runtime_properties("rv-one")
            assert props.scheduled_message_count == 1  # its copy, for later
            release.set()
            assert await first is None
        rec = await rt.tracker.get(waiting.message_id)
        assert rec is not None
        assert (rec.status, rec.attempt) == ("Pending", 0), rec
        assert "no free slot of 'OneAtATime'" in (rec.description or rec.reason or ""), rec
