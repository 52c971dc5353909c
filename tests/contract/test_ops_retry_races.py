"""An operator's retry races the copy it sends, on every transport where a retry is a copy followed by
a removal (a dead-letter queue or a delayed store apart from the history).

The copy is sent first and the original removed after. If the copy runs in between and ends where the
original was (dead-lettered again; failed again and stored in the delayed store), its new place has
the same message id. The removal must take only what was there before the copy left: removing by
message id takes the copy's own new place too, and the message is then nowhere.

The race is made deterministic: the transport step that sends the copy is wrapped so that it returns
only once the copy has run and settled in its new place, i.e. the removal always comes after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest

from queueing_core import NonRetryableError, QueueMessage, Retry, RetryPolicy, queue
from queueing_core.clock import utcnow
from queueing_core.errors import InvalidOperation, ProviderError
from queueing_core.ops import OpsService
from queueing_core.providers.dead_letters import DeadLetterOps
from queueing_core.providers.side_stores import SideStoreOps
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery

from .harness import Harness, record, running, wait_until

#: the provider method that sends an operator's copy, per harness (the step between copy and removal)
COPY_STEP = {
    "rabbitmq": "_send_now",
    "sqs": "_send_now",
    "servicebus": "send_copy",
    "servicebus_live": "send_copy",
    "storage_queue": "put",
}
ONE_STEP = "the retry is one step there (the message is one row, or one item in memory): nothing to race"


@queue("opsrace-dead", max_attempts=3)
class Doomed(QueueMessage):
    n: int


#: a retry due in 20 minutes waits in the delayed store on RabbitMQ (any delay) and SQS (over 15 min)
@queue(
    "opsrace-later",
    max_attempts=5,
    retry=RetryPolicy(base=timedelta(minutes=20), max_delay=timedelta(minutes=20), jitter=0),
)
class Later(QueueMessage):
    n: int


def _doomed_app(harness: Harness) -> tuple[Any, list[int], list[bool]]:
    """An app whose ``Doomed`` handler records each run and dead-letters it while ``fatal[0]``."""
    app = harness.app()
    runs: list[int] = []
    fatal = [True]

    @app.handler()
    async def handle(msg: Doomed) -> None:
        runs.append(msg.n)
        if fatal[0]:
            raise NonRetryableError("the invoice is void")

    return app, runs, fatal


async def _one_dead_letter(harness: Harness) -> tuple[Runtime, Any, list[int], list[bool]]:
    """A runtime of :func:`_doomed_app` (the caller closes it) and one message it dead-lettered."""
    if harness.name not in COPY_STEP:
        pytest.skip(ONE_STEP)
    app, runs, fatal = _doomed_app(harness)
    rt = await harness.runtime(app)
    try:
        mid = (await app.enqueue(Doomed(n=1))).message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "DeadLettered"), what="dead-lettered")
    except BaseException:
        await rt.close()
        raise
    return rt, mid, runs, fatal


def _copy_settles_first(rt: Runtime, harness: Harness, settled: Callable[[], Awaitable[bool]]) -> list[str]:
    """Wrap the provider's copy step (once): after the copy is sent it waits until ``settled`` says the
    copy ran and took its new place, so the retry's removal comes after that. Returns a list that gets
    one entry when the wrapper ran."""
    name = COPY_STEP[harness.name]
    prov: Any = rt.provider
    real = getattr(prov, name)
    fired: list[str] = []

    async def send_then_wait(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        if not fired:
            fired.append(name)
            await wait_until(settled, what="the copy ran and settled before the removal")
        return result

    setattr(prov, name, send_then_wait)
    return fired


async def test_operator_retry_keeps_the_copys_own_new_dead_letter(harness: Harness) -> None:
    if harness.name not in COPY_STEP:
        pytest.skip(ONE_STEP)
    assert harness.dead_letters is not None
    app, runs, fatal = _doomed_app(harness)
    rt = await harness.runtime(app)
    assert isinstance(rt.provider, DeadLetterOps)
    try:
        r = await app.enqueue(Doomed(n=1))
        mid = r.message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "DeadLettered"), what="dead-lettered")

            async def copy_dead_lettered_again() -> bool:
                return len(runs) == 2 and await _status(rt, mid, "DeadLettered")

            fired = _copy_settles_first(rt, harness, copy_dead_lettered_again)
            await OpsService(rt).retry(mid)
            assert fired, "the copy step was not reached"
            assert len(runs) == 2

        # the original letter is gone, the copy's new one stays: exactly one, and the history agrees
        assert (await record(rt, mid)).status == "DeadLettered"
        await wait_until(
            lambda: _dead_letters_are(rt, harness, 1),
            what="one dead letter (the copy's own; the original removed)",
            timeout=15,
        )

        # and an operator can still bring it back
        fatal[0] = False
        async with running(rt):
            await OpsService(rt).retry(mid)
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the second retry ran")
        await wait_until(lambda: _dead_letters_are(rt, harness, 0), what="no dead letter left", timeout=15)
    finally:
        await rt.close()


async def test_a_retry_whose_send_failed_is_listed_as_dead_lettered_again_and_a_new_retry_runs_it(
    harness: Harness,
) -> None:
    """The transport refused the copy: the letter goes back to its queue, and so does its history (it
    showed Pending, as if a copy waited, and left the dead-letter list)."""
    rt, mid, runs, fatal = await _one_dead_letter(harness)
    try:
        fatal[0] = False
        await _retry_whose_copy_is_refused(rt, harness, mid)
        dead = MessageQuery(queue="opsrace-dead", status=("DeadLettered",))
        listed = await OpsService(rt).list_messages(dead)
        assert [m.message_id for m in listed.items] == [mid]
        rec = await record(rt, mid)
        assert (rec.reason, rec.attempt) != ("retried by an operator", 0), rec
        async with running(rt):
            await OpsService(rt).retry(mid)  # (the letter was handed back: this one finds it)
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the new retry ran")
        assert runs == [1, 1]
        await wait_until(lambda: _dead_letters_are(rt, harness, 0), what="no dead letter left", timeout=15)
    finally:
        await rt.close()


async def test_a_retry_whose_dead_letter_is_gone_and_whose_send_failed_leaves_it_listed(
    harness: Harness,
) -> None:
    """The dead letter left its queue while its history kept it (SQS keeps letters 14 days; a purge
    whose history delete failed): a retry still sends a copy from the history, and when that send fails
    the history is put back, not left Pending with nothing anywhere (found in review)."""
    rt, mid, _, fatal = await _one_dead_letter(harness)
    try:
        fatal[0] = False
        prov: Any = rt.provider
        assert await prov._dead_letters("opsrace-dead", {str(mid)}) == {str(mid)}  # (the letter alone)
        await _retry_whose_copy_is_refused(rt, harness, mid)
        assert (await record(rt, mid)).status == "DeadLettered"
    finally:
        await rt.close()


async def test_of_two_retries_that_read_the_same_record_only_one_sends_a_copy(harness: Harness) -> None:
    """Two operators retry the same dead letter at once, one retry going ahead between the other's
    read of the record and its write: that other one finds the record changed and is refused before it
    sends a copy (it would run the message twice), and it puts nothing back (the record it would put
    back, dead-lettered, would stand over the live copy), even where both read the same clock to the
    microsecond (found in review)."""
    rt, mid, runs, fatal = await _one_dead_letter(harness)
    try:
        fatal[0] = False
        sends = _counted(rt.provider, COPY_STEP[harness.name])
        at = utcnow()
        late, early = OpsService(rt, clock=lambda: at), OpsService(rt, clock=lambda: at)
        read = late.record

        async def read_then_the_other_retries(message_id: Any) -> Any:
            seen = await read(message_id)
            await early.retry(message_id)  # the other operator's click, between this read and its write
            return seen

        late.record = read_then_the_other_retries  # type: ignore[method-assign]
        with pytest.raises(InvalidOperation, match="changed while retrying"):
            await late.retry(mid)
        assert sends == [COPY_STEP[harness.name]], "not one copy sent, the early retry's alone"
        rec = await record(rt, mid)
        assert (rec.status, rec.reason) == ("Pending", "retried by an operator"), rec
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the early retry's copy ran")
        assert runs == [1, 1]
    finally:
        await rt.close()


async def test_a_retry_whose_copy_ran_before_its_send_failed_keeps_the_runs_record(harness: Harness) -> None:
    """The copy reached its queue and ran, and only then did the send raise (its answer was lost): the
    history keeps the run's outcome; the failed retry does not put the dead-lettered record back over
    it. The letter it handed back stays, a duplicate an operator may purge."""
    rt, mid, _, fatal = await _one_dead_letter(harness)
    try:
        async with running(rt):
            fatal[0] = False
            fired = _copy_settles_first(rt, harness, lambda: _status(rt, mid, "Succeeded"))
            real = getattr(rt.provider, COPY_STEP[harness.name])

            async def answer_lost(*args: Any, **kwargs: Any) -> Any:
                await real(*args, **kwargs)
                raise ProviderError("injected: the send's answer was lost")

            setattr(rt.provider, COPY_STEP[harness.name], answer_lost)
            with pytest.raises(ProviderError):
                await OpsService(rt).retry(mid)
            assert fired, "the copy step was not reached"
        assert (await record(rt, mid)).status == "Succeeded"
    finally:
        await rt.close()


async def test_operator_retry_of_a_delayed_message_keeps_the_copys_own_retry(harness: Harness) -> None:
    if harness.name not in COPY_STEP:
        pytest.skip(ONE_STEP)
    app = harness.app()
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Later) -> None:
        runs.append(msg.n)
        raise RuntimeError("downstream still down")

    rt = await harness.runtime(app)
    prov: Any = rt.provider
    if getattr(prov, "delayed", None) is None:
        await rt.close()
        pytest.skip(
            "no delayed store: the transport holds a retry's delay itself (it cannot be brought forward)"
        )
    physical = prov.physical("opsrace-later")
    try:
        r = await app.enqueue(Later(n=1))
        mid = r.message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "Failed"), what="the first failure")
            assert await prov.delayed.counts() == {physical: 1}  # its retry waits in the store

            async def copy_failed_and_stored_again() -> bool:
                return len(runs) == 2 and await prov.delayed.counts() == {physical: 2}

            fired = _copy_settles_first(rt, harness, copy_failed_and_stored_again)
            await OpsService(rt).retry(mid)
            assert fired, "the copy step was not reached"
            await wait_until(lambda: _status(rt, mid, "Failed"), what="the copy's failure recorded")

        # the original row is gone, the copy's own retry waits in the store
        assert await prov.delayed.counts() == {physical: 1}, "the retry took the copy's own new row too"
        assert await prov.delayed.holds(mid)
        assert len(runs) == 2
    finally:
        await rt.close()


async def _waiting_in_the_store(
    harness: Harness, runs: list[int], *, failures: int = 1, lease: float = 1.0
) -> tuple[Runtime, Any, Any]:
    """A ``Later`` message whose first ``failures`` runs failed (all but the last retried at once), so
    that it waits (20 minutes) in the delayed store with that many attempts used; rows held for a
    forward come back after ``lease`` seconds."""
    app = harness.app()

    @app.handler()
    async def handle(msg: Later) -> None:
        runs.append(msg.n)
        if len(runs) < failures:
            raise Retry(timedelta(milliseconds=50), "downstream down, soon back")
        if len(runs) == failures:
            raise RuntimeError("downstream down for a while")

    rt = await harness.runtime(app)
    prov: Any = rt.provider
    if not isinstance(prov, SideStoreOps):
        await rt.close()
        pytest.skip("no delayed store for retries: the transport holds a retry's delay itself")
    prov.delayed.lease = timedelta(seconds=lease)
    r = await app.enqueue(Later(n=1))

    async def waits_after_its_last_failure() -> bool:
        return len(runs) == failures and await _status(rt, r.message_id, "Failed")

    async with running(rt):
        await wait_until(waits_after_its_last_failure, what=f"{failures} failure(s), the last one recorded")
    assert await prov.delayed.holds(r.message_id)
    return rt, prov, r.message_id


def _counted(prov: Any, name: str) -> list[str]:
    """Wrap a provider's step: the list gets an entry each time it is called."""
    real = getattr(prov, name)
    calls: list[str] = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return await real(*args, **kwargs)

    setattr(prov, name, counted)
    return calls


