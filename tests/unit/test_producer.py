"""The producer API: envelopes, timing options, batching, durability flag, size limit."""

import json
from datetime import UTC, datetime, timedelta

import pytest

from queueing_core import MessageStatus, MessageTooLarge, QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.naming import Transport
from queueing_core.producer import Producer
from queueing_core.transport import Capabilities

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@queue("greetings", expiration=timedelta(hours=1))
class Greet(QueueMessage):
    name: str


@queue("lasting", expiration=None)
class Lasting(QueueMessage):
    name: str


class RecordingProvider:
    transport = Transport.INPROCESS

    def __init__(self, max_bytes=None):
        self.capabilities = Capabilities(max_message_bytes=max_bytes)
        self.sends = []

    async def send(self, envelopes, *, wait=False):
        self.sends.append((list(envelopes), wait))


def producer(**kw):
    app = QueueingApp()
    prov = RecordingProvider(**kw)
    return app, prov, Producer(app, prov, clock=lambda: NOW)


def test_envelope_carries_identity_timing_and_body_without_base_fields():
    _, _, p = producer()
    msg = Greet(name="ada", correlation_id="corr-1", properties={"tenant": "t"}, created_at=NOW)
    env = p.envelope_for(msg, delay=timedelta(minutes=5), headers={"x": "1"})
    assert env.type == "Greet"
    assert env.queue == "greetings"
    assert env.message_id == msg.message_id
    assert env.body == {"name": "ada"}
    assert env.not_before == NOW + timedelta(minutes=5)
    assert env.expires_at == NOW + timedelta(hours=1)  # the queue's expiration
    assert env.correlation_id == "corr-1"
    assert env.headers == {"tenant": "t", "x": "1"}
    assert env.attempt == 0


def test_absolute_times_and_contradictions():
    _, _, p = producer()
    msg = Greet(name="x", created_at=NOW)
    env = p.envelope_for(msg, not_before=NOW + timedelta(hours=2), expires_at=NOW + timedelta(hours=3))
    assert env.not_before == NOW + timedelta(hours=2)
    assert env.expires_at == NOW + timedelta(hours=3)
    assert p.envelope_for(msg, ttl=60).expires_at == NOW + timedelta(seconds=60)
    with pytest.raises(ValueError, match="either delay= or not_before="):
        p.envelope_for(msg, delay=1, not_before=NOW)
    with pytest.raises(ValueError, match="either ttl= or expires_at="):
        p.envelope_for(msg, ttl=1, expires_at=NOW)
    with pytest.raises(ValueError, match="not in the future"):
        p.envelope_for(msg, expires_at=NOW - timedelta(seconds=1))
    with pytest.raises(ValueError, match="must not be negative"):
        p.envelope_for(msg, delay=-5)
    assert p.envelope_for(msg, not_before=NOW - timedelta(days=1)).not_before is None  # past = now


async def test_a_message_due_at_or_after_its_expiry_is_refused_before_any_send():
    _, prov, p = producer()
    msg = Greet(name="x", created_at=NOW)  # expires an hour after NOW
    for options in (
        {"delay": timedelta(hours=1)},  # due exactly when it expires: expired, never run
        {"delay": 7200},
        {"not_before": NOW + timedelta(hours=3)},
        {"delay": 60, "ttl": 60},
        {"not_before": NOW + timedelta(minutes=5), "expires_at": NOW + timedelta(minutes=4)},
    ):
        with pytest.raises(InvalidArgument, match="could never run") as refused:
            p.envelope_for(msg, **options)
        assert "not_before" in str(refused.value)
        assert "expires_at" in str(refused.value)
        with pytest.raises(ValueError, match="could never run"):  # callers that caught ValueError still do
            await p.enqueue(msg, **options)
    assert prov.sends == []
    assert p.envelope_for(msg, delay=3599).not_before == NOW + timedelta(seconds=3599)
    for bad in (float("nan"), float("inf"), 1e20):
        with pytest.raises(InvalidArgument, match="delay"):
            p.envelope_for(msg, delay=bad, ttl=None)


