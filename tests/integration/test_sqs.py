"""The SQS provider on moto's server beyond the contract suite: queue settings and
the redrive policy, delays natively and through the delayed store, batches, dead letters and their
reasons, receive counts, lease renewal, boto3 kept off the event loop, and ops over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config

from queueing_core import (
    MessageStatus,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    QueueNaming,
    Retry,
    RetryPolicy,
    queue,
)
from queueing_core.clock import utcnow
from queueing_core.decisions import DeadLetterReason
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.delayed import FORWARD_FAILED
from queueing_core.providers.sql.history import SideStores, malformed_id
from queueing_core.providers.sqs import DESCRIPTION, MESSAGE_ID, REASON, SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from tests.contract.harness import all_have, ops_client, running, wait_until
from tests.contract.harness_sqs import moto_endpoint, sqs_client
from tests.services import fresh_prefix


@queue(
    "Billing.Invoice",
    max_attempts=3,
    lease_duration=timedelta(seconds=20),
    expiration=timedelta(hours=2),
    retry=RetryPolicy(base=timedelta(milliseconds=50), jitter=0),
)
class Invoice(QueueMessage):
    n: int
    mode: str = "ok"  # ok | fatal | slow | later (asks for a retry after downstream["later"], if set)


@queue("Billing.Quick", max_attempts=3, lease_duration=timedelta(seconds=1))
class QuickLease(Invoice):
    """The same work with a one-second lease (visibility timeout)."""


@queue("Billing.Renewed", max_attempts=3, lease_duration=timedelta(seconds=10))
class RenewedLease(Invoice):
    """A ten-second lease, renewed every 3.3 s with 3.3-6.7 s of it left. Shorter ones were lost on a
    loaded machine (the message ran twice): moto answers from a thread of this process, and each
    receive and renewal waits for the same starved interpreter (3 s lost 3 times in 8, 6 s once in 2)."""


downstream: dict[str, Any] = {"declines": True, "later": None}


class Recording:
    """The real boto3 client, noting each call and the thread it ran on."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, threading.current_thread().name))
            return attr(*args, **kwargs)

        return call


def make(tmp_path, *, clock=utcnow, quick: bool = False, message: type[Invoice] | None = None, **provider_kw):
    prefix = fresh_prefix()
    app = QueueingApp("sqs", naming=QueueNaming(prefix=prefix))
    calls: list[tuple[int, int]] = []
    downstream["declines"] = True
    downstream["later"] = None

    async def handle(msg: Invoice, ctx) -> None:
        calls.append((msg.n, ctx.attempt))
        if msg.mode == "fatal" and downstream["declines"]:
            raise NonRetryableError(f"invoice {msg.n} declined")
        if msg.mode == "slow":
            await asyncio.sleep(12)  # past RenewedLease's 10 s lease: only renewal keeps it
        if msg.mode == "later" and downstream["later"] is not None:
            raise Retry(after=downstream["later"])

    app.handler(message or (QuickLease if quick else Invoice), max_concurrency=4)(handle)

    provider_kw.setdefault("receive_wait", 0)
    provider = SqsProvider(
        Recording(sqs_client()),
        stores=SideStores(f"sqlite:///{tmp_path}/{prefix}side.db", clock=clock),
        clock=clock,
        **provider_kw,
    )
    rt = Runtime(app, provider, clock=clock, pause_recheck=timedelta(milliseconds=200), control_ttl=0.05)
    return app, rt, calls


def physical(rt: Runtime, q: str = "Billing.Invoice") -> str:
    return rt.provider.physical(q)


def url(rt: Runtime, *, dead: bool = False, q: str = "Billing.Invoice") -> str:
    name = physical(rt, q)
    return rt.provider._urls[rt.provider.dead_letter_name(name) if dead else name]


async def depth(rt: Runtime, *, dead: bool = False, q: str = "Billing.Invoice") -> dict[str, int]:
    return await rt.provider.depth(q, dead=dead)


def peek(rt: Runtime, *, dead: bool = False, q: str = "Billing.Invoice") -> list[dict[str, Any]]:
    resp = sqs_client().receive_message(
        QueueUrl=url(rt, dead=dead, q=q),
        MaxNumberOfMessages=10,
        VisibilityTimeout=0,
        MessageAttributeNames=["All"],
    )
    return resp.get("Messages") or []