async def _retry_whose_copy_is_refused(rt: Runtime, harness: Harness, mid: Any) -> None:
    """An operator's retry of ``mid`` whose copy the transport refuses (once): it raises."""
    failed = _fail_once(rt.provider, COPY_STEP[harness.name], ProviderError("injected: the copy was refused"))
    with pytest.raises(ProviderError):
        await OpsService(rt).retry(mid)
    assert failed, "the copy step was not reached"


def _fail_once(prov: Any, name: str, error: Exception) -> list[str]:
    real = getattr(prov, name)
    failed: list[str] = []

    async def once(*args: Any, **kwargs: Any) -> Any:
        if not failed:
            failed.append(name)
            raise error
        return await real(*args, **kwargs)

    setattr(prov, name, once)
    return failed


async def test_a_bring_forward_whose_send_failed_runs_the_message_when_the_hold_ends(
    harness: Harness,
) -> None:
    """The rows are made the operator's copy (fresh attempts), held for the store's lease, and the
    history reopened, in one transaction, before the send; a send that fails leaves the rows, which
    the history describes: a repeat of the retry meanwhile is refused (it is waiting, as the history
    says: a second copy would run it twice), and the rows are forwarded, with fresh attempts, when the
    hold ends: once, not when the retry's delay was due."""
    runs: list[int] = []
    rt, prov, mid = await _waiting_in_the_store(harness, runs, failures=2)
    try:
        failed = _fail_once(prov, "_send_now", ProviderError("the broker dropped the connection"))
        with pytest.raises(ProviderError):
            await OpsService(rt).retry(mid)
        assert failed
        rec = await record(rt, mid)
        assert (rec.status, rec.attempt, rec.not_before) == ("Pending", 0, None)
        assert await prov.delayed.holds(mid)  # the copy never left: the rows are all there is
        with pytest.raises(InvalidOperation, match="already waiting"):
            await OpsService(rt).retry(mid)

        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the held rows forwarded and run")
        assert runs == [1, 1, 1]  # two failures, then the operator's copy
        assert (await record(rt, mid)).attempt == 1  # with fresh attempts
        assert not await prov.delayed.holds(mid)
    finally:
        await rt.close()


