"""SQS, on moto's server with real side stores (SQLite, and PostgreSQL for the lease ordering):

- queues keep messages for SQS's longest retention (14 days), whatever the type's expiration: a
  message's own ``ttl`` may be longer, and SQS would delete it unreceived (no run, no dead letter,
  history still Pending); a queue an older version created with a shorter retention is brought up;
- the lease token of a receive that SQS handed the message to later wins, whatever order the token
  writes land in: a stale receive whose write stalled past its visibility timeout is dropped, and the
  live holder settles;
- a delayed-store row whose text is not an envelope is dead-lettered as it was stored (reason
  ``malformed-envelope``), not left due for ever.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.app import Subscription
from queueing_core.decisions import Complete, DeadLetter, DeadLetterReason
from queueing_core.errors import ProviderUnavailable
from queueing_core.naming import Transport
from queueing_core.providers.delayed import DelayedMessage
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sql.leases import SqlLeaseStore
from queueing_core.providers.sqs import DESCRIPTION, MESSAGE_ID, REASON, SqsProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement
from queueing_core.worker import Settler
from tests.contract.harness import wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import POSTGRES_URL, drop_schema, fresh_prefix, require

FOURTEEN_DAYS = 14 * 24 * 3600


@queue("Keep.Short", expiration=timedelta(seconds=20), lease_duration=timedelta(seconds=1))
class Short(QueueMessage):
    n: int


async def make(tmp_path) -> tuple[QueueingApp, Runtime, SqsProvider]:
    prefix = fresh_prefix()
    app = QueueingApp("sqsfix", naming=QueueNaming(prefix=prefix))

    @app.handler()
    async def handle(msg: Short) -> None:
        pass

    prov = SqsProvider(
        sqs_client(), stores=SideStores(f"sqlite:///{tmp_path}/{prefix}side.db"), receive_wait=0
    )
    return app, Runtime(app, prov), prov


async def one_enqueued(tmp_path, n: int) -> tuple[QueueingApp, Runtime, SqsProvider, Subscription]:
    """:func:`make`, opened, with one message of ``n`` enqueued; and the type's subscription."""
    app, rt, prov = await make(tmp_path)
    try:
        await rt.open()
        await app.enqueue(Short(n=n))
    except BaseException:
        await cleanup(rt, prov)
        raise
    sub = app.subscription("Short")
    assert sub is not None
    return app, rt, prov, sub


async def cleanup(rt: Runtime, prov: SqsProvider) -> None:
    urls = [await prov._url("Keep.Short", dead=dead) for dead in (False, True)]
    await rt.close()
    client = sqs_client()
    for url in urls:
        client.delete_queue(QueueUrl=url)


def retention(url: str) -> int:
    attrs = sqs_client().get_queue_attributes(QueueUrl=url, AttributeNames=["MessageRetentionPeriod"])
    return int(attrs["Attributes"]["MessageRetentionPeriod"])


# -- retention ---------------------------------------------------------------------------------------
async def test_queues_keep_messages_for_the_longest_retention_whatever_the_types_expiration(tmp_path):
    _app, rt, prov = await make(tmp_path)
    await rt.open()
    try:
        # before the fix: the type's expiration (20 s) plus ttl_grace (1 h); enqueue(ttl=1 day) outlived it
        assert retention(await prov._url("Keep.Short")) == FOURTEEN_DAYS
        assert retention(await prov._url("Keep.Short", dead=True)) == FOURTEEN_DAYS
    finally:
        await cleanup(rt, prov)


async def test_a_queue_an_older_version_created_with_a_shorter_retention_is_brought_up(tmp_path):
    _app, rt, prov = await make(tmp_path)
    # as an older version created it: retention = the type's expiration + ttl_grace
    sqs_client().create_queue(
        QueueName=prov.physical("Keep.Short"), Attributes={"MessageRetentionPeriod": str(20 + 3600)}
    )
    await rt.open()
    try:
        assert retention(await prov._url("Keep.Short")) == FOURTEEN_DAYS
    finally:
        await cleanup(rt, prov)