async def test_queues_are_created_with_redrive_visibility_and_retention(tmp_path):
    _app, rt, _ = make(tmp_path)
    await rt.open()
    assert physical(rt).endswith("Billing-Invoice")  # '.' is not allowed in SQS names
    attrs = sqs_client().get_queue_attributes(QueueUrl=url(rt), AttributeNames=["All"])["Attributes"]
    assert attrs["VisibilityTimeout"] == "20"  # the lease
    # SQS's longest, whatever the type's expiration (2 h here): the kit records expiry itself, and a
    # message given a longer ttl must not be dropped unreceived by the queue
    assert attrs["MessageRetentionPeriod"] == str(14 * 24 * 3600)
    redrive = json.loads(attrs["RedrivePolicy"])
    # the type's 3 attempts and one receive more: the kit's own dead letter for a message whose runs
    # all died; SQS's move is the safety net beyond it
    assert int(redrive["maxReceiveCount"]) == 4
    assert redrive["deadLetterTargetArn"].endswith(f":{physical(rt)}-dlq")
    await rt.close()


async def test_a_twenty_minute_delay_waits_in_the_delayed_store_then_arrives(tmp_path):
    shift = {"by": timedelta(0)}

    def clock():
        return utcnow() + shift["by"]

    app, rt, calls = make(tmp_path, clock=clock)
    r = await app.enqueue(Invoice(n=20), delay=timedelta(minutes=20))
    assert await rt.provider.delayed.counts() == {physical(rt): 1}
    assert await depth(rt) == {"ready": 0, "in_flight": 0, "delayed": 0}  # beyond DelaySeconds: not in SQS
    async with running(rt):
        assert await rt.provider.dispatcher.dispatch_once() == 0  # not due yet
        shift["by"] = timedelta(minutes=20, seconds=1)  # twenty minutes later
        rt.provider.dispatcher.wake()
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), what="the delayed one"
        )
    assert calls == [(20, 1)]
    assert await rt.provider.delayed.counts() == {}
    await rt.close()


async def test_short_delays_use_delay_seconds_and_longer_ones_the_store(tmp_path):
    app, rt, calls = make(tmp_path, max_native_delay=timedelta(seconds=2))
    client: Recording = rt.provider.client
    sent: list[dict] = []
    send_batch = client.send_message_batch

    def noting_delays(**kwargs):
        sent.extend(kwargs["Entries"])
        return send_batch(**kwargs)

    client.send_message_batch = noting_delays
    # open first: a lazy open inside enqueue (queues, side store) can outlast a short delay on a loaded
    # machine, and the message would be sent due at once
    await rt.open()
    native = await app.enqueue(Invoice(n=1), delay=timedelta(seconds=2))
    stored = await app.enqueue(Invoice(n=2), delay=timedelta(seconds=3))
    # SQS holds the short one, with its delay: read from what was sent, as the queue's "delayed" count
    # turns to "ready" once the delay has passed (a loaded machine can get there before it looks)
    [(n, delay_seconds)] = [(json.loads(e["MessageBody"])["body"]["n"], e["DelaySeconds"]) for e in sent]
    assert n == 1
    assert delay_seconds >= 1
    assert sum((await depth(rt)).values()) == 1
    assert await rt.provider.delayed.counts() == {physical(rt): 1}  # the store the longer one
    start = utcnow()
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [native.message_id, stored.message_id], MessageStatus.SUCCEEDED),
            what="both delayed messages",
        )
    assert sorted(calls) == [(1, 1), (2, 1)]
    rec = await rt.tracker.get(stored.message_id)
    assert rec.updated_at - start >= timedelta(seconds=2.5)
    await rt.close()


async def test_short_polling_backs_off_when_idle_instead_of_spinning(tmp_path):
    _app, rt, _calls = make(tmp_path)  # receive_wait=0: SQS answers at once, even when empty
    await rt.open()
    client: Recording = rt.provider.client

    def receives() -> int:
        return sum(1 for name, _ in client.calls if name == "receive_message")

    async with running(rt, poll_min=0.05, poll_max=0.2):
        # idle: after three empty receives (0.05, 0.1, 0.2 s) the back-off is at its 0.2 s maximum
        await wait_until(lambda: receives() >= 4, timeout=30, what="the worker idle")
        client.calls.clear()
        started = time.monotonic()
        await wait_until(lambda: receives() >= 5, timeout=30, what="five idle receives")
        elapsed = time.monotonic() - started
    # five requests spaced by the 0.2 s back-off take 0.8 s at least (a spinning loop: milliseconds);
    # measured as time for a count, so a loaded machine only makes it slower, never fails it
    assert elapsed >= 0.75, elapsed
    await rt.close()