async def test_text_no_store_can_hold_is_refused_before_any_send():
    _, prov, p = producer()
    for bad in ("a\x00b", "\\\x00"):  # NUL: PostgreSQL keeps it neither in JSON nor in text
        with pytest.raises(InvalidArgument, match="U\\+0000"):
            await p.enqueue(Greet(name=bad))
        with pytest.raises(InvalidArgument, match="U\\+0000"):
            await p.enqueue(Greet(name="x"), correlation_id=bad)
    surrogate = json.loads('"\\ud800"')  # what a JSON body can carry and no UTF-8 encoder takes
    with pytest.raises(InvalidArgument, match="UTF-8"):
        await p.enqueue(Greet(name=surrogate))
    with pytest.raises(InvalidArgument, match="correlation_id"):
        await p.enqueue(Greet(name="x"), correlation_id=surrogate)
    with pytest.raises(InvalidArgument, match="correlation_id"):
        await p.enqueue(Greet(name="x"), correlation_id="c" * 257)
    with pytest.raises(InvalidArgument, match="created_at"):
        await p.enqueue(Greet(name="x", created_at=datetime(9999, 12, 31, 23, tzinfo=UTC)))
    assert prov.sends == []
    await p.enqueue(Greet(name="\\u0000 is six characters here"))  # an escaped backslash: fine
    assert len(prov.sends) == 1


async def test_enqueue_many_is_one_send_and_and_wait_asks_for_durability():
    app, prov, p = producer()
    receipts = await p.enqueue_many([Greet(name=str(i)) for i in range(50)], delay=10)
    assert len(prov.sends) == 1
    assert len(prov.sends[0][0]) == 50
    assert prov.sends[0][1] is False
    assert {r.status for r in receipts} == {MessageStatus.SLEEPING}
    await p.enqueue_and_wait(Greet(name="durable"))
    assert prov.sends[-1][1] is True
    assert "Greet" in app.message_types  # producing a type registers it


async def test_oversize_message_is_refused_before_any_send():
    _, prov, p = producer(max_bytes=1024)
    with pytest.raises(MessageTooLarge, match="accepts at most 1024"):
        await p.enqueue_many([Greet(name="ok"), Greet(name="x" * 2000)])
    assert prov.sends == []


async def test_enqueue_middleware_stamps_and_can_refuse():
    app, prov, p = producer()
    order = []

    @app.use_enqueue_middleware
    async def outer(env, call_next):
        order.append("outer")
        return await call_next(env.model_copy(update={"headers": {**env.headers, "stamp": "1"}}))

    @app.use_enqueue_middleware
    async def refuse_bob(env, call_next):
        order.append("inner")
        if env.body.get("name") == "bob":
            raise PermissionError("bob may not enqueue")
        return await call_next(env)

    await p.enqueue(Greet(name="ann"))
    assert prov.sends[-1][0][0].headers["stamp"] == "1"
    assert order == ["outer", "inner"]
    with pytest.raises(PermissionError):
        await p.enqueue(Greet(name="bob"))
    assert len(prov.sends) == 1


async def test_enqueue_middleware_swapped_for_another_while_running_is_the_one_that_runs():
    app, prov, p = producer()

    def stamp(value: str):
        async def mw(env, call_next):
            return await call_next(env.model_copy(update={"headers": {**env.headers, "stamp": value}}))

        return mw

    first = app.use_enqueue_middleware(stamp("first"))
    await p.enqueue(Greet(name="ann"))
    app.enqueue_middleware.remove(first)  # as many as before, a different one
    app.use_enqueue_middleware(stamp("second"))
    await p.enqueue(Greet(name="ann"))
    assert [s[0][0].headers["stamp"] for s in prov.sends] == ["first", "second"]


async def test_enqueue_middleware_output_is_validated_again_before_any_send():
    """``model_copy(update=...)`` skips validation: a header of None or 42 was sent, then the enqueue
    failed on a raw pydantic error (in-process) or reported success (SQL), and every copy was
    dead-lettered as a malformed envelope, never run."""
    app, prov, p = producer()
    tenant: list[object] = []

    @app.use_enqueue_middleware
    async def stamp(env, call_next):
        return await call_next(env.model_copy(update={"headers": {**env.headers, "tenant": tenant[-1]}}))

    for bad in (None, 42):
        tenant.append(bad)
        with pytest.raises(InvalidArgument, match=r"headers\.tenant: Input should be a valid str") as refused:
            await p.enqueue(Greet(name="ann"))
        assert "enqueue middleware" in str(refused.value)
    assert prov.sends == []
    tenant.append("t1")
    await p.enqueue(Greet(name="ann"))
    assert prov.sends[-1][0][0].headers["tenant"] == "t1"


