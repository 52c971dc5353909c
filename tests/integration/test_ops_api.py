"""The operations HTTP API on SQLite and PostgreSQL: every route, the states actions refuse, auth,
bad input, and pause/resume steering a running worker."""

from __future__ import annotations

import asyncio
from uuid import UUID, uuid4

import httpx
import sqlalchemy as sa

from queueing_core import Health, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.tracking.base import RETRIED_BY_OPERATOR
from tests.contract.harness import running, wait_until

KEY = "test-key-not-a-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@queue("emails", category="notify", max_attempts=2, example={"to": "ada@example.com", "subject": "hi"})
class Email(QueueMessage):
    to: str
    subject: str
    fail: bool = False


@queue("reports", health_when_errors=Health.DEGRADED)
class Report(QueueMessage):
    name: str


def build_app() -> tuple[QueueingApp, list[str]]:
    app = QueueingApp("api-tests")
    sent: list[str] = []

    @app.handler()
    async def send(msg: Email) -> dict:
        if msg.fail:
            raise NonRetryableError(f"mailbox {msg.to} does not exist")
        sent.append(msg.to)
        return {"sent": msg.to}

    app.message(Report)
    return app, sent


async def settled(rt, ids, status="Succeeded") -> None:
    async def done():
        for i in ids:
            r = await rt.tracker.get(UUID(str(i)))
            if r is None or r.status != status:
                return False
        return True

    await wait_until(done, what=f"messages {status}")


async def test_every_route_needs_the_key(api):
    client, rt, _ = api
    mid = uuid4()
    routes = [
        ("GET", "/stats"),
        ("GET", "/subscriptions"),
        ("GET", "/messages"),
        ("GET", f"/messages/{mid}"),
        ("GET", f"/messages/{mid}/content"),
        ("GET", "/messages/stats"),
        ("GET", "/messages/waiting?take=5"),
        ("POST", f"/messages/{mid}/retry"),
        ("POST", f"/messages/{mid}/lease/release"),
        ("POST", f"/messages/{mid}/archive"),
        ("POST", f"/messages/{mid}/cancel"),
        ("DELETE", "/messages?all=true"),
        ("POST", "/queues/emails/pause"),
        ("POST", "/queues/emails/resume"),
        ("POST", "/types/Email/pause"),
        ("POST", "/types/Email/resume"),
        ("POST", "/types/Email/circuit/reset"),
        ("POST", "/queues/emails/messages"),
        ("POST", "/queues/emails/status"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/schedules"),
        ("POST", "/schedules/nightly/pause"),
        ("POST", "/schedules/nightly/resume"),
        ("GET", "/openapi.json"),
    ]
    spec = (await client.get("/openapi.json")).json()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert len(documented) == 24  # the 21 operations routes, enqueue, cancel and status, all documented
    bare = httpx.AsyncClient(transport=client._transport, base_url=str(client.base_url))  # no credentials
    for method, path in routes:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"X-API-Key": "wrong"},
            {"X-API-Key": ""},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": f"Bearer {KEY}", "X-API-Key": "x"},
        ):
            r = await bare.request(
                method, path, headers=headers, json={"to": "x", "subject": "y"} if method == "POST" else None
            )
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.headers["content-type"] == "application/problem+json"
    assert (await bare.get("/stats", headers={"X-API-Key": KEY})).status_code == 200
    assert (
        await bare.get("/stats", headers={"Authorization": f"Bearer {KEY}", "X-API-Key": KEY})
    ).status_code == 200
    await bare.aclose()
    assert await rt.tracker.counts() == {}  # nothing was written by refused requests


async def test_enqueue_over_http_validates_everything_before_writing(api):
    client, rt, _ = api
    one = await client.post("/queues/emails/messages", json={"to": "a@x.io", "subject": "s"})
    assert one.status_code == 201
    assert one.json()["enqueued"][0]["queue"] == "emails"
    batch = await client.post(
        "/queues/emails/messages?correlation_id=c-9&delay_seconds=60",
        json=[{"to": f"{i}@x.io", "subject": "s"} for i in range(3)],
    )
    assert batch.status_code == 201, batch.text
    assert {m["status"] for m in batch.json()["enqueued"]} == {"Sleeping"}
    bad = await client.post("/queues/emails/messages", json=[{"to": "ok@x.io", "subject": "s"}, {"to": 5}])
    assert bad.status_code == 422
    assert bad.headers["content-type"] == "application/problem+json"
    locs = [tuple(e["loc"]) for e in bad.json()["errors"]]
    assert ("body", 1, "to") in locs
    assert ("body", 1, "subject") in locs
    unknown = await client.post("/queues/nope/messages", json={"to": "a", "subject": "b"})
    assert unknown.status_code == 404
    huge = await client.post("/queues/emails/messages", json={"to": "a@x.io", "subject": "x" * 300_000})
    assert huge.status_code == 413
    assert "262144 bytes" in huge.json()["detail"]
    bad_name = await client.post("/queues/bad%20name!/messages", json={"to": "a", "subject": "b"})
    assert bad_name.status_code == 422
    assert "queueName" in bad_name.json()["detail"]
    assert sum((await rt.tracker.counts()).values()) == 4  # only the four valid ones exist