async def test_enqueue_many_sends_batches_of_ten_and_calls_stay_off_the_event_loop(tmp_path):
    app, rt, _calls = make(tmp_path)
    await rt.open()
    client: Recording = rt.provider.client
    client.calls.clear()
    receipts = await app.enqueue_many([Invoice(n=i) for i in range(25)])
    assert [name for name, _ in client.calls] == ["send_message_batch"] * 3
    assert (await depth(rt))["ready"] == 25
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id for r in receipts], MessageStatus.SUCCEEDED), what="25"
        )
    loop_thread = threading.current_thread().name
    threads = {t for _, t in client.calls}
    assert loop_thread not in threads
    assert all(t.startswith("queueing-sqs") for t in threads)
    assert "delete_message_batch" in {name for name, _ in client.calls}  # settles in batches too
    await rt.close()


async def test_dead_letters_carry_the_reason_and_bad_bytes_are_kept_as_they_came(tmp_path):
    app, rt, calls = make(tmp_path)
    await rt.open()
    raw = "{not an envelope"
    sqs_client().send_message(QueueUrl=url(rt), MessageBody=raw)
    bad = await app.enqueue(Invoice(n=3, mode="fatal"))
    async with running(rt):
        await wait_until(lambda: all_have(rt, [bad.message_id], MessageStatus.DEAD_LETTERED), what="dl")
        await wait_until(lambda: len(peek(rt, dead=True)) == 2, what="two dead letters")
    letters = {m["MessageAttributes"][MESSAGE_ID]["StringValue"]: m for m in peek(rt, dead=True)}
    envelope = letters[str(bad.message_id)]
    assert envelope["MessageAttributes"][REASON]["StringValue"] == "non-retryable"
    assert "invoice 3 declined" in envelope["MessageAttributes"][DESCRIPTION]["StringValue"]
    assert json.loads(envelope["Body"])["headers"][REASON] == "non-retryable"
    odd = letters[str(malformed_id(raw))]
    assert odd["Body"] == raw
    assert odd["MessageAttributes"][REASON]["StringValue"] == "malformed-envelope"
    assert (await depth(rt))["ready"] == 0  # the originals were deleted
    assert calls == [(3, 1)]
    await rt.close()


async def test_the_receive_count_is_the_attempt_and_redrive_catches_a_crashing_consumer(tmp_path):
    app, rt, _ = make(tmp_path, quick=True)
    sub = app.subscription("QuickLease")
    r = await app.enqueue(QuickLease(n=4))

    async def receive_one():
        got: list = []

        async def some() -> bool:
            got.extend(await rt.provider.receive(sub, 1))
            return bool(got)

        await wait_until(some, timeout=30, what="a delivery")
        return got[0]

    # a consumer that dies holding the message: it comes back when the visibility timeout (1 s) ends
    assert (await receive_one()).attempt == 1
    assert (await receive_one()).attempt == 2
    assert (await receive_one()).attempt == 3
    # one receive beyond the type's 3 attempts reaches the kit: it dead-letters the message with its
    # reason, running nothing (SQS's own move at 3 left the history Pending)
    last = await receive_one()
    assert last.attempt == 4
    settlement = await rt.process(last)
    assert settlement.decision.reason is DeadLetterReason.MAX_ATTEMPTS
    await rt.provider.settle([settlement])
    await rt.record([settlement])
    dead = peek(rt, dead=True, q="Billing.Quick")
    assert [json.loads(m["Body"])["message_id"] for m in dead] == [str(r.message_id)]
    assert dead[0]["MessageAttributes"][REASON]["StringValue"] == "max-attempts-exceeded"
    assert (await rt.tracker.get(r.message_id)).status == "DeadLettered"
    await rt.close()


async def test_a_handler_longer_than_the_lease_keeps_its_message(tmp_path):
    app, rt, calls = make(tmp_path, message=RenewedLease)
    r = await app.enqueue(RenewedLease(n=5, mode="slow"))  # 12 s with a 10 s visibility timeout
    async with running(rt):
        await wait_until(
            lambda: all_have(rt, [r.message_id], MessageStatus.SUCCEEDED), timeout=60, what="slow one"
        )
    assert calls == [(5, 1)]  # renewed: never visible again, never received twice
    assert "change_message_visibility_batch" in {name for name, _ in rt.provider.client.calls}
    await rt.close()


