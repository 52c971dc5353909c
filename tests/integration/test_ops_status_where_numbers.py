"""Update-status-where compares the body's numbers exactly (found in review): through a double, an id
past 2**53 matched its neighbours, so a status meant for one customer's message landed on others, and
one huge number in a body made every numeric update of the queue fail on PostgreSQL."""

from __future__ import annotations

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client


@queue("where-numbers")
class Charge(QueueMessage):
    customer_id: int
    amount: float = 0.0


async def _runtime(sql_db) -> Runtime:
    app = QueueingApp("where-numbers")
    app.message(Charge)  # no handler: the messages wait
    rt = Runtime(app, sql_db.provider(listen=False))
    await rt.open()
    return rt


async def _set(client, op: str, path: str, value, status: str = "OnHold") -> dict:
    res = await client.post(
        "/queues/where-numbers/status",
        json={"where": {"path": path, "op": op, "value": value}, "set": status},
    )
    assert res.status_code == 200, res.text
    return res.json()


async def _enqueue(client, bodies: list[dict]) -> list[str]:
    res = await client.post("/queues/where-numbers/messages", json=bodies)
    assert res.status_code == 201, res.text
    return [m["message_id"] for m in res.json()["enqueued"]]


async def _held(client) -> set[str]:
    res = await client.get("/messages", params={"queue": "where-numbers", "status": "OnHold", "limit": 50})
    assert res.status_code == 200, res.text
    return {item["message_id"] for item in res.json()["items"]}


async def test_a_64_bit_id_matches_only_itself(sql_db):
    target = 1541815603606036481  # a snowflake-sized id, about 2**60: its neighbours share its double
    ids = [target - 1, target, target + 1, target + 100]
    rt = await _runtime(sql_db)
    try:
        async with ops_client(rt) as client:
            sent = dict(zip(ids, await _enqueue(client, [{"customer_id": c} for c in ids]), strict=True))
            assert (await _set(client, "eq", "customer_id", target))["updated"] == 1
            assert await _held(client) == {sent[target]}
            # ordered comparisons are exact too
            assert (await _set(client, "gt", "customer_id", target))["updated"] == 2
            assert await _held(client) == {sent[target], sent[target + 1], sent[target + 100]}
    finally:
        await rt.close()


@pytest.mark.parametrize("value", [0.1, 2.5])
async def test_a_fraction_matches_the_body_as_written(sql_db, value):
    rt = await _runtime(sql_db)
    try:
        async with ops_client(rt) as client:
            first, _ = await _enqueue(
                client, [{"customer_id": 1, "amount": value}, {"customer_id": 2, "amount": 9.5}]
            )
            assert (await _set(client, "eq", "amount", value))["updated"] == 1
            assert await _held(client) == {first}
    finally:
        await rt.close()


async def test_a_huge_number_in_one_body_leaves_the_others_updatable(sql_db):
    """A body may hold a number no double holds (1 followed by 400 zeros): it is compared as it is,
    and does not fail the update of the queue's other messages."""
    rt = await _runtime(sql_db)
    try:
        async with ops_client(rt) as client:
            huge = 10**400
            content = f'[{{"customer_id": {huge}}}, {{"customer_id": 7}}]'
            res = await client.post(
                "/queues/where-numbers/messages",
                content=content,
                headers={"content-type": "application/json"},
            )
            assert res.status_code == 201, res.text
            assert (await _set(client, "eq", "customer_id", 7))["updated"] == 1
            assert (await _set(client, "gt", "customer_id", 100))["updated"] == 1  # the huge one
    finally:
        await rt.close()
