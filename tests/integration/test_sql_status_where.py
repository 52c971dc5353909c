"""Update status where a body property compares to a value, on SQLite and PostgreSQL, over the ops
API: exactly the matching rows change, and injection attempts in the value or the path change nothing."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.ops.models import StatusUpdate
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

from ..clocks import ManualClock

KEY = "where-test-key"


@queue("orders-where")
class Order(QueueMessage):
    ref: str
    customer: dict[str, Any]
    lines: list[dict[str, Any]] = []


ORDERS = [
    Order(ref="o1", customer={"country": "NO", "tier": 2, "vip": True}, lines=[{"sku": "A"}]),
    Order(ref="o2", customer={"country": "NO", "tier": 1, "vip": False}, lines=[{"sku": "B"}]),
    Order(ref="o3", customer={"country": "SE", "tier": 3}, lines=[{"sku": "A"}]),
    Order(ref="o4", customer={"country": "NO' OR '1'='1", "tier": "2"}),
]


@contextlib.asynccontextmanager
async def api(sql_db):
    app = QueueingApp("where")
    app.message(Order)
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    await app.enqueue_many(ORDERS)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(OpsService(rt), api_key=KEY)),
        base_url="http://test" + PREFIX,
        headers={"X-API-Key": KEY},
    )
    try:
        yield client, rt
    finally:
        await client.aclose()
        await rt.close()


async def statuses(rt) -> dict[str, str]:
    m = rt.provider.tables.messages
    async with rt.provider.engine.connect() as conn:
        rows = (await conn.execute(sa.select(m.c.body, m.c.status))).all()
    return {(b if isinstance(b, dict) else __import__("json").loads(b))["ref"]: s for b, s in rows}


async def set_where(client, path, op, value, to="Hold", **extra):
    body = {"where": {"path": path, "op": op, "value": value}, "set": to, **extra}
    return await client.post("/queues/orders-where/status", json=body)


@pytest.mark.parametrize(
    ("path", "op", "value", "changed"),
    [
        ("customer.country", "eq", "NO", {"o1", "o2"}),
        ("customer.country", "ne", "NO", {"o3", "o4"}),
        ("customer.tier", "gt", 1, {"o1", "o3"}),  # o4's tier is the text "2": not a number
        ("customer.tier", "le", 2.5, {"o1", "o2"}),
        ("customer.tier", "eq", "2", {"o4"}),
        ("customer.vip", "eq", True, {"o1"}),
        ("customer.vip", "eq", None, {"o3", "o4"}),  # missing counts as null
        ("lines.0.sku", "eq", "A", {"o1", "o3"}),
        ("customer.country", "eq", 5, set()),  # a number never equals text
    ],
)
async def test_exactly_the_matching_rows_change(sql_db, path, op, value, changed):
    async with api(sql_db) as (client, rt):
        res = await set_where(client, path, op, value)
        assert res.status_code == 200, res.text
        assert res.json() == {"queue": "orders-where", "status": "Hold", "updated": len(changed)}
        now = await statuses(rt)
        assert {ref for ref, s in now.items() if s == "Hold"} == changed
        assert {s for ref, s in now.items() if ref not in changed} <= {"Pending"}


@pytest.mark.parametrize(
    "value",
    ["NO' OR '1'='1' --", "x'); DELETE FROM queueing_messages; --", '" OR 1=1 --', "NO\\' OR 1=1"],
)
async def test_an_injection_attempt_in_the_value_is_only_a_value(sql_db, value):
    async with api(sql_db) as (client, rt):
        res = await set_where(client, "customer.country", "eq", value)
        assert res.status_code == 200, res.text
        assert res.json()["updated"] == 0
        assert set((await statuses(rt)).values()) == {"Pending"}
        assert len(await statuses(rt)) == 4
        # the stored text that looks like an injection is matched as the plain text it is
        res = await set_where(client, "customer.country", "eq", "NO' OR '1'='1")
        assert res.json()["updated"] == 1
        assert (await statuses(rt))["o4"] == "Hold"


@pytest.mark.parametrize(
    "path",
    [
        "customer.country') OR 1=1 --",
        'customer."country"',
        "$.customer.country",
        "customer..country",
        "customer.country;DROP TABLE x",
        "a.b.c.d.e.f.g.h.i",
        "",
    ],
)
async def test_an_injection_attempt_in_the_path_is_refused(sql_db, path):
    async with api(sql_db) as (client, rt):
        res = await set_where(client, path, "eq", "NO")
        assert res.status_code == 422, res.text
        assert set((await statuses(rt)).values()) == {"Pending"}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            '{"where":{"path":"total","op":"eq","value":1' + "0" * 400 + '},"set":"Hold"}',
            "a 401-digit number",
        ),
        ('{"where":{"path":"total","op":"lt","value":NaN},"set":"Hold"}', "NaN"),
        ('{"where":{"path":"total","value":18446744073709551616},"set":"Hold"}', "2**64 (read as a float)"),
        ('{"where":{"path":"total","op":"lt","value":Infinity},"set":"Hold"}', "Infinity"),
        ('{"where":{"path":"customer.country","value":"\\ud800"},"set":"Hold"}', "a lone surrogate"),
        ('{"where":{"path":"customer.country","value":"N\\u0000O"},"set":"Hold"}', "NUL in the value"),
        ('{"where":{"path":"total","value":1},"set":"Hold","status":["a\\u0000b"]}', "NUL in a status"),
        (
            json.dumps({"where": {"path": "total", "value": 1}, "set": "Hold", "status": ["x"] * 40000}),
            "40,000 statuses",
        ),
    ],
)
async def test_a_hostile_filter_is_a_clear_422_and_changes_nothing(sql_db, body, why):
    """A review sent these: a huge integer and a lone surrogate failed with a 500 (an overflow, an
    encoding error), NaN was taken (on PostgreSQL it sorts above every number: lt NaN matched every
    numeric body), and the statuses were an unchecked list of any length and text."""
    async with api(sql_db) as (client, rt):
        res = await client.post(
            "/queues/orders-where/status", content=body, headers={"Content-Type": "application/json"}
        )
        assert res.status_code == 422, (why, res.status_code, res.text[:300])
        assert set((await statuses(rt)).values()) == {"Pending"}


async def test_leased_rows_are_left_alone_and_kit_statuses_are_refused(sql_db):
    async with api(sql_db) as (client, rt):
        m = rt.provider.tables.messages
        async with rt.provider.engine.begin() as conn:
            await conn.execute(
                sa.update(m).where(m.c.body["ref"].as_string() == "o1").values(status="Leased", locked_by="w")
            )
        res = await set_where(client, "customer.country", "eq", "NO")
        assert res.json()["updated"] == 1
        assert await statuses(rt) == {"o1": "Leased", "o2": "Hold", "o3": "Pending", "o4": "Pending"}
        refused = await set_where(client, "customer.country", "eq", "NO", to="Succeeded")
        assert refused.status_code == 409
        assert "the kit sets itself" in refused.json()["detail"]
        # back to Pending, only those on Hold
        back = await set_where(client, "customer.country", "eq", "NO", to="Pending", status_filter=None)
        assert back.status_code == 422  # unknown field: the request shape is strict
        back = await set_where(client, "customer.country", "eq", "NO", to="Pending", status=["Hold"])
        assert back.json()["updated"] == 1
        assert (await statuses(rt))["o2"] == "Pending"


async def test_a_message_whose_run_had_ended_gets_its_attempts_back_and_one_held_keeps_its_count(sql_db):
    """Put back to Pending, a message dead-lettered at its last attempt runs again (its attempts are
    reset, as an operator's retry resets them; with its attempts used up the worker would dead-letter
    it again unrun), while one held mid-retries (a custom status) keeps the attempts it used."""
    async with api(sql_db) as (client, rt):
        m = rt.provider.tables.messages
        async with rt.provider.engine.begin() as conn:
            await conn.execute(
                sa.update(m)
                .where(m.c.body["ref"].as_string() == "o1")
                .values(status="DeadLettered", attempt=5, reason="max-attempts-exceeded")
            )
            await conn.execute(
                sa.update(m).where(m.c.body["ref"].as_string() == "o2").values(status="Hold", attempt=2)
            )
        back = await set_where(client, "customer.country", "eq", "NO", to="Pending")
        assert back.json()["updated"] == 2
        async with rt.provider.engine.connect() as conn:
            rows = (await conn.execute(sa.select(m.c.body, m.c.status, m.c.attempt))).all()
        got = {(b if isinstance(b, dict) else __import__("json").loads(b))["ref"]: (s, a) for b, s, a in rows}
        assert got["o1"] == ("Pending", 0)
        assert got["o2"] == ("Pending", 2)


async def test_an_ended_message_held_under_a_custom_status_then_put_back_gets_its_attempts_back(sql_db):
    """Dead-lettered at its last attempt, then held (a custom status), then put back: the second step
    sees a custom status, yet the message had ended (it was settled), so its attempts come back; with
    them used up the worker would dead-letter it again without running it (found in review)."""
    async with api(sql_db) as (client, rt):
        m = rt.provider.tables.messages
        async with rt.provider.engine.begin() as conn:  # as its last failed attempt's settlement left it
            await conn.execute(
                sa.update(m)
                .where(m.c.body["ref"].as_string() == "o3")
                .values(
                    status="DeadLettered", attempt=5, reason="max-attempts-exceeded", settled_at=sa.func.now()
                )
            )
        for to in ("Hold", "Pending"):
            res = await set_where(client, "customer.country", "eq", "SE", to=to)
            assert res.json()["updated"] == 1, res.text
        async with rt.provider.engine.connect() as conn:
            row = (
                await conn.execute(
                    sa.select(m.c.status, m.c.attempt).where(m.c.body["ref"].as_string() == "o3")
                )
            ).one()
        assert tuple(row) == ("Pending", 0)


@queue("flags-where")
class Flagged(QueueMessage):
    ref: str
    flag: Any = None


FLAGS = {"t": True, "f": False, "text": "true", "one": 1, "null": None}


@pytest.mark.parametrize(
    ("op", "value", "changed"),
    [
        ("eq", True, {"t"}),
        ("ne", True, {"f"}),
        ("ne", False, {"t"}),
        ("lt", True, {"f"}),
        ("ge", False, {"t", "f"}),
        ("gt", True, set()),
    ],
)
async def test_a_boolean_compares_with_booleans_only(sql_db, op, value, changed):
    """As text and numbers do: ``ne true`` matched the text "true", the number 1 and null too (the
    negation of ``eq``), and an ordering matched them as well."""
    app = QueueingApp("flags")
    app.message(Flagged)
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        await app.enqueue_many([Flagged(ref=ref, flag=flag) for ref, flag in FLAGS.items()])
        where = {"where": {"path": "flag", "op": op, "value": value}, "set": "Hold"}
        res = await OpsService(rt).update_status_where("flags-where", StatusUpdate.model_validate(where))
        assert res.updated == len(changed)
        held = {r.body["ref"] for r in (await rt.tracker.query(MessageQuery(status=("Hold",)))).items}
        assert held == changed
    finally:
        await rt.close()


@queue("putback-where", max_attempts=1)  # (the default expiration: four hours)
class Nightly(QueueMessage):
    ref: str


async def test_a_letter_put_back_after_its_expiry_runs_with_a_new_expiry_as_a_retry_gives(sql_db):
    """Put back to Pending the morning after it was dead-lettered, a message kept its first run's
    expiry, long past: it ended Expired without running, while the operator was told it was updated.
    It gets the expiry an operator's retry gives (now plus its type's expiration), and runs; one held
    mid-retries (never settled) keeps its own."""
    clock = ManualClock(datetime(2026, 3, 2, 12, 0, tzinfo=UTC))
    app = QueueingApp("putback")
    runs: list[str] = []
    failing = {"put-back", "retried"}

    @app.handler()
    async def nightly(msg: Nightly) -> None:
        runs.append(msg.ref)
        if msg.ref in failing:
            raise RuntimeError("boom")

    rt = Runtime(app, sql_db.provider(clock=clock, listen=False), clock=clock)
    await rt.open()
    try:
        put_back = await app.enqueue(Nightly(ref="put-back", created_at=clock()))
        retried = await app.enqueue(Nightly(ref="retried", created_at=clock()))
        held = await app.enqueue(Nightly(ref="held", created_at=clock()))
        ops = OpsService(rt, clock=clock)
        await ops.update_status_where("putback-where", where_ref("held", "Hold"))
        await run_until_idle(rt, raise_errors=False)
        for receipt in (put_back, retried):
            assert (await rt.tracker.get(receipt.message_id)).status == MessageStatus.DEAD_LETTERED
        failing.clear()
        clock.now += timedelta(hours=5)  # the operator looks the next morning

        res = await ops.update_status_where("putback-where", where_ref("put-back", "Pending"))
        assert res.updated == 1
        await ops.retry(retried.message_id)
        expiry = {r.message_id: r.expires_at for r in (await rt.tracker.query(MessageQuery())).items}
        assert expiry[put_back.message_id] == expiry[retried.message_id] == clock() + timedelta(hours=4)
        await ops.update_status_where("putback-where", where_ref("held", "Pending"))
        assert (await rt.tracker.get(held.message_id)).expires_at == held.expires_at  # long past
        await run_until_idle(rt, raise_errors=False)

        assert sorted(runs) == ["put-back", "put-back", "retried", "retried"]
        for receipt in (put_back, retried):
            assert (await rt.tracker.get(receipt.message_id)).status == MessageStatus.SUCCEEDED
        assert (await rt.tracker.get(held.message_id)).status == MessageStatus.EXPIRED
    finally:
        await rt.close()


def where_ref(ref: str, to: str) -> StatusUpdate:
    return StatusUpdate.model_validate({"where": {"path": "ref", "op": "eq", "value": ref}, "set": to})


@queue("forever-where", max_attempts=1, expiration=None)
class Forever(QueueMessage):
    ref: str


async def test_a_letter_of_a_type_that_never_expires_is_put_back_without_an_expiry(sql_db):
    """As an operator's retry: its type's expiration (none), not the ``ttl=`` its first run was sent with."""
    app = QueueingApp("forever")
    app.message(Forever)
    rt = Runtime(app, sql_db.provider())
    await rt.open()
    try:
        sent = await app.enqueue(Forever(ref="a"), ttl=timedelta(minutes=5))
        assert sent.expires_at is not None
        m = rt.provider.tables.messages
        async with rt.provider.engine.begin() as conn:  # as its failed attempt's settlement left it
            await conn.execute(
                sa.update(m)
                .where(m.c.message_id == sent.message_id)
                .values(status="DeadLettered", attempt=1, settled_at=sa.func.now())
            )
        res = await OpsService(rt).update_status_where("forever-where", where_ref("a", "Pending"))
        assert res.updated == 1
        record = await rt.tracker.get(sent.message_id)
        assert (record.status, record.expires_at) == ("Pending", None)
    finally:
        await rt.close()


@queue("putback-where", max_attempts=1)
class Unrelated(QueueMessage):
    ref: str


async def test_an_ops_host_that_does_not_register_the_type_keeps_its_expiry(sql_db):
    """Two apps on one table: the operator's host does not register the type it puts back. Written
    as "no expiry", a worker that registers the type counted its expiration from the message's
    creation instead: a letter sent for two days and put back five hours later expired unrun."""
    clock = ManualClock(datetime(2026, 3, 2, 12, 0, tzinfo=UTC))
    worker_app = QueueingApp("putback-worker")
    runs: list[str] = []
    failing = {"a"}

    @worker_app.handler()
    async def nightly(msg: Nightly) -> None:
        runs.append(msg.ref)
        if msg.ref in failing:
            raise RuntimeError("boom")

    ops_app = QueueingApp("putback-ops")
    ops_app.message(Unrelated)  # (its own type only, on the same queue)
    worker = Runtime(worker_app, sql_db.provider(clock=clock, listen=False), clock=clock)
    ops_host = Runtime(ops_app, sql_db.provider(clock=clock, listen=False), clock=clock)
    await worker.open()
    await ops_host.open()
    try:
        sent = await worker_app.enqueue(Nightly(ref="a", created_at=clock()), ttl=timedelta(days=2))
        await run_until_idle(worker, raise_errors=False)
        assert (await worker.tracker.get(sent.message_id)).status == MessageStatus.DEAD_LETTERED
        failing.clear()
        clock.now += timedelta(hours=5)
        res = await OpsService(ops_host, clock=clock).update_status_where(
            "putback-where", where_ref("a", "Pending")
        )
        assert res.updated == 1
        assert (await worker.tracker.get(sent.message_id)).expires_at == sent.expires_at
        await run_until_idle(worker, raise_errors=False)
        assert runs == ["a", "a"]
        assert (await worker.tracker.get(sent.message_id)).status == MessageStatus.SUCCEEDED
    finally:
        await worker.close()
        await ops_host.close()