# -- the lease token: the later receive wins ------------------------------------------------------------
@pytest.mark.parametrize("b_settles_first", [False, True])
async def test_a_stale_receive_whose_token_write_lands_late_is_dropped_and_the_live_holder_settles(
    tmp_path, b_settles_first: bool
):
    """Receive A's token write stalls past A's visibility timeout; receive B gets the message, and A's
    write lands after B's, or after B's settlement (the message gone). Either way A is dropped and B
    settles. Found in review, the second: the settlement deleted B's token row, so A's older token
    found no row, was written, and A ran a message already settled."""
    _app, rt, prov, sub = await one_enqueued(tmp_path, 1)
    try:
        real_take = prov.leases.take
        gate = asyncio.Event()
        takes = 0

        async def first_take_stalls(received: Any, until: datetime) -> Any:
            nonlocal takes
            takes += 1
            if takes == 1:
                await gate.wait()  # receive A's write is held until the test lets it go
            return await real_take(received, until)

        prov.leases.take = first_take_stalls  # type: ignore[method-assign]
        a_task = asyncio.create_task(prov.receive(sub, 1))  # A: SQS hands it over at once
        await wait_until(lambda: takes == 1, timeout=10, what="receive A's token write")
        b: list[Any] = []

        async def b_received() -> bool:  # B: once A's one-second visibility timeout has run out
            b.extend(await prov.receive(sub, 1))
            return bool(b)

        await wait_until(b_received, timeout=15, what="receive B")
        if b_settles_first:
            await prov.settle([Settlement(b[0], Complete())])
        gate.set()  # A's write lands
        # before the first fix: A's write replaced B's token, B was refused and the lapsed A settled
        assert await a_task == [], "the stale receive A was handed to a handler"
        if not b_settles_first:
            await prov.settle([Settlement(b[0], Complete())])
        assert not b[0].refused, "the live holder B was refused"
        depth = await prov.depth("Keep.Short")
        assert depth["ready"] + depth["in_flight"] + depth["delayed"] == 0
    finally:
        await cleanup(rt, prov)


@pytest.mark.parametrize("failing", ["copy", "delete"])
async def test_a_settlement_that_failed_is_tried_again_under_the_same_lease(tmp_path, failing: str):
    """One step of a retry's settlement fails once: the copy's send, or the original's delete (its
    answer lost: applied, then an error). The lease is still the run's, so its renewals go on and the
    settler's next try goes ahead, from the step that failed: one copy in all, the original gone.
    Found in review: the first try removed the token, every later try was refused and the message
    waited out its visibility timeout (one more receive counted); then, with the token kept, a try
    after a failed delete sent the copy again."""
    from queueing_core.decisions import RetryAfter

    _app, rt, prov, sub = await one_enqueued(tmp_path, 4)
    try:
        [d] = await prov.receive(sub, 1)
        real_send_at, real_delete = prov.send_at, prov._delete
        sent: list[str] = []
        failed: list[str] = []

        async def send_at(*args: Any, **kwargs: Any) -> None:
            if failing == "copy" and not failed:
                failed.append("copy")
                raise ConnectionError("the copy's send failed")
            sent.append("copy")
            await real_send_at(*args, **kwargs)

        async def delete(handles: Any) -> None:
            await real_delete(handles)
            if failing == "delete" and not failed:
                failed.append("delete")
                for h in handles:
                    h.deleted = False  # (as when the answer never came back: nothing marked)
                raise ConnectionError("the delete's answer was lost")

        prov.send_at = send_at  # type: ignore[method-assign]
        prov._delete = delete  # type: ignore[method-assign]
        settlement = Settlement(d, RetryAfter(timedelta(seconds=0), "the first try failed"))
        with pytest.raises(ConnectionError):
            await prov.settle([settlement])
        assert failed == [failing]
        if failing == "copy":  # (after the delete SQS holds no message to renew: it says so)
            assert await prov.renew([d]) == [], "the run's lease was lost after a failed settlement"
        await prov.settle([settlement])
        assert not d.refused, "the settler's next try was refused"
        assert sent == ["copy"], "the copy was sent again (or never)"
        got: list[Any] = []

        async def copy_received() -> bool:
            got.extend(await prov.receive(sub, 1))
            return bool(got)

        await wait_until(copy_received, timeout=10, what="the retry's copy")
        assert got[0].envelope is not None
        assert d.envelope is not None
        assert got[0].envelope.message_id == d.envelope.message_id
        await prov.settle([Settlement(got[0], Complete())])
        depth = await prov.depth("Keep.Short")
        assert depth["ready"] + depth["in_flight"] + depth["delayed"] == 0
    finally:
        await cleanup(rt, prov)