async def test_enqueue_middleware_that_returns_no_envelope_is_refused_and_one_unchanged_is_kept():
    app, prov, p = producer()
    kept = []

    @app.use_enqueue_middleware
    async def forgets_to_return(env, call_next):
        if env.body["name"] == "lost":
            await call_next(env)
            return None
        return await call_next(env)

    @app.use_enqueue_middleware
    async def watches(env, call_next):
        kept.append(env)
        return await call_next(env)

    with pytest.raises(InvalidArgument, match="returned NoneType, not an envelope"):
        await p.enqueue(Greet(name="lost"))
    await p.enqueue(Greet(name="ok"))
    assert prov.sends[-1][0][0] is kept[-1]  # passed on unchanged: the same object, not checked again


async def test_a_second_class_under_a_registered_type_name_is_refused_as_registration_refuses_it():
    """Enqueue registered a type only when its name was unknown: another class of that name was sent
    to the registered type's queue (dead-lettered, its body not that model's) or to a queue of its own
    that no host consumes."""
    from queueing_core.errors import RegistrationError

    app, prov, p = producer()
    await p.enqueue(Greet(name="ann"))

    def elsewhere() -> tuple[type[QueueMessage], type[QueueMessage]]:
        class Greet(QueueMessage):  # another module's class of the same name
            sku: int

        @queue("other-greetings", type_name="Greet")
        class Renamed(QueueMessage):
            sku: int

        return Greet, Renamed

    for clash in elsewhere():
        with pytest.raises(RegistrationError, match="two message classes use the type name 'Greet'"):
            await p.enqueue(clash(sku=1))
    assert len(prov.sends) == 1
    assert app.message_types["Greet"] is Greet


async def test_times_later_than_the_latest_kept_time_are_kept_as_it():
    """A time late on 9999-12-31 (``datetime.max`` as "never") was stored as given, and on PostgreSQL
    in a time zone ahead of UTC every read of the row failed; a deferral keeps ``LATEST`` instead."""
    from datetime import timezone

    from queueing_core.decisions import LATEST

    _, _, p = producer()
    never = datetime.max.replace(tzinfo=UTC)
    msg = Greet(name="x", created_at=NOW)
    assert p.envelope_for(msg, expires_at=never).expires_at == LATEST
    west = datetime.max.replace(tzinfo=timezone(timedelta(hours=-5)))  # past the year 9999 in UTC
    assert p.envelope_for(msg, expires_at=west).expires_at == LATEST
    parked = Lasting(name="x", created_at=NOW)  # (a type that never expires)
    env = p.envelope_for(parked, not_before=never - timedelta(hours=1))
    assert (env.not_before, env.expires_at) == (LATEST, None)
    assert p.envelope_for(parked, delay=LATEST - NOW + timedelta(hours=20)).not_before == LATEST
    late = Greet(name="x", created_at=datetime(9999, 12, 30, 12, tzinfo=UTC))  # + the queue's hour
    assert p.envelope_for(late).expires_at == LATEST


async def test_a_time_without_a_time_zone_is_refused():
    """Python reads a naive time as local time, and the kit read it as UTC: ``datetime.now() + 2h`` in
    New York came due seven hours late, without a word."""
    _, prov, p = producer()
    naive = datetime(2026, 3, 1, 14, 0)
    for option in ("not_before", "expires_at"):
        with pytest.raises(InvalidArgument, match=f"{option}: has no time zone: give a timezone-aware"):
            await p.enqueue(Greet(name="x"), **{option: naive})
    with pytest.raises(InvalidArgument, match="delay: is a time, not a length of time: pass not_before="):
        await p.enqueue(Greet(name="x"), delay=NOW + timedelta(hours=1))
    assert prov.sends == []