async def test_reading_routes(api):
    client, rt, _ = api
    ok = (
        await client.post(
            "/queues/emails/messages", json=[{"to": f"{i}@x.io", "subject": "s"} for i in range(5)]
        )
    ).json()["enqueued"]
    dead = (
        await client.post(
            "/queues/emails/messages",
            json={"to": "gone@x.io", "subject": "s", "fail": True},
            headers={**AUTH},
        )
    ).json()["enqueued"][0]
    await client.post("/queues/reports/messages", json={"name": "q3"})
    async with running(rt):
        await settled(rt, [m["message_id"] for m in ok])
        await settled(rt, [dead["message_id"]], "DeadLettered")

    stats = (await client.get("/stats")).json()
    emails = next(q for q in stats["queues"] if q["queue"] == "emails")
    assert emails["counts"] == {"Succeeded": 5, "DeadLettered": 1}
    assert emails["health"] == "Unhealthy"
    reports = next(q for q in stats["queues"] if q["queue"] == "reports")
    assert reports["has_handler"] is False
    assert reports["counts"] == {"WaitingForHandler": 1}

    subs = (await client.get("/subscriptions")).json()
    email_sub = next(s for s in subs if s["type"] == "Email")
    assert email_sub["example"] == {"to": "ada@example.com", "subject": "hi", "fail": False}
    assert set(email_sub["json_schema"]["properties"]) == {"to", "subject", "fail"}

    page1 = (await client.get("/messages", params={"queue": "emails", "limit": 4})).json()
    page2 = (
        await client.get("/messages", params={"queue": "emails", "limit": 4, "cursor": page1["next_cursor"]})
    ).json()
    ids = [m["message_id"] for m in page1["items"] + page2["items"]]
    assert len(ids) == len(set(ids)) == 6
    assert page2["next_cursor"] is None
    dl = (await client.get("/messages", params={"status": "DeadLettered"})).json()["items"]
    assert [m["message_id"] for m in dl] == [dead["message_id"]]
    assert dl[0]["reason"] == "non-retryable"

    detail = (await client.get(f"/messages/{dead['message_id']}")).json()
    assert "mailbox gone@x.io does not exist" in detail["description"]
    good = (await client.get(f"/messages/{ok[0]['message_id']}")).json()
    assert good["result"] == {"sent": "0@x.io"}
    content = (await client.get(f"/messages/{ok[0]['message_id']}/content")).json()
    assert content["body"]["subject"] == "s"
    assert content["raw"] is None

    mstats = (await client.get("/messages/stats")).json()
    assert mstats["by_status"]["Succeeded"] == 5
    assert mstats["total"] == 7
    waiting = (await client.get("/messages/waiting", params={"take": 10})).json()
    assert [w["queue"] for w in waiting] == ["reports"]

    health = await client.get("/health")
    assert health.status_code == 200
    assert health.json()["status"] == "Unhealthy"
    assert health.json()["queues"]["emails"] == "Unhealthy"
    assert health.json()["queues"]["reports"] == "Healthy"
    assert "1 dead-lettered" in health.json()["reasons"]["emails"]

    assert (await client.get(f"/messages/{uuid4()}")).status_code == 404
    assert (await client.get("/messages/not-a-uuid")).status_code == 422
    bad_status = await client.get("/messages", params={"status": "Bad Status!"})
    assert bad_status.status_code == 422
    assert "status" in bad_status.json()["detail"]
    assert (await client.get("/messages", params={"cursor": "garbage"})).status_code == 422