@queue("Keep.Long", lease_duration=timedelta(minutes=2))
class Long(QueueMessage):
    n: int


async def make_long(tmp_path) -> tuple[QueueingApp, Runtime, SqsProvider, list[str]]:
    """:func:`make` with ``Long`` handled too, opened; and the URLs of its queue and dead-letter queue."""
    app, rt, prov = await make(tmp_path)

    @app.handler()
    async def handle_long(msg: Long) -> None:
        pass

    await rt.open()
    return app, rt, prov, [await prov._url("Keep.Long", dead=dead) for dead in (False, True)]


async def receive_all(prov: SqsProvider, sub: Subscription, n: int, what: str) -> dict[uuid.UUID, Any]:
    """Receive until ``n`` distinct messages are held, by message id."""
    got: dict[uuid.UUID, Any] = {}

    async def all_received() -> bool:
        for d in await prov.receive(sub, 10):
            got[d.envelope.message_id] = d
        return len(got) == n

    await wait_until(all_received, timeout=15, what=what)
    return got


async def cleanup_long(rt: Runtime, prov: SqsProvider, urls: list[str]) -> None:
    await cleanup(rt, prov)
    for url in urls:
        sqs_client().delete_queue(QueueUrl=url)


async def test_a_batch_given_up_after_part_of_it_was_deleted_records_that_part(tmp_path):
    """The delete of a batch's second part (SQS deletes ten at a time) fails on every try: the settler
    gives the batch up after its five, and the ten messages deleted before that are recorded as they
    ended. Found in review: their history stayed as before their run, for good, since nothing brings
    a deleted message back to be recorded by another run. The two not deleted come back and run."""
    app, rt, prov, urls = await make_long(tmp_path)
    url = urls[0]
    settlers: list[Settler] = []

    def settler_of(backoff: float) -> Settler:
        settler = Settler(rt, linger=0)
        settler.backoff = backoff
        settler.start()
        settlers.append(settler)
        return settler

    try:
        ids = [(await app.enqueue(Long(n=i))).message_id for i in range(12)]
        sub = app.subscription("Long")
        assert sub is not None
        got = await receive_all(prov, sub, 12, "the twelve messages")
        settlements = [await rt.process(d) for d in got.values()]
        real_call = prov._call
        deletes = 0

        async def second_part_fails(action: str, fn: Any, **kwargs: Any) -> Any:
            nonlocal deletes
            if action == "deleting messages":
                deletes += 1
                if deletes > 1:
                    raise ConnectionError("the delete's connection was reset")
            return await real_call(action, fn, **kwargs)

        prov._call = second_part_fails  # type: ignore[method-assign]
        settler = settler_of(0.01)
        for s in settlements:
            settler.add(s)
        first = [s.delivery.envelope.message_id for s in settlements[:10]]
        last = [s.delivery for s in settlements[10:]]
        await wait_until(lambda: deletes >= 6, timeout=30, what="the settler's five tries")
        await settler.close()
        assert deletes == 6, "the part deleted was deleted again, or the tries did not stop at five"
        statuses = {(await rt.tracker.get(i)).status for i in first}
        assert statuses == {MessageStatus.SUCCEEDED}, "the deleted part was not recorded"
        for d in last:
            rec = await rt.tracker.get(d.envelope.message_id)
            assert rec is None or rec.status != MessageStatus.SUCCEEDED, "a message not deleted was recorded"
        prov._call = real_call  # type: ignore[method-assign]
        client = sqs_client()
        for d in last:  # back at once instead of after their lease
            client.change_message_visibility(
                QueueUrl=url, ReceiptHandle=d.handle.receipt, VisibilityTimeout=0
            )
        again = await receive_all(prov, sub, 2, "the two not deleted")
        assert set(again) == {d.envelope.message_id for d in last}
        settler = settler_of(0.2)
        for d in again.values():
            settler.add(await rt.process(d))
        await settler.close()
        assert {(await rt.tracker.get(i)).status for i in ids} == {MessageStatus.SUCCEEDED}
        depth = await prov.depth("Keep.Long")
        assert depth["ready"] + depth["in_flight"] == 0
    finally:
        for settler in settlers:
            await settler.close_within(5)
        await cleanup_long(rt, prov, urls)