async def test_a_forward_that_keeps_failing_lands_in_the_dlq_with_the_reason(tmp_path):
    _app, rt, _ = make(tmp_path, delayed_retries=0)
    await rt.open()
    envelope = rt.producer.envelope_for(Invoice(n=6))
    await rt.provider.delayed.store(envelope, physical(rt), utcnow())
    sqs_client().delete_queue(QueueUrl=url(rt))  # the destination is gone
    assert await rt.provider.dispatcher.dispatch_once() == 1
    [letter] = peek(rt, dead=True)
    assert letter["MessageAttributes"][REASON]["StringValue"] == FORWARD_FAILED
    assert "NonExistentQueue" in letter["MessageAttributes"][DESCRIPTION]["StringValue"]
    rec = await rt.tracker.get(envelope.message_id)
    assert rec.status == MessageStatus.DEAD_LETTERED
    assert rec.reason == FORWARD_FAILED
    assert await rt.provider.delayed.counts() == {}
    await rt.close()


async def test_ops_retry_from_the_dlq_and_purge_over_http(tmp_path):
    app, rt, _ = make(tmp_path)
    await rt.open()
    async with ops_client(rt) as client:
        bad = await app.enqueue(Invoice(n=1, mode="fatal"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad.message_id], MessageStatus.DEAD_LETTERED), what="dl")
        [q] = (await client.get("/stats")).json()["queues"]
        assert q["transport_counts"]["dead_lettered"] == 1
        assert q["counts"] == {"DeadLettered": 1}

        downstream["declines"] = False
        assert (await client.post(f"/messages/{bad.message_id}/retry")).status_code == 200
        assert peek(rt, dead=True) == []  # taken out of the DLQ
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad.message_id], MessageStatus.SUCCEEDED), what="retried")
        assert (await rt.tracker.get(bad.message_id)).attempt == 1

        downstream["declines"] = True
        bad2 = await app.enqueue(Invoice(n=2, mode="fatal"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [bad2.message_id], MessageStatus.DEAD_LETTERED), what="dl2")
        assert (await client.post(f"/messages/{bad2.message_id}/lease/release")).status_code == 409
        purged = (await client.request("DELETE", "/messages", params={"status": "DeadLettered"})).json()
        assert purged["deleted"] == 1
        assert peek(rt, dead=True) == []
        assert (await client.get(f"/messages/{bad2.message_id}")).status_code == 404

        await app.enqueue_many([Invoice(n=i) for i in range(3)])
        await app.enqueue(Invoice(n=99), delay=timedelta(hours=1))
        purged = (
            await client.request("DELETE", "/messages", params={"queue": "Billing.Invoice", "all": "true"})
        ).json()
        assert purged["deleted"] == 5
        assert (await depth(rt))["ready"] == 0
        assert await rt.provider.delayed.counts() == {}
    await rt.close()


async def test_ops_retry_brings_a_stored_delay_forward_but_not_an_sqs_delay(tmp_path):
    app, rt, calls = make(tmp_path)
    await rt.open()
    async with ops_client(rt) as client:
        downstream["later"] = timedelta(hours=1)  # beyond SQS's 15 minutes: the delayed store
        stored = await app.enqueue(Invoice(n=1, mode="later"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [stored.message_id], MessageStatus.FAILED), what="stored")
        downstream["later"] = timedelta(minutes=5)  # within them: SQS's own DelaySeconds
        native = await app.enqueue(Invoice(n=2, mode="later"))
        async with running(rt):
            await wait_until(lambda: all_have(rt, [native.message_id], MessageStatus.FAILED), what="native")
        assert await rt.provider.delayed.counts() == {physical(rt): 1}
        assert (await depth(rt))["delayed"] == 1

        downstream["later"] = None
        assert (await client.post(f"/messages/{stored.message_id}/retry")).status_code == 200
        assert await rt.provider.delayed.counts() == {}
        resp = await client.post(f"/messages/{native.message_id}/retry")
        assert resp.status_code == 409
        assert "SQS's own delay" in resp.json()["detail"]
        async with running(rt):
            await wait_until(lambda: all_have(rt, [stored.message_id], MessageStatus.SUCCEEDED), what="now")
        assert (await rt.tracker.get(native.message_id)).status == MessageStatus.FAILED  # still waiting
        assert calls == [(1, 1), (2, 1), (1, 1)]
    await rt.close()