async def test_actions_and_the_states_they_refuse(api, sql_db):
    client, rt, sent = api
    ok = (await client.post("/queues/emails/messages", json={"to": "a@x.io", "subject": "s"})).json()[
        "enqueued"
    ][0]
    dead = (
        await client.post("/queues/emails/messages", json={"to": "b@x.io", "subject": "s", "fail": True})
    ).json()["enqueued"][0]
    async with running(rt):
        await settled(rt, [ok["message_id"]])
        await settled(rt, [dead["message_id"]], "DeadLettered")

    r = await client.post(f"/messages/{ok['message_id']}/retry")
    assert r.status_code == 409
    assert "already succeeded" in r.json()["detail"]
    assert (await client.post(f"/messages/{uuid4()}/retry")).status_code == 404

    # an operator fixes the mailbox, then retries the dead letter: fresh attempts, processed again
    m = rt.provider.tables.messages
    async with rt.provider.engine.begin() as conn:
        await conn.execute(
            sa.update(m)
            .where(m.c.message_id == UUID(dead["message_id"]))
            .values(body={"to": "b@x.io", "subject": "s", "fail": False})
        )
    r = await client.post(f"/messages/{dead['message_id']}/retry")
    assert r.status_code == 200
    assert r.json()["status"] == "Pending"
    rec = await rt.tracker.get(UUID(dead["message_id"]))
    assert rec.status == "Pending"
    assert rec.attempt == 0
    assert rec.reason == RETRIED_BY_OPERATOR  # (the dead letter's reason is gone)
    async with running(rt):
        await settled(rt, [dead["message_id"]])
    assert "b@x.io" in sent

    # archive: only finished messages, once
    assert (await client.post(f"/messages/{ok['message_id']}/archive")).status_code == 200
    again = await client.post(f"/messages/{ok['message_id']}/archive")
    assert again.status_code == 409
    assert "already archived" in again.json()["detail"]
    archived = (await client.get("/messages", params={"status": "Archived"})).json()["items"]
    assert [a["message_id"] for a in archived] == [ok["message_id"]]

    # a leased message: cannot be archived, can have its lease released
    held = (await client.post("/queues/emails/messages", json={"to": "c@x.io", "subject": "s"})).json()[
        "enqueued"
    ][0]
    [_delivery] = await rt.provider.receive(rt.app.subscription("Email"), 1)
    r = await client.post(f"/messages/{held['message_id']}/archive")
    assert r.status_code == 409
    assert "processing it" in r.json()["detail"]
    purge = (
        await client.request("DELETE", "/messages", params={"queue": "emails", "status": "Leased"})
    ).json()
    assert purge == {"deleted": 0, "skipped_leased": 1, "left_waiting": 0}
    r = await client.post(f"/messages/{held['message_id']}/lease/release")
    assert r.status_code == 200
    assert (await rt.tracker.get(UUID(held["message_id"]))).status == "Pending"
    r = await client.post(f"/messages/{held['message_id']}/lease/release")
    assert r.status_code == 409
    assert "not Leased" in r.json()["detail"]

    # purge needs a filter
    r = await client.request("DELETE", "/messages")
    assert r.status_code == 422
    assert "all=true" in r.json()["detail"]
    r = await client.request("DELETE", "/messages", params={"status": "Pending"})
    assert r.json()["deleted"] == 1
    assert await rt.tracker.get(UUID(held["message_id"])) is None


async def test_pause_over_http_steers_a_running_worker(api):
    client, rt, sent = api
    async with running(rt):
        r = await client.post("/queues/emails/pause")
        assert r.json() == {"kind": "queue", "name": "emails", "paused": True}
        await asyncio.sleep(1.2)  # past the control-state cache everywhere
        held = (await client.post("/queues/emails/messages", json={"to": "p@x.io", "subject": "s"})).json()
        await asyncio.sleep(1.0)
        assert sent == []
        assert (await rt.tracker.get(UUID(held["enqueued"][0]["message_id"]))).attempt == 0
        stats = (await client.get("/stats")).json()
        assert next(q for q in stats["queues"] if q["queue"] == "emails")["paused"] is True
        await client.post("/queues/emails/resume")
        await settled(rt, [held["enqueued"][0]["message_id"]])
        # the same by type
        await client.post("/types/Email/pause")
        await asyncio.sleep(1.2)
        later = (await client.post("/queues/emails/messages", json={"to": "t@x.io", "subject": "s"})).json()
        await asyncio.sleep(1.0)
        assert sent == ["p@x.io"]
        await client.post("/types/Email/resume")
        await settled(rt, [later["enqueued"][0]["message_id"]])
    assert (await client.post("/queues/unknown/pause")).status_code == 404
    assert (await client.post("/types/Unknown/resume")).status_code == 404
    r = await client.post("/types/Email/circuit/reset")
    assert r.json() == {"type": "Email", "state": "closed"}