async def test_a_delete_sqs_fails_on_its_side_is_tried_again_and_one_it_refuses_is_not_recorded(tmp_path):
    """DeleteMessageBatch answers per entry. One entry failed on SQS's side (``SenderFault`` false, an
    InternalError: injected, moto never answers so) is deleted on the settler's next try; one SQS
    refused as the sender's fault (a receipt no longer the message's: moto's own answer to a receipt
    it does not know) is the run's lost lease, its outcome not recorded, the message left to come
    back. Found in review: every entry SQS answered for was marked deleted and recorded as settled,
    so the first was never deleted and ran again, and the second was recorded by a run that had lost
    it."""
    app, rt, prov, urls = await make_long(tmp_path)
    try:
        for i in range(3):
            await app.enqueue(Long(n=i))
        sub = app.subscription("Long")
        assert sub is not None
        got = list((await receive_all(prov, sub, 3, "the three messages")).values())
        done, stale, flaky = got
        stale.handle.receipt = "not-a-receipt-sqs-gave"  # (the real one stays with SQS, in flight)
        real_call = prov._call
        sent: list[str] = []

        async def flaky_once(action: str, fn: Any, **kwargs: Any) -> Any:
            if action != "deleting messages":
                return await real_call(action, fn, **kwargs)
            receipts = [e["ReceiptHandle"] for e in kwargs["Entries"]]
            first = flaky.handle.receipt in receipts and flaky.handle.receipt not in sent
            sent.extend(receipts)
            if not first:
                return await real_call(action, fn, **kwargs)
            # SQS failed the flaky entry on its side, the first time: the others go as sent
            entries = [e for e in kwargs["Entries"] if e["ReceiptHandle"] != flaky.handle.receipt]
            [failing] = [e for e in kwargs["Entries"] if e["ReceiptHandle"] == flaky.handle.receipt]
            resp = await real_call(action, fn, **{**kwargs, "Entries": entries})
            resp.setdefault("Failed", []).append(
                {"Id": failing["Id"], "SenderFault": False, "Code": "InternalError", "Message": "try again"}
            )
            return resp

        prov._call = flaky_once  # type: ignore[method-assign]
        settlements = [await rt.process(d) for d in got]
        with pytest.raises(ProviderUnavailable, match="InternalError"):
            await prov.settle(settlements)
        await prov.settle(settlements)  # the settler's next try
        assert sent.count(done.handle.receipt) == 1, "a deleted message was deleted again"
        assert sent.count(stale.handle.receipt) == 1, "a refused receipt was sent again"
        assert sent.count(flaky.handle.receipt) == 2
        assert not done.refused
        assert not flaky.refused
        assert stale.refused, "a run whose receipt SQS refused was taken as settled"
        depth = await prov.depth("Keep.Long")
        assert depth["ready"] + depth["in_flight"] == 1  # the refused one, to come back
    finally:
        await cleanup_long(rt, prov, urls)