async def test_from_settings_uses_the_standard_credential_chain(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    settings = QueueingSettings(
        provider="sqs",
        sqs_endpoint_url=moto_endpoint(),
        sqs_region="eu-west-1",
        database_url=f"sqlite:///{tmp_path}/settings.db",
        delayed_store_retries=4,
    )
    provider = SqsProvider.from_settings(settings)
    assert provider.dispatcher.retries == 4
    assert provider.client.meta.region_name == "eu-west-1"
    app, _rt, _ = make(tmp_path)
    rt = Runtime(app, provider)
    await app.enqueue_and_wait(Invoice(n=1))
    assert (await provider.depth("Billing.Invoice"))["ready"] == 1
    await rt.close()


async def test_an_unreachable_endpoint_is_provider_unavailable(tmp_path):
    client = boto3.client(
        "sqs",
        endpoint_url="http://127.0.0.1:1",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    provider = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/down.db"))
    app = QueueingApp("down")
    app.message(Invoice)
    with pytest.raises(ProviderUnavailable, match="SQS unreachable"):
        await provider.open(app)  # creates the type's queues
    await provider.close()


class StepClock:
    """A clock that stands still unless a slow call moves it."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> Any:
        return self.now


class SlowCalls:
    """The provider's client, whose receive and visibility change take ``seconds`` on ``clock``."""

    SLOW = frozenset({"receive_message", "change_message_visibility_batch"})

    def __init__(self, client: Any, clock: StepClock, seconds: float) -> None:
        self._client, self._clock, self._seconds = client, clock, seconds

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in self.SLOW:
            return attr

        def slow(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self._clock.now += timedelta(seconds=self._seconds)  # (the answer arrives this much later)
            return result

        return slow


async def test_a_lease_counts_from_before_the_call_that_took_it(tmp_path):
    """The visibility timeout starts while the receive (or the renewal) is on its way: a lease counted
    from the clock once the answer is here would be that call's time longer than the one SQS keeps, and
    a process stalled that long would renew after its message had gone to another receive."""
    clock = StepClock()
    app, rt, _calls = make(tmp_path, clock=clock, message=RenewedLease)
    await rt.open()
    rt.provider.client = SlowCalls(rt.provider.client, clock, seconds=7)
    await app.enqueue(RenewedLease(n=1))
    sub = app.subscription("RenewedLease")
    assert sub is not None
    sent = clock.now
    [d] = await rt.provider.receive(sub, 1)
    assert clock.now == sent + timedelta(seconds=7)  # (the call took 7 s)
    assert d.lease_until == sent + timedelta(seconds=10)
    sent = clock.now
    assert await rt.provider.renew([d]) == []
    assert d.lease_until == sent + timedelta(seconds=10)
    await rt.close()


async def test_a_receive_whose_later_call_fails_hands_over_what_the_earlier_calls_brought(tmp_path):
    """SQS hands over 10 messages a call, each hidden for the lease and its receive counted. When a
    later call fails (the side store's lease write, or SQS itself), what the earlier calls brought is
    returned to run now; raising lost it until the lease ran out, an attempt used unrun (found in
    review). A failure with nothing brought is the caller's."""
    app, rt, calls = make(tmp_path)
    await rt.open()
    await app.enqueue_many([Invoice(n=i) for i in range(15)])
    sub = app.subscription("Invoice")
    prov = rt.provider
    real = prov.leases.take
    taken = 0

    async def second_write_fails(received, until):
        nonlocal taken
        taken += 1
        if taken == 2:
            raise ConnectionError("side database unreachable")
        return await real(received, until)

    prov.leases.take = second_write_fails
    got = await prov.receive(sub, 15)
    assert len(got) == 10
    assert {d.attempt for d in got} == {1}
    await prov.settle([await rt.process(d) for d in got])
    assert not any(d.refused for d in got)
    assert len(calls) == 10

    async def fails(received, until):
        raise ConnectionError("side database unreachable")

    prov.leases.take = fails
    with pytest.raises(ConnectionError):
        await prov.receive(sub, 15)
    prov.leases.take = real
    await rt.close()