async def test_of_two_bring_forwards_that_read_the_same_record_only_one_sends_a_copy(
    harness: Harness,
) -> None:
    """Two operators bring the same waiting message forward at once: one reads the record and the
    rows, the other holds them, reopens the history and sends its copy, and only then does the first
    hold the rows. The first finds the record changed and is refused before it sends a copy (both
    copies would run), its hold undone with it, even where both read the same clock (found in review:
    both went ahead)."""
    runs: list[int] = []
    rt, prov, mid = await _waiting_in_the_store(harness, runs)
    try:
        sends = _counted(prov, "_send_now")
        at = utcnow()
        late, early = OpsService(rt, clock=lambda: at), OpsService(rt, clock=lambda: at)
        read, take = late.record, prov.delayed.take_message
        early_sent, late_done = asyncio.Event(), asyncio.Event()

        async def take_once_the_late_one_is_done(*args: Any, **kwargs: Any) -> Any:
            if not early_sent.is_set():  # (the early one's: it has sent its copy)
                early_sent.set()
                await late_done.wait()
            return await take(*args, **kwargs)

        prov.delayed.take_message = take_once_the_late_one_is_done
        tasks: list[asyncio.Task[Any]] = []

        async def read_then_the_other_goes_ahead(message_id: Any) -> Any:
            seen = await read(message_id)
            tasks.append(asyncio.create_task(early.retry(message_id)))
            await early_sent.wait()
            return seen

        late.record = read_then_the_other_goes_ahead  # type: ignore[method-assign]
        try:
            with pytest.raises(InvalidOperation, match="changed while retrying"):
                await late.retry(mid)
        finally:
            late_done.set()
            await asyncio.gather(*tasks)
        assert sends == ["_send_now"], "not one copy sent, the early bring-forward's alone"
        rec = await record(rt, mid)
        assert (rec.status, rec.reason) == ("Pending", "retried by an operator"), rec
        assert not await prov.delayed.holds(mid), "the early one's rows were not taken"
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the early one's copy ran")
        assert runs == [1, 1]
    finally:
        await rt.close()