async def test_a_dead_letter_whose_delete_sqs_refuses_is_recorded_so_the_letter_is_listed(tmp_path):
    """The run dead-lettered the message (its letter sent), then SQS refused the original's delete as
    the sender's fault (the receipt had passed on: SQS's own move to the dead-letter queue after the
    last receive does that). Found in review: refused, the run recorded nothing, and the letter it
    sent waited in the dead-letter queue under a history that never said so, out of every listing."""
    _app, rt, prov, sub = await one_enqueued(tmp_path, 5)
    try:
        [d] = await prov.receive(sub, 1)
        d.handle.receipt = "not-a-receipt-sqs-gave"
        settlement = Settlement(d, DeadLetter(DeadLetterReason.NON_RETRYABLE, "declined"))
        await prov.settle([settlement])
        assert not d.refused, "the run that sent the dead letter was taken as not settled"
        await rt.record([settlement])
        assert d.envelope is not None
        rec = await rt.tracker.get(d.envelope.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
        assert (await prov.depth("Keep.Short", dead=True))["ready"] == 1
    finally:
        await cleanup(rt, prov)


async def test_a_token_an_older_version_wrote_does_not_refuse_a_new_receive(tmp_path):
    _app, rt, prov, sub = await one_enqueued(tmp_path, 2)
    try:
        msg_id = sqs_client().receive_message(
            QueueUrl=await prov._url("Keep.Short"), VisibilityTimeout=0, WaitTimeSeconds=1
        )["Messages"][0]["MessageId"]
        # an older version's receive (a random token) held it, and its process died
        leases = prov.leases.sql.tables.leases
        async with prov.leases.sql.engine.begin() as conn:
            await conn.execute(
                leases.insert(),
                [
                    {
                        "transport": "sqs",
                        "message_key": msg_id,
                        "token": uuid.UUID("ffffffff-ffff-4fff-bfff-ffffffffffff"),
                        "until": datetime.now(UTC),
                    }
                ],
            )
        [d] = await prov.receive(sub, 1)
        await prov.settle([Settlement(d, Complete())])
        assert not d.refused
    finally:
        await cleanup(rt, prov)


@pytest.fixture(params=["sqlite", "postgres"])
async def lease_store(request, tmp_path):
    if request.param == "sqlite":
        stores = SideStores(f"sqlite:///{tmp_path}/leases.db")
        schema = None
    else:
        require("PostgreSQL", "127.0.0.1", 5432)
        schema = f"sqsfence_{uuid.uuid4().hex[:10]}"
        stores = SideStores(POSTGRES_URL, schema=schema)
    await stores.open()
    try:
        yield SqlLeaseStore(stores.sql, "sqs")
    finally:
        await stores.close()
        if schema is not None:
            await drop_schema(schema)


async def test_tokens_compare_by_receive_count_in_the_database(lease_store):
    """The store's own ordering, on both databases: a token write of a lower receive count never
    replaces a higher one, before or after the higher one's settlement; a higher one always does; a
    replaced token neither renews nor settles."""
    until = datetime.now(UTC) + timedelta(minutes=1)
    for n in range(20):  # the count decides first, every time
        key = f"m-{n}"
        [second] = await lease_store.take([(key, 2)], until)
        assert second is not None
        assert await lease_store.take([(key, 1)], until) == [None]
        # an equal count (SQS's rare duplicate delivery): the receive that came back later holds it
        [twin] = await lease_store.take([(key, 2)], until)
        assert twin is not None
        assert await lease_store.extend([second], until) == set()
        assert await lease_store.extend([twin], until) == {twin}
        # both receives in one call (a batch): only the live one, though they share the key
        assert await lease_store.holding([second, twin]) == {twin}
        [third] = await lease_store.take([(key, 3)], until)
        assert third is not None
        stale = [second, twin]
        assert await lease_store.extend(stale, until) == set()
        assert await lease_store.holding(stale) == set()
        assert await lease_store.holding([third]) == {third}
        # a settlement leaves the token as the message's fence: a receive of a lower count whose write
        # lands after it is still refused, and the settling run still renews (and may try again)
        assert await lease_store.take([(key, 2)], until) == [None]
        assert await lease_store.extend([third], until) == {third}
        assert await lease_store.holding([third]) == {third}
    # a batch where some writes apply and some do not
    await lease_store.take([("x", 5)], until)
    got = await lease_store.take([("x", 4), ("y", 1)], until)
    assert got[0] is None
    assert got[1] is not None


# -- a delayed row that is not an envelope ----------------------------------------------------------------
async def _store_raw_row(prov: SqsProvider, text: str) -> DelayedMessage:
    now = datetime.now(UTC)
    row = {
        "id": uuid.uuid4(),
        "message_id": uuid.uuid4(),
        "transport": Transport.SQS.value,
        "destination": prov.physical("Keep.Short"),
        "due_at": now,
        "envelope": text,
        "failures": 0,
        "created_at": now,
    }
    async with prov.delayed.sql.engine.begin() as conn:  # damaged, or written by another version
        await conn.execute(prov.delayed._t.insert(), [row])
    return DelayedMessage(
        row["id"],
        row["message_id"],
        row["destination"],
        now,
        text,
        0,
        now,  # type: ignore[arg-type]
    )


def dead_letters(prov: SqsProvider, url: str) -> list[dict[str, Any]]:
    resp = sqs_client().receive_message(
        QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=0, MessageAttributeNames=["All"]
    )
    return list(resp.get("Messages") or [])


async def test_a_delayed_row_that_is_not_an_envelope_is_dead_lettered_as_it_was_stored(tmp_path):
    _app, rt, prov = await make(tmp_path)
    await rt.open()
    try:
        text = '{"not": "an envelope"}'
        item = await _store_raw_row(prov, text)
        await prov.dispatcher.dispatch_once()
        # before the fix: the forward failed to decode, then the dead letter did too: due for ever
        async with prov.delayed.sql.engine.connect() as conn:
            left = (await conn.execute(sa.select(prov.delayed._t.c.id))).all()
        assert left == [], "the row is still in the delayed store"
        [letter] = dead_letters(prov, await prov._url("Keep.Short", dead=True))
        assert letter["Body"] == text
        attrs = letter["MessageAttributes"]
        assert attrs[REASON]["StringValue"] == "malformed-envelope"
        assert attrs[MESSAGE_ID]["StringValue"] == str(item.message_id)
        assert "not an envelope" in attrs[DESCRIPTION]["StringValue"]
        rec = await rt.tracker.get(item.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
        assert rec.reason == "malformed-envelope"
        assert rec.queue == "Keep.Short"
        assert rec.raw == text
    finally:
        await cleanup(rt, prov)


async def test_dead_lettering_a_delayed_row_that_is_not_an_envelope_keeps_its_text(tmp_path):
    """The dispatcher's give-up path on its own (a forward that failed for another reason)."""
    _app, rt, prov = await make(tmp_path)
    await rt.open()
    try:
        item = await _store_raw_row(prov, "not json at all")
        await prov.dead_letter_delayed(item, "4 forward(s) failed; last: throttled")
        [letter] = dead_letters(prov, await prov._url("Keep.Short", dead=True))
        assert letter["Body"] == "not json at all"
        assert letter["MessageAttributes"][REASON]["StringValue"] == "malformed-envelope"
        assert "throttled" in letter["MessageAttributes"][DESCRIPTION]["StringValue"]
    finally:
        await cleanup(rt, prov)
