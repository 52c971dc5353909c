"""Azure Tables control store and tracker against a real Azurite.

Behaviour both durable and memory implementations share runs against both (``impl`` parameter), so
they keep one contract; Tables-only behaviour (prune, size limits, escaping, errors) runs on Azurite.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import pytest
from azure.data.tables.aio import TableClient, TableServiceClient

from queueing_core.control import MemoryControlStore
from queueing_core.control.base import ControlStore
from queueing_core.errors import ConfigurationError, InvalidArgument, ProviderError, ProviderUnavailable
from queueing_core.options import CircuitBreakerOptions
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.tables import (
    TablesControlStore,
    TablesTracker,
    _encode_cursor,
    escape_key,
    tables_from_connection,
    unescape_key,
)
from queueing_core.tracking import MemoryTracker, MessageQuery, MessageRecord, Tracker
from tests.azurite import AzuriteService

T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
OPTS = CircuitBreakerOptions(
    failure_threshold=3, cooldown=timedelta(seconds=30), probe_timeout=timedelta(minutes=1)
)
SPECIAL = "a/b#c?d"
NASTY = "q'u%o!41\\te\t\x7f/é😀"


def table_name() -> str:
    return f"t{uuid4().hex[:24]}"


def rec(i: int, **fields: Any) -> MessageRecord:
    data: dict[str, Any] = {
        "message_id": uuid4(),
        "tracking_id": uuid4(),
        "type": "T",
        "queue": "q",
        "status": "Pending",
        "created_at": T0 + timedelta(seconds=i, microseconds=i),
        "updated_at": T0,
    }
    data.update(fields)
    return MessageRecord(**data)


# --- fixtures ----------------------------------------------------------------------------------


async def _tables_clients(azurite: AzuriteService, name: str, n: int) -> list[TableClient]:
    return [TableClient.from_connection_string(azurite.connection_string, name) for _ in range(n)]


async def _drop(azurite: AzuriteService, name: str) -> None:
    async with TableClient.from_connection_string(azurite.connection_string, name) as client:
        await client.delete_table()


@pytest.fixture(params=["memory", "tables", "sqlite"])
async def stores(
    request: pytest.FixtureRequest, tmp_path
) -> AsyncIterator[tuple[ControlStore, ControlStore]]:
    """Two handles on one shared control state (two Functions instances, two SQL hosts)."""
    if request.param == "memory":
        one = MemoryControlStore()
        yield one, one
        return
    if request.param == "sqlite":
        hosts = [SqlProvider(f"sqlite:///{tmp_path}/control.db") for _ in range(2)]
        yield hosts[0].control_store(), hosts[1].control_store()
        for host in hosts:
            await host.close()
        return
    azurite: AzuriteService = request.getfixturevalue("azurite")
    name = table_name()
    a, b = (TablesControlStore(c, create_table=True) for c in await _tables_clients(azurite, name, 2))
    yield a, b
    await _drop(azurite, name)
    await a.aclose()
    await b.aclose()


@pytest.fixture(params=["memory", "tables"])
async def tracker(request: pytest.FixtureRequest) -> AsyncIterator[Tracker]:
    if request.param == "memory":
        yield MemoryTracker()
        return
    azurite: AzuriteService = request.getfixturevalue("azurite")
    name = table_name()
    (client,) = await _tables_clients(azurite, name, 1)
    tr = TablesTracker(client, create_table=True)
    yield tr
    await _drop(azurite, name)
    await tr.aclose()


@pytest.fixture
async def tables_tracker(azurite: AzuriteService) -> AsyncIterator[TablesTracker]:
    name = table_name()
    (client,) = await _tables_clients(azurite, name, 1)
    tr = TablesTracker(client, create_table=True)
    yield tr
    await _drop(azurite, name)
    await tr.aclose()


async def all_pages(tr: Tracker, q: MessageQuery, limit: int) -> list[list[MessageRecord]]:
    pages, cursor = [], None
    while True:
        page = await tr.query(q, limit=limit, cursor=cursor)
        assert len(page.items) <= limit
        pages.append(page.items)
        cursor = page.next_cursor
        if cursor is None:
            return pages


# --- control store: shared contract ------------------------------------------------------------


async def test_identity_documents_change_by_compare_and_set_across_instances(stores):
    a, b = stores
    identity = "sku/ü 1" * 30  # any text up to the identity limit, not a valid key by itself
    assert await a.identity_doc("Price", identity) is None
    assert await a.put_identity_doc("Price", identity, {"waiting": ["1"]}, None)
    assert not await b.put_identity_doc("Price", identity, {"waiting": ["2"]}, None)  # created already
    found = await b.identity_doc("Price", identity)
    assert found is not None
    doc, token = found
    assert doc == {"waiting": ["1"]}
    assert await b.put_identity_doc("Price", identity, {"waiting": ["3"]}, token)
    assert not await a.put_identity_doc("Price", identity, {"waiting": ["4"]}, token)  # a stale version
    again = await a.identity_doc("Price", identity)
    assert again is not None
    assert again[0] == {"waiting": ["3"]}
    assert await a.identity_doc("Other", identity) is None  # keyed by type and identity
    assert (await a.state()).cancelled == frozenset()  # not mistaken for any other control state


async def test_pause_and_resume_are_visible_to_another_instance(stores):
    a, b = stores
    await a.set_paused("queue", "orders", True)
    await a.set_paused("type", "Invoice", True)
    state = await b.state()
    assert state.paused_queues == {"orders"}
    assert state.paused_types == {"Invoice"}
    assert state.is_paused("orders", "X")
    assert state.is_paused("other", "Invoice")
    assert not state.is_paused("other", "X")
    await a.set_paused("queue", "orders", True)  # idempotent
    await b.set_paused("queue", "orders", False)
    await b.set_paused("queue", "never-paused", False)
    state = await a.state()
    assert state.paused_queues == frozenset()
    assert state.paused_types == {"Invoice"}


async def test_names_with_special_characters_round_trip(stores):
    a, b = stores
    await a.set_paused("queue", SPECIAL, True)
    await a.set_paused("type", NASTY, True)
    await a.record_failure(NASTY, OPTS, T0)
    state = await b.state()
    assert state.paused_queues == {SPECIAL}
    assert state.paused_types == {NASTY}
    assert state.circuit(NASTY).consecutive_failures == 1
    assert set(state.circuits) == {NASTY}


async def test_circuit_goes_open_probe_closed(stores):
    a, b = stores
    assert (await a.record_failure("T", OPTS, T0)).state == "closed"
    second = await b.record_failure("T", OPTS, T0)
    assert (second.state, second.consecutive_failures) == ("closed", 2)
    opened = await a.record_failure("T", OPTS, T0)
    assert opened.state == "open"
    assert opened.opened_at == T0
    assert opened.open_until == T0 + OPTS.cooldown
    seen = (await b.state()).circuit("T")
    assert seen == opened  # datetimes survive the round trip to the microsecond

    assert not await b.acquire_probe("T", OPTS, T0 + timedelta(seconds=10))  # cooling down
    probe_at = T0 + timedelta(seconds=31)
    assert await b.acquire_probe("T", OPTS, probe_at)
    half = (await a.state()).circuit("T")
    assert (half.state, half.probe_until) == ("half_open", probe_at + OPTS.probe_timeout)
    assert not await a.acquire_probe("T", OPTS, probe_at + timedelta(seconds=1))  # one probe at a time
    later = probe_at + OPTS.probe_timeout
    assert await a.acquire_probe("T", OPTS, later)  # the first probe never reported

    reopened = await b.record_failure("T", OPTS, later, later + OPTS.probe_timeout)  # the probe failed
    assert (reopened.state, reopened.open_until, reopened.probe_until) == (
        "open",
        later + OPTS.cooldown,
        None,
    )
    assert (await a.state()).circuit("T").probe_until is None
    assert await a.acquire_probe("T", OPTS, later + OPTS.cooldown)
    closed = await b.record_success("T", later + OPTS.cooldown + OPTS.probe_timeout)  # the probe's
    assert (closed.state, closed.consecutive_failures) == ("closed", 0)
    state = await a.state()
    assert "T" not in state.circuits
    assert state.circuit("T").state == "closed"
    assert (await a.record_success("T")).state == "closed"  # nothing stored: still fine


async def test_a_success_closes_the_circuit_only_from_the_probe_that_is_out(stores):
    """A success from a run admitted while the circuit was closed (it began before failures beside it
    opened the circuit) and a late success of a probe another has replaced (it outlived
    probe_timeout) leave the circuit as it is; the probe that is out closes it."""
    a, b = stores
    await a.record_failure("T", OPTS, T0)
    assert (await b.record_success("T")).consecutive_failures == 0  # closed: the count is reset
    for _ in range(3):
        await a.record_failure("T", OPTS, T0)
    assert (await b.record_success("T")).state == "open"  # a run from before the opening
    assert (await a.state()).circuit("T").state == "open"

    first = T0 + OPTS.cooldown
    assert await a.acquire_probe("T", OPTS, first)
    assert (await b.record_success("T")).state == "half_open"  # not a probe: the probe decides
    second = first + OPTS.probe_timeout  # the first probe never reported in time
    assert await b.acquire_probe("T", OPTS, second)
    late = await a.record_success("T", first + OPTS.probe_timeout)  # the first probe, late
    assert (late.state, late.probe_until) == ("half_open", second + OPTS.probe_timeout)
    assert (await b.state()).circuit("T").state == "half_open"
    closed = await b.record_success("T", second + OPTS.probe_timeout)
    assert closed.state == "closed"
    assert (await a.state()).circuit("T").state == "closed"


async def test_reset_circuit(stores):
    a, b = stores
    for _ in range(3):
        await a.record_failure("T", OPTS, T0)
    assert (await b.state()).circuit("T").state == "open"
    await b.reset_circuit("T")
    await b.reset_circuit("never-opened")
    assert (await a.state()).circuits == {}


async def test_concurrent_acquire_probe_admits_exactly_one(stores):
    a, b = stores
    for _ in range(3):
        await a.record_failure("T", OPTS, T0)
    at = T0 + OPTS.cooldown
    results = await asyncio.gather(*(s.acquire_probe("T", OPTS, at) for s in [a, b] * 5))
    assert sum(results) == 1
    assert (await a.state()).circuit("T").state == "half_open"


async def test_a_probe_handed_back_frees_the_circuit_for_the_next_probe_only_if_still_out(stores):
    """A probe released unrun (its host stopping) lets the next message probe at once; a release that
    comes after the probe was replaced (it timed out) or reported changes nothing."""
    a, b = stores
    for _ in range(3):
        await a.record_failure("T", OPTS, T0)
    at = T0 + OPTS.cooldown
    assert await a.acquire_probe("T", OPTS, at)
    assert not await b.acquire_probe("T", OPTS, at + timedelta(seconds=1))  # held
    await a.release_probe("T", at + OPTS.probe_timeout, at + timedelta(seconds=2))
    assert (await b.state()).circuit("T").probe_until == at + timedelta(seconds=2)
    assert await b.acquire_probe("T", OPTS, at + timedelta(seconds=2))  # at once, not 5 min later
    # the first probe released again, after b's probe replaced it: b's stays
    await a.release_probe("T", at + OPTS.probe_timeout, at + timedelta(seconds=3))
    assert (await a.state()).circuit("T").probe_until == at + timedelta(seconds=2) + OPTS.probe_timeout
    await b.record_success("T", at + timedelta(seconds=2) + OPTS.probe_timeout)
    await b.release_probe("T", at + timedelta(seconds=2) + OPTS.probe_timeout, at + timedelta(seconds=4))
    assert (await a.state()).circuit("T").state == "closed"


async def test_concurrent_failures_are_all_counted(stores):
    a, b = stores
    many = CircuitBreakerOptions(failure_threshold=1000)
    await asyncio.gather(*(s.record_failure("T", many, T0) for s in [a, b] * 8))
    assert (await b.state()).circuit("T").consecutive_failures == 16


# --- tracker: shared contract ------------------------------------------------------------------


async def test_upsert_get_and_merge_keep_body_and_raw(tracker):
    r = rec(1, body={"order": 7, "items": ["a", "é"]}, raw='{"bad": ', headers={"h": "v"}, locked_by="w1")
    await tracker.upsert([r])
    got = await tracker.get(r.message_id)
    assert got == r
    later = r.model_copy(
        update={
            "status": "Succeeded",
            "body": None,
            "raw": None,
            "locked_by": None,
            "attempt": 1,
            "result": [1],
        }
    )
    await tracker.upsert([later])
    got = await tracker.get(r.message_id)
    assert got is not None
    assert (got.status, got.attempt, got.locked_by, got.result) == ("Succeeded", 1, None, [1])
    assert got.body == {"order": 7, "items": ["a", "é"]}
    assert got.raw == '{"bad": '
    assert await tracker.get(uuid4()) is None


async def test_upsert_folds_repeats_within_one_call(tracker):
    r = rec(1, body={"x": 1})
    await tracker.upsert([r, r.model_copy(update={"status": "Leased", "body": None})])
    got = await tracker.get(r.message_id)
    assert got is not None
    assert (got.status, got.body) == ("Leased", {"x": 1})


async def test_a_late_enqueue_record_keeps_a_fast_workers_outcome(tracker):
    # the producer writes its record after the send; a worker may have finished the message first
    done = rec(3, status="Succeeded", attempt=1, result=[1], body={"n": 3})
    failed = rec(4, status="Failed", attempt=1, last_error="ValueError: later", body={"n": 4})
    for r in (done, failed):
        await tracker.upsert([r])
    sent = [
        r.model_copy(update={"status": "Pending", "attempt": 0, "result": None, "last_error": None})
        for r in (done, failed)
    ]
    fresh = rec(5, body={"n": 5})
    await tracker.upsert([*sent, fresh])  # one call: a transaction in which two already exist
    assert (await tracker.get(done.message_id)).status == "Succeeded"
    assert (await tracker.get(failed.message_id)).status == "Failed"
    assert (await tracker.get(fresh.message_id)).body == {"n": 5}
    # a record that is no outcome is still updated: a released lease turns back into Pending
    leased = rec(6, status="Leased", locked_by="w1", body={"n": 6})
    await tracker.upsert([leased])
    await tracker.upsert([leased.model_copy(update={"status": "Pending", "locked_by": None, "body": None})])
    assert (await tracker.get(leased.message_id)).status == "Pending"
    # an operator's retry does replace an outcome
    await tracker.reopen(sent[0])
    assert (await tracker.get(done.message_id)).status == "Pending"


async def test_every_field_round_trips(tracker):
    r = rec(
        2,
        attempt=3,
        correlation_id="c-1",
        not_before=T0 + timedelta(minutes=1),
        expires_at=T0 + timedelta(hours=4),
        locked_by="host-1",
        locked_until=T0 + timedelta(seconds=30),
        last_error="boom",
        reason="max-attempts",
        description="gave up",
        archived=True,
        archived_at=T0 + timedelta(days=1),
        headers={"traceparent": "00-abc", "x": ""},
        body={"nested": {"n": None, "f": 1.5}},
        result={"ok": True},
    )
    await tracker.upsert([r])
    assert await tracker.get(r.message_id) == r


async def test_query_filters(tracker):
    rs = [
        rec(0, queue="a", type="A", status="Pending"),
        rec(1, queue="a", type="B", status="DeadLettered", correlation_id="c1"),
        rec(2, queue="b", type="A", status="Expired", archived=True),
        rec(3, queue="b", type="B", status="Succeeded", correlation_id="c1"),
        rec(4, queue=SPECIAL, type="A", status="DeadLettered"),
    ]
    await tracker.upsert(rs)

    async def ids(**q: Any) -> set[UUID]:
        page = await tracker.query(MessageQuery(**q), limit=100)
        assert page.next_cursor is None
        return {r.message_id for r in page.items}

    def pick(*i: int) -> set[UUID]:
        return {rs[k].message_id for k in i}

    assert await ids() == pick(0, 1, 2, 3, 4)
    assert await ids(queue="a") == pick(0, 1)
    assert await ids(queue=SPECIAL) == pick(4)
    assert await ids(type="A") == pick(0, 2, 4)
    assert await ids(status=("DeadLettered", "Expired")) == pick(1, 2, 4)
    assert await ids(status=()) == set()
    assert await ids(created_from=T0 + timedelta(seconds=1, microseconds=1)) == pick(1, 2, 3, 4)
    assert await ids(created_to=T0 + timedelta(seconds=3, microseconds=3)) == pick(0, 1, 2)
    assert await ids(created_from=rs[1].created_at, created_to=rs[3].created_at) == pick(1, 2)
    assert await ids(archived=True) == pick(2)
    assert await ids(archived=False) == pick(0, 1, 3, 4)
    assert await ids(correlation_id="c1") == pick(1, 3)
    assert await ids(queue="b", type="B", correlation_id="c1", status=("Succeeded",)) == pick(3)
    assert await ids(queue="nope") == set()


async def test_paging_covers_everything_once_newest_first_in_a_queue(tracker):
    rs = [rec(i, queue="a" if i % 3 else "b", status="Failed" if i % 2 else "Pending") for i in range(23)]
    await tracker.upsert(rs)
    pages = await all_pages(tracker, MessageQuery(), limit=5)
    seen = [r.message_id for p in pages for r in p]
    assert len(seen) == 23
    assert set(seen) == {r.message_id for r in rs}

    in_a = [r for p in await all_pages(tracker, MessageQuery(queue="a"), limit=4) for r in p]
    assert [r.created_at for r in in_a] == sorted((r.created_at for r in rs if r.queue == "a"), reverse=True)

    failed = [r for p in await all_pages(tracker, MessageQuery(status=("Failed",)), limit=3) for r in p]
    assert sorted(r.message_id for r in failed) == sorted(r.message_id for r in rs if r.status == "Failed")

    with pytest.raises(InvalidArgument, match="cursor"):  # a ValueError the ops API answers with 422
        await tracker.query(MessageQuery(), limit=5, cursor="not a cursor!")


async def test_a_cursor_the_service_refuses_is_an_invalid_argument_not_a_provider_error(
    tables_tracker, monkeypatch
):
    """Azurite takes any well-formed token; Azure decodes its own and may answer 400 to a forged one.
    That answer (injected here) to the caller's token is the caller's mistake (422 over HTTP); without
    a caller's token it is the store's (a provider error)."""
    from azure.core.exceptions import HttpResponseError

    await tables_tracker.upsert([rec(i) for i in range(3)])
    forged = _encode_cursor({"PartitionKey": "1!8!forged", "RowKey": "1!8!forged"})

    async def refusing(*_args, **_kwargs):
        error = HttpResponseError(message="InvalidInput")
        error.status_code = 400
        raise error

    monkeypatch.setattr(TablesTracker, "_page", staticmethod(refusing))
    with pytest.raises(InvalidArgument, match="cursor"):
        await tables_tracker.query(MessageQuery(), limit=5, cursor=forged)
    with pytest.raises(ProviderError, match="400"):
        await tables_tracker.query(MessageQuery(), limit=5)


async def test_counts_and_delete(tracker):
    rs = [
        rec(i, queue="a" if i < 6 else "b", status="DeadLettered" if i % 3 == 0 else "Succeeded")
        for i in range(9)
    ]
    await tracker.upsert(rs)
    assert await tracker.counts() == {
        ("a", "DeadLettered"): 2,
        ("a", "Succeeded"): 4,
        ("b", "DeadLettered"): 1,
        ("b", "Succeeded"): 2,
    }
    assert await tracker.delete(MessageQuery(queue="a", status=("DeadLettered",))) == 2
    assert await tracker.delete(MessageQuery(queue="b")) == 3
    assert await tracker.delete(MessageQuery(queue="b")) == 0
    assert await tracker.counts() == {("a", "Succeeded"): 4}
    assert await tracker.get(rs[0].message_id) is None
    assert await tracker.get(rs[1].message_id) is not None


# --- Tables only -------------------------------------------------------------------------------


def test_escape_key_is_reversible_and_safe():
    for name in [SPECIAL, NASTY, "!id", "!41", "plain-name_1.2", "", "100%"]:
        key = escape_key(name)
        assert unescape_key(key) == name
        assert not set(key) & set("/\\#?%'")
        assert all(ord(c) >= 0x20 and not 0x7F <= ord(c) <= 0x9F for c in key)
        assert key != "!id"
    assert escape_key(SPECIAL) == "a!2Fb!23c!3Fd"


async def test_prune_deletes_old_terminal_records_only(tables_tracker):
    now = T0 + timedelta(days=30)
    old = now - timedelta(days=15)
    doomed = [
        rec(1, status="Succeeded", updated_at=old),
        rec(2, status="DeadLettered", updated_at=old, queue="z"),
    ]
    kept = [
        rec(3, status="Pending", updated_at=old),
        rec(4, status="Succeeded", updated_at=now - timedelta(days=13)),
        rec(5, status="Abandoned", updated_at=old),
    ]
    await tables_tracker.upsert(doomed + kept)
    assert await tables_tracker.prune(now) == 2
    for r in doomed:
        assert await tables_tracker.get(r.message_id) is None
    for r in kept:
        assert await tables_tracker.get(r.message_id) is not None
    assert await tables_tracker.prune(now) == 0
    # the id index entities went with the records: only the kept ones' remain
    raw = [e async for e in tables_tracker._table.client.list_entities()]
    assert len(raw) == 2 * len(kept)


async def test_prune_and_purge_leave_a_record_written_after_they_read_it(tables_tracker, monkeypatch):
    """A review found prune deleting by key what it had read a moment before: an operator's retry
    that reopened an old record in between (Pending, its copy on the queue) lost its record and its
    index entity, and the queued message was in no listing. Records are now deleted as they were read
    (their ETags); the same for a purge's delete of history. One of the page's records is reopened,
    the other is deleted."""
    now = T0 + timedelta(days=30)
    old = now - timedelta(days=15)
    reopened, finished = (
        rec(1, status="Cancelled", updated_at=old),
        rec(2, status="Cancelled", updated_at=old),
    )
    read_page = TablesTracker._page

    async def an_operator_retries_meanwhile(client, f, size, token, select=None):
        page = await read_page(client, f, size, token, select)
        await tables_tracker.reopen(reopened.model_copy(update={"status": "Pending", "updated_at": now}))
        return page

    for delete in (
        lambda: tables_tracker.prune(now),
        lambda: tables_tracker.delete(MessageQuery(status=("Cancelled",))),
    ):
        await tables_tracker.upsert([reopened, finished])
        monkeypatch.setattr(TablesTracker, "_page", staticmethod(an_operator_retries_meanwhile))
        deleted = await delete()
        monkeypatch.setattr(TablesTracker, "_page", staticmethod(read_page))
        assert deleted == 1
        assert await tables_tracker.get(finished.message_id) is None
        kept = await tables_tracker.get(reopened.message_id)  # (found by its id: its index stayed)
        assert kept is not None
        assert kept.status == "Pending"
        await tables_tracker.delete(MessageQuery())


async def test_large_fields_never_fail_an_upsert(tables_tracker):
    fits = rec(1, body={"blob": "x" * 200_000})  # 200 KB: split across properties, read back whole
    await tables_tracker.upsert([fits])
    got = await tables_tracker.get(fits.message_id)
    assert got is not None
    assert got.body == fits.body

    huge = rec(
        2,
        body={"blob": "é" * 400_000},
        raw="😀" * 199_999 + "\udcff",  # a lone surrogate, as surrogateescape decoding leaves
        result=["r" * 100_000],
        headers={f"h{i}": "v" * 1000 for i in range(60)},
        last_error="e" * 50_000,
        description="d" * 50_000,
    )
    await tables_tracker.upsert([huge, rec(3, body={"blob": "y" * 220_000}), rec(4)])
    got = await tables_tracker.get(huge.message_id)
    assert got is not None
    assert got.body is not None
    assert got.body["_truncated"] is True
    assert got.body["_original_chars"] > 400_000
    assert got.body["_preview"].startswith('{"blob":"\\u00e9')
    assert got.raw is not None
    assert got.raw.startswith("😀😀")
    assert got.raw.endswith("...[truncated, 200000 chars]")
    assert got.result["_truncated"] is True
    assert len(got.headers) == 32  # 31 kept plus the marker
    assert got.headers["x-queueing-truncated"].startswith("29 headers dropped")
    assert got.last_error is not None
    assert got.last_error.endswith("...[truncated, 50000 chars]")
    assert len(got.last_error) <= 16_000
    page = await tables_tracker.query(MessageQuery(), limit=10)
    assert len(page.items) == 4
    assert {fits.message_id, huge.message_id} <= {r.message_id for r in page.items}


async def test_many_records_in_one_upsert_use_batches(tables_tracker):
    # more than one transaction's 100 operations in one partition, plus a second partition
    rs = [rec(i, queue="b" if i % 25 == 0 else "a", body={"i": i}) for i in range(125)]
    await tables_tracker.upsert(rs)
    assert await tables_tracker.counts() == {("a", "Pending"): 120, ("b", "Pending"): 5}
    assert await tables_tracker.delete(MessageQuery()) == 125
    assert [e async for e in tables_tracker._table.client.list_entities()] == []


async def test_factory_creates_tables_lazily(azurite):
    control, history = table_name(), table_name()
    store, tracker = tables_from_connection(
        azurite.connection_string, control_table=control, tracker_table=history
    )
    async with TableServiceClient.from_connection_string(azurite.connection_string) as service:

        async def names() -> set[str]:
            return {t.name async for t in service.list_tables()}

        assert not {control, history} & await names()
        await store.set_paused("queue", "q", True)
        assert (await store.state()).paused_queues == {"q"}
        assert await tracker.query(MessageQuery()) is not None
        assert {control, history} <= await names()
        await store.aclose()
        await tracker.aclose()
        await service.delete_table(control)
        await service.delete_table(history)


def test_factory_rejects_bad_configuration():
    with pytest.raises(ConfigurationError, match="no connection string"):
        tables_from_connection()
    with pytest.raises(ConfigurationError, match="QUEUEING_CONTROL_TABLE"):
        tables_from_connection("UseDevelopmentStorage=true", control_table="bad-name")
    with pytest.raises(ConfigurationError, match="both"):
        tables_from_connection(
            "UseDevelopmentStorage=true", table_service_uri="https://x.table.core.windows.net"
        )


async def test_unreachable_service_is_provider_unavailable():
    dead = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
        "TableEndpoint=http://127.0.0.1:9/devstoreaccount1;"
    )
    async with TableClient.from_connection_string(dead, "tdead", retry_total=0) as client:
        with pytest.raises(ProviderUnavailable):
            await TablesControlStore(client).state()
        with pytest.raises(ProviderUnavailable):
            await TablesTracker(client).upsert([rec(1)])


async def test_service_errors_are_provider_errors(azurite):
    async with TableClient.from_connection_string(azurite.connection_string, table_name()) as client:
        store = TablesControlStore(client)  # the table was never created
        with pytest.raises(ProviderError) as info:
            await store.state()
        assert not isinstance(info.value, ProviderUnavailable)
        with pytest.raises(ProviderError):
            await store.record_failure("T", OPTS, T0)
        with pytest.raises(ProviderError):
            await TablesTracker(client).upsert([rec(1)])


async def test_prune_keeps_the_history_of_letters_the_transport_keeps(tables_tracker):
    """A dead-letter queue that never drops a letter (Service Bus's, a Storage poison queue) keeps the
    letter past the history's retention: pruning its record left a letter in no listing,
    which a retry could not find (a review found it). Such statuses are kept; the others go."""
    now = T0 + timedelta(days=30)
    old = now - timedelta(days=15)
    dead = rec(11, status="DeadLettered", updated_at=old, queue="z")
    expired = rec(12, status="Expired", updated_at=old)
    done = rec(13, status="Succeeded", updated_at=old)
    await tables_tracker.upsert([dead, expired, done])
    assert await tables_tracker.prune(now, ("DeadLettered", "Expired")) == 1
    assert await tables_tracker.get(done.message_id) is None
    assert (await tables_tracker.get(dead.message_id)).status == "DeadLettered"
    assert await tables_tracker.prune(now, ("DeadLettered",)) == 1  # Storage: expired ones are deleted
    assert await tables_tracker.get(expired.message_id) is None
    assert await tables_tracker.get(dead.message_id) is not None
