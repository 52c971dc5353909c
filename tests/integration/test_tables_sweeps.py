"""Sweeps of the Tables stores delete only rows that are still as they listed them.

A sweep lists rows and deletes them one request later; another host may write one of them in between.
The cancellation sweep (requests past their keeping time, swept by each set_cancel) deleted a request
made again meanwhile, so a message the operator was told is cancelled ran; the history's delete (prune,
purge) deleted the id index entry of a record written again meanwhile, so the record was listed but
found by no lookup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import uuid4

import pytest
from azure.data.tables import UpdateMode
from azure.data.tables.aio import TableClient

from queueing_core.control.base import CANCEL_KEPT
from queueing_core.providers.tables import TablesControlStore, TablesTracker
from queueing_core.tracking import MessageQuery
from tests.azurite import AzuriteService

from .test_tables import T0, _drop, _tables_clients, rec, table_name, tables_tracker  # noqa: F401


@pytest.fixture
async def two_hosts(azurite: AzuriteService) -> AsyncIterator[tuple[TableClient, TableClient]]:
    """Two clients on one new table (two Functions instances); the table is dropped after."""
    name = table_name()
    a, b = await _tables_clients(azurite, name, 2)
    yield a, b
    await _drop(azurite, name)


async def test_the_cancel_sweep_keeps_a_request_made_again_after_it_listed_it(
    two_hosts: tuple[TableClient, TableClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_client, b_client = two_hosts
    a, b = TablesControlStore(a_client, create_table=True), TablesControlStore(b_client, create_table=True)
    again, other = uuid4(), uuid4()
    now = datetime.now(UTC)
    # a request that lapsed unswept (no set_cancel since)
    await a.set_cancel(again, True, now - CANCEL_KEPT - timedelta(hours=1))
    delete = b_client.delete_entity

    async def requested_again_first(*args: Any, **kwargs: Any) -> None:
        if str(again) in args:
            # between host B's listing and its delete, an operator cancels the message again on host A
            await a.set_cancel(again, True, datetime.now(UTC))
        await delete(*args, **kwargs)

    monkeypatch.setattr(b_client, "delete_entity", requested_again_first)
    await b.set_cancel(other, True, now)  # another message's request, and host B's sweep
    assert (await a.state()).cancelled == {again, other}
    await a.aclose()
    await b.aclose()


async def test_the_cancel_sweep_deletes_a_lapsed_request(two_hosts: tuple[TableClient, TableClient]) -> None:
    a_client, b_client = two_hosts
    a, b = TablesControlStore(a_client, create_table=True), TablesControlStore(b_client, create_table=True)
    lapsed, other = uuid4(), uuid4()
    now = datetime.now(UTC)
    await a.set_cancel(lapsed, True, now - CANCEL_KEPT - timedelta(hours=1))
    await b.set_cancel(other, True, now)
    rows = [e async for e in a_client.list_entities()]
    assert [e["RowKey"] for e in rows] == [str(other)]
    await a.aclose()
    await b.aclose()


@pytest.mark.parametrize("how", ["prune", "purge"])
async def test_a_history_delete_keeps_the_index_of_a_record_written_again_meanwhile(
    two_hosts: tuple[TableClient, TableClient], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    a_client, b_client = two_hosts
    a, b = TablesTracker(a_client, create_table=True), TablesTracker(b_client, create_table=True)
    now = T0 + timedelta(days=30)
    old = rec(1, status="Succeeded", updated_at=now - timedelta(days=15), body={"n": 1})
    await a.upsert([old])
    delete_unchanged = TablesTracker._delete_unchanged

    async def written_again_after_the_record_went(client: TableClient, batch: list[dict[str, Any]]) -> Any:
        gone = await delete_unchanged(client, batch)
        if batch[0]["PartitionKey"] != "!id":
            # a run on host B records the message whole again (record, then index entry) before
            # host A deletes the index entries of the records it deleted
            await b.upsert([old.model_copy(update={"status": "Leased", "locked_by": "b", "updated_at": now})])
        return gone

    monkeypatch.setattr(TablesTracker, "_delete_unchanged", staticmethod(written_again_after_the_record_went))
    if how == "prune":
        assert await a.prune(now) == 1
    else:
        assert await a.delete(MessageQuery(status=("Succeeded",))) == 1
    got = await a.get(old.message_id)  # found by its id: the index entry written again stayed
    assert got is not None
    assert got.status == "Leased"
    await a.aclose()
    await b.aclose()


async def test_a_history_delete_deletes_the_index_entries_of_the_records_it_deleted(
    tables_tracker: TablesTracker,  # noqa: F811
) -> None:
    now = T0 + timedelta(days=30)
    doomed = [rec(i, status="Succeeded", updated_at=now - timedelta(days=15)) for i in range(3)]
    await tables_tracker.upsert(doomed)
    # an index entry pointing at another record of the same id (written again in another queue) stays
    client = tables_tracker._table.client
    await client.upsert_entity(
        {"PartitionKey": "!id", "RowKey": str(doomed[0].message_id), "Pk": "elsewhere", "Rk": "x"},
        mode=UpdateMode.REPLACE,
    )
    assert await tables_tracker.prune(now) == 3
    rows = [(e["PartitionKey"], e["RowKey"]) async for e in client.list_entities()]
    assert rows == [("!id", str(doomed[0].message_id))]