async def test_a_bring_forward_that_stops_before_taking_the_row_runs_the_message_once(
    harness: Harness,
) -> None:
    """The copy is sent, then taking the row fails: the row was made that copy and held for the store's
    lease (not left to wait out its delay), and its forward after the lease is known as a repeat of
    the copy, which had run by then: completed without running the handler, counted as a duplicate.
    The message had used two attempts: the row's own envelope, forwarded, would run again (its
    attempt is later than the copy's)."""
    runs: list[int] = []
    # (the copy runs at once; the held row comes back 5 s after the hold, time enough on a busy host)
    rt, prov, mid = await _waiting_in_the_store(harness, runs, failures=2, lease=5.0)
    try:
        failed = _fail_once(prov.delayed, "take_message", ProviderError("the database went away"))
        async with running(rt):
            with pytest.raises(ProviderError):
                await OpsService(rt).retry(mid)
            assert failed
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the copy ran")
            # the row comes back once its hold ends (5 s here, 60 s by default), not in 20 minutes
            await wait_until(
                lambda: _no_row(prov, mid), what="the held row forwarded after its hold", timeout=30
            )
            await wait_until(lambda: _duplicates(rt, mid, 1), what="its forward completed as a duplicate")
        assert runs == [1, 1, 1]  # two failures, then the copy
        assert (await record(rt, mid)).status == "Succeeded"
    finally:
        await rt.close()


