"""Numbers JSON cannot carry (NaN, an infinity) in a message body.

Python's json module reads the non-standard ``NaN`` and ``Infinity`` (and ``1e999`` as infinity), and
a float field takes them. Before, `POST queues/{q}/messages` answered 201 and SQLite stored null (the
message no longer matched its own model: a worker dead-lettered it as invalid-body) and PostgreSQL
answered 500. The API and the dashboard's enqueue form now refuse them with a 422 naming the field,
and ``app.enqueue`` from code refuses a message holding one, before anything is written.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import InvalidArgument
from queueing_core.runtime import Runtime
from tests.contract.harness import ops_client

PROBLEM = "application/problem+json"
JSON = {"Content-Type": "application/json"}


@queue("non-finite-prices")
class Price(QueueMessage):
    sku: str
    amount: float
    extra: dict[str, Any] = {}


@pytest.fixture
async def runtime(sql_db):
    app = QueueingApp("non-finite")
    app.message(Price)
    rt = Runtime(app, sql_db.provider(listen=False))
    await rt.open()
    yield rt
    await rt.close()


async def _nothing_stored(client) -> None:
    assert (await client.get("/messages", params={"queue": "non-finite-prices"})).json()["items"] == []


async def test_the_api_refuses_nan_and_infinity_by_field(runtime):
    async with ops_client(runtime) as client:
        for raw, where in [
            ('{"sku": "a", "amount": NaN}', ["body", "amount"]),
            ('{"sku": "b", "amount": Infinity}', ["body", "amount"]),
            ('{"sku": "c", "amount": -Infinity}', ["body", "amount"]),
            ('{"sku": "d", "amount": 1e999}', ["body", "amount"]),
            ('{"sku": "e", "amount": 1, "extra": {"ratio": [1, NaN]}}', ["body", "extra", "ratio", 1]),
            ('[{"sku": "f", "amount": 1}, {"sku": "g", "amount": NaN}]', ["body", 1, "amount"]),
        ]:
            r = await client.post("/queues/non-finite-prices/messages", content=raw, headers=JSON)
            assert r.status_code == 422, (raw, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith(PROBLEM)
            problem = r.json()
            assert problem["type"].endswith(":invalid-body")
            assert [e["loc"] for e in problem["errors"]] == [where], (raw, problem)
            assert "finite number" in problem["errors"][0]["msg"]
        await _nothing_stored(client)  # the batch's valid first item was not written either

        # an unknown queue is still a 404, whatever the body holds
        unknown = await client.post("/queues/no-such-queue/messages", content='{"amount": NaN}', headers=JSON)
        assert unknown.status_code == 404

        # a finite number is accepted and kept as sent
        ok = await client.post("/queues/non-finite-prices/messages", json={"sku": "h", "amount": 2.5})
        assert ok.status_code == 201, ok.text
        mid = ok.json()["enqueued"][0]["message_id"]
        assert (await client.get(f"/messages/{mid}/content")).json()["body"]["amount"] == 2.5


async def test_the_dashboard_enqueue_form_refuses_them_too(runtime):
    async with ops_client(runtime) as client:
        form = {"body": '{"sku": "a", "amount": NaN}', "correlation_id": "", "delay": ""}
        r = await client.post("/ui/enqueue/non-finite-prices", data=form)
        assert r.status_code == 422, r.text[:300]
        assert "amount: Input should be a finite number" in r.text
        await _nothing_stored(client)


async def test_enqueue_from_code_refuses_a_message_json_cannot_carry(runtime):
    app = runtime.app
    for bad in (
        Price(sku="a", amount=math.nan),
        Price(sku="b", amount=math.inf),
        Price(sku="c", amount=1, extra={"ratio": [1, -math.inf]}),
    ):
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            await app.enqueue(bad)
        with pytest.raises(ValueError, match="NaN or infinite"):  # callers that catch ValueError too
            await app.enqueue_many([Price(sku="ok", amount=1), bad])
    with pytest.raises(InvalidArgument, match=r"Price\.extra\.ratio\.1 is NaN or infinite"):
        await app.enqueue(Price(sku="c", amount=1, extra={"ratio": [1, -math.inf]}))
    async with ops_client(runtime) as client:
        await _nothing_stored(client)