async def test_a_purge_of_a_waiting_message_takes_its_row_and_history_together_and_counts_it(
    harness: Harness,
) -> None:
    """The row and its history go in one transaction (a purge that stopped between them would leave a
    record no later purge could match); the purge still counts the message it deleted."""
    runs: list[int] = []
    rt, prov, mid = await _waiting_in_the_store(harness, runs)
    try:
        done = await OpsService(rt).purge(MessageQuery(queue="opsrace-later", status=("Failed",)))
        assert done.deleted == 1
        assert not await prov.delayed.holds(mid)
        assert await rt.tracker.get(mid) is None
    finally:
        await rt.close()


async def test_a_whole_queue_purge_that_stops_after_the_delayed_store_leaves_no_history_behind(
    harness: Harness,
) -> None:
    """A whole queue's purge empties the delayed store first, then the queue and its dead letters: if
    it stops in between, the waiting message's row is gone, and so is its history (in the same
    transaction), which no purge by status could match any more."""
    runs: list[int] = []
    rt, prov, mid = await _waiting_in_the_store(harness, runs)
    try:
        failed = _fail_once(prov, "_purge_whole", ProviderError("the broker dropped the connection"))
        with pytest.raises(ProviderError):
            await OpsService(rt).purge(MessageQuery(queue="opsrace-later"), whole=True)
        assert failed
        assert not await prov.delayed.holds(mid)
        assert await rt.tracker.get(mid) is None
    finally:
        await rt.close()


async def test_a_purge_that_read_a_waiting_message_before_its_bring_forward_leaves_the_operators_copy(
    harness: Harness,
) -> None:
    """The purge read the message as waiting (Failed); then an operator's retry made its rows the copy
    it brings forward and reopened its history, and its send failed. The purge's rows are those whose
    history still says they wait: the held copy stays, and runs when the hold ends."""
    runs: list[int] = []
    rt, prov, mid = await _waiting_in_the_store(harness, runs)
    try:
        as_read = await record(rt, mid)
        assert as_read.status == "Failed"
        _fail_once(prov, "_send_now", ProviderError("the broker dropped the connection"))
        with pytest.raises(ProviderError):
            await OpsService(rt).retry(mid)
        removed = await prov.ops_remove(MessageQuery(queue="opsrace-later", status=("Failed",)), [as_read])
        assert not removed
        assert removed.forgotten == 0
        assert await prov.delayed.holds(mid)
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "Succeeded"), what="the held copy ran")
        assert runs == [1, 1]
    finally:
        await rt.close()


async def _no_row(prov: Any, mid: Any) -> bool:
    return not await prov.delayed.holds(mid)


async def _duplicates(rt: Runtime, mid: Any, n: int) -> bool:
    rec = await rt.tracker.get(mid)
    return rec is not None and (rec.duplicates or 0) == n


async def _status(rt: Runtime, mid: Any, status: str) -> bool:
    rec = await rt.tracker.get(mid)
    return rec is not None and rec.status == status


async def _dead_letters_are(rt: Runtime, harness: Harness, n: int) -> bool:
    assert harness.dead_letters is not None
    await asyncio.sleep(0.05)
    return await harness.dead_letters(rt, "opsrace-dead") == n


@queue("opsrace-bulky", max_attempts=1)
class Bulky(QueueMessage):
    blob: str


#: where the history keeps a large body or many headers only in part: Azure Tables, whose record has a
#: size limit (a body's JSON over 224,000 characters; headers over 32,000), beside these transports
CUT_SHORT_BY_HISTORY = {
    # a body that Service Bus takes whole (220 KB of UTF-8) and Tables keeps only in part (its JSON,
    # with every "é" escaped, is 660,000 characters)
    "servicebus": ({"blob": "é" * 110_000}, None),
    # Storage Queues take 47 KB, so a body fits Tables whole; 40 headers of 850 characters do not
    "storage_queue": ({"blob": "b"}, {f"h{i}": "v" * 850 for i in range(40)}),
}


async def test_operator_retry_refuses_what_the_history_keeps_only_in_part(harness: Harness) -> None:
    """A retry sends the message again from its history and then removes its dead letter. Where the
    history keeps the body (or the headers) only in part, that copy would carry the marker standing
    in for them, and the letter removed after it was the only whole copy: the message would be lost.
    The retry is refused instead, and the dead letter stays, whole."""
    if harness.name not in CUT_SHORT_BY_HISTORY:
        pytest.skip("the history keeps a message whole there (or holds no copy apart from the message)")
    assert harness.dead_letters is not None
    body, headers = CUT_SHORT_BY_HISTORY[harness.name]
    app = harness.app()

    @app.handler()
    async def handle(msg: Bulky) -> None:
        raise NonRetryableError("declined")

    rt = await harness.runtime(app)
    try:
        r = await app.enqueue(Bulky(**body), headers=headers)
        mid = r.message_id
        async with running(rt):
            await wait_until(lambda: _status(rt, mid, "DeadLettered"), what="dead-lettered")
        kept = await record(rt, mid)
        # (the premise: the history holds a marker in place of the body, or of some headers)
        if headers is None:
            assert kept.body is not None
            assert kept.body != body
        else:
            assert len(kept.headers) < len(headers)
        with pytest.raises(InvalidOperation, match="only in part"):
            await OpsService(rt).retry(mid)
        assert await harness.dead_letters(rt, "opsrace-bulky") == 1
        assert (await record(rt, mid)).status == "DeadLettered"
    finally:
        await rt.close()
