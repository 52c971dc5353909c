"""The operator's views over a SQL store holding rows damaged outside the kit (an id that is not a UUID,
a time that does not read, a body or headers that are not what the kit writes), on SQLite and
PostgreSQL: every view answers 200, shows the good rows as they are and the damaged one marked with
what can be read and its stored text; the actions on a damaged row work by its own key or are refused
with a 4xx, never a 500."""

from __future__ import annotations

import re
import sqlite3

import httpx
import sqlalchemy as sa

from queueing_core import jobs
from queueing_core.ops import OpsService

from .test_job_cli import enqueue
from .test_ops_api import KEY, Email
from .test_ops_cli import cli  # noqa: F401 - the fixture

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


async def damaged_store(sql_db, rt) -> dict[str, object]:
    """Four good emails, two of them then damaged in the table itself, as an outside hand would:
    ``dead`` (dead-lettered, a time, its body and headers damaged) and ``waiting`` (pending; on SQLite
    its message id is not a UUID, on PostgreSQL, whose uuid column refuses that, two more times)."""
    sent = [await rt.app.enqueue(Email(to=f"{i}@x.io", subject="s")) for i in range(4)]
    dead, waiting, good = sent[0], sent[1], sent[2:]
    pg = sql_db.backend == "postgresql"
    with sql_db.sync_engine().begin() as db:
        t = "queueing_messages"
        db.execute(
            sa.text(
                f"UPDATE {t} SET status = 'DeadLettered', reason = 'MaxAttemptsExceeded', created_at = "
                + ("'infinity'" if pg else "'garbage'")
                + ", headers = '{\"x-attempts\": 3}', body = "
                + ("'\"just text\"'" if pg else "'not json {'")
                + " WHERE message_id = :id"
            ),
            {"id": dead.message_id if pg else dead.message_id.hex},
        )
        if pg:
            db.execute(
                sa.text(
                    f"UPDATE {t} SET updated_at = '20000-01-01 00:00:00+00', not_before = '-infinity' "
                    "WHERE message_id = :id"
                ),
                {"id": waiting.message_id},
            )
        else:
            db.execute(
                sa.text(f"UPDATE {t} SET message_id = 'not-a-uuid' WHERE message_id = :id"),
                {"id": waiting.message_id.hex},
            )
    return {"dead": dead, "waiting": waiting, "good": good, "pg": pg}


def by_id(items: list[dict]) -> dict[str | None, dict]:
    return {i["message_id"]: i for i in items}


def check_listing(items: list[dict], store: dict) -> None:
    """The good rows as enqueued; the damaged ones marked, with their stored text."""
    assert len(items) == 4, items
    rows = by_id(items)
    for receipt in store["good"]:
        row = rows[str(receipt.message_id)]
        assert row["malformed"] is None
        assert row["tracking_id"] == str(receipt.tracking_id)
        assert row["created_at"] is not None
    dead = rows[str(store["dead"].message_id)]
    assert dead["status"] == "DeadLettered"
    assert dead["created_at"] is None
    assert "created_at" in dead["malformed"]
    assert dead["stored"]["created_at"] in ("infinity", "garbage")
    waiting = next(i for i in items if i["status"] == "Pending" and i["malformed"])
    if store["pg"]:
        assert waiting["message_id"] == str(store["waiting"].message_id)
        assert waiting["updated_at"] is None
        assert "updated_at" in waiting["malformed"]
    else:
        assert waiting["message_id"] is None
        assert waiting["stored"]["message_id"] == "not-a-uuid"
        assert "message id is not a UUID" in waiting["malformed"]


async def test_every_listing_and_lookup_answers_with_the_damaged_rows_marked(api, sql_db):
    client, rt, _ = api
    store = await damaged_store(sql_db, rt)
    listing = await client.get("/messages")
    assert listing.status_code == 200, listing.text
    check_listing(listing.json()["items"], store)

    # page by page, one row a page: every row exactly once, damaged boundaries included
    seen, cursor = [], None
    for _ in range(10):
        page = await client.get("/messages", params={"limit": 1} | ({"cursor": cursor} if cursor else {}))
        assert page.status_code == 200, page.text
        seen += page.json()["items"]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
    check_listing(seen, store)

    dead_letters = await client.get("/messages", params={"status": "DeadLettered"})
    assert dead_letters.status_code == 200, dead_letters.text
    [dead] = dead_letters.json()["items"]
    assert dead["message_id"] == str(store["dead"].message_id)
    assert dead["malformed"]

    waiting = await client.get("/messages/waiting")
    assert waiting.status_code == 200, waiting.text
    assert len(waiting.json()) == 3
    assert sum(1 for w in waiting.json() if w["malformed"]) == 1

    detail = await client.get(f"/messages/{store['dead'].message_id}")
    assert detail.status_code == 200, detail.text
    d = detail.json()
    assert "created_at" in d["malformed"]
    assert "headers" in d["malformed"]
    assert d["stored"]["headers"] == '{"x-attempts": 3}'
    assert d["headers"] == {}
    content = await client.get(f"/messages/{store['dead'].message_id}/content")
    assert content.status_code == 200, content.text
    assert content.json()["body"] is None
    assert content.json()["raw"] in ('"just text"', "not json {")

    for path in ("/messages/stats", "/stats", "/health", "/metrics"):
        r = await client.get(path)
        assert r.status_code == 200, (path, r.text)
    assert (await client.get("/messages/stats")).json()["total"] == 4

    # by tracking id (the CLI's `show`, the jobs API)
    found = await jobs.find(rt, store["dead"].tracking_id)
    assert found.message_id == store["dead"].message_id
    assert "created_at" in (OpsService.detail_of(found).malformed or "")


async def test_the_dashboard_lists_and_shows_a_damaged_row(api, sql_db):
    api_client, rt, _ = api
    store = await damaged_store(sql_db, rt)
    # a browser: the session cookie, not the key
    client = httpx.AsyncClient(transport=api_client._transport, base_url=str(api_client.base_url))
    signed = await client.post("/ui/sign-in", content=f"key={KEY}", headers=FORM)
    assert signed.status_code == 303
    listing = await client.get("/ui/messages")
    assert listing.status_code == 200, listing.text
    for receipt in store["good"]:
        assert str(receipt.message_id) in listing.text
    assert "malformed" in listing.text.lower()
    dead_letters = await client.get("/ui/messages", params={"status": "DeadLettered"})
    assert dead_letters.status_code == 200
    assert str(store["dead"].message_id) in dead_letters.text
    detail = await client.get(f"/ui/messages/{store['dead'].message_id}")
    assert detail.status_code == 200, detail.text
    assert "malformed" in detail.text.lower()
    assert re.search(r"infinity|garbage", detail.text)

    # bulk actions count the damaged row with the rest: a retry refuses it, a purge deletes it
    csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', (await client.get("/ui/")).text).group(1)
    headers = {**FORM, "X-CSRF-Token": csrf, "HX-Request": "true"}
    form = "step=run&expected=3&status=Pending&action="
    retried = await client.post("/ui/bulk", content=form + "retry", headers=headers)
    assert retried.status_code == 200, retried.text
    assert "Retried 0 message(s); 3 refused" in retried.text
    purged = await client.post("/ui/bulk", content=form + "purge", headers=headers)
    assert purged.status_code == 200, purged.text
    assert "Deleted 3 message(s)" in purged.text
    assert (await api_client.get("/messages/stats")).json()["total"] == 1
    await client.aclose()


async def test_actions_on_a_damaged_row_work_by_its_key_or_are_refused(api, sql_db):
    client, rt, _ = api
    store = await damaged_store(sql_db, rt)
    dead, waiting = store["dead"].message_id, store["waiting"]
    retry = await client.post(f"/messages/{dead}/retry")
    assert retry.status_code == 409, retry.text
    assert "damaged" in retry.json()["detail"]
    assert "created_at" in retry.json()["detail"]
    archived = await client.post(f"/messages/{dead}/archive")
    assert archived.status_code == 200, archived.text
    assert (await client.get(f"/messages/{dead}")).json()["archived"] is True

    cancel = await client.post(f"/messages/{waiting.tracking_id}/cancel")
    if store["pg"]:  # its id reads: cancelled by it, like any waiting message
        assert cancel.status_code == 200, cancel.text
        assert (await client.get(f"/messages/{waiting.message_id}")).json()["status"] == "Cancelled"
    else:  # found by its tracking id, but its own id does not read: refused, nothing changed
        assert cancel.status_code == 409, cancel.text
        assert "damaged" in cancel.json()["detail"]
        items = (await client.get("/messages")).json()["items"]
        [row] = [i for i in items if i["message_id"] is None]
        assert (row["tracking_id"], row["status"]) == (str(waiting.tracking_id), "Pending")

    # what is not archived goes with a purge by filter, the damaged waiting row included
    purged = await client.delete("/messages", params={"queue": "emails", "archived": "false"})
    assert purged.status_code == 200, purged.text
    assert purged.json()["deleted"] == 3
    left = (await client.get("/messages")).json()["items"]
    assert [i["message_id"] for i in left] == [str(dead)]


async def test_a_hostile_cursor_in_the_damaged_rows_form_is_refused(api):
    client, _, _ = api
    import base64

    for text in ("@|0", "@|99999999999999999999", "@|1 OR 1=1", "@@|1", "@|", "x@|1"):
        cursor = base64.urlsafe_b64encode(text.encode()).decode()
        r = await client.get("/messages", params={"cursor": cursor})
        assert r.status_code == 422, (text, r.text)
    fine = base64.urlsafe_b64encode(b"@|1").decode()
    assert (await client.get("/messages", params={"cursor": fine})).status_code == 200


def test_the_cli_shows_a_damaged_row_by_its_tracking_id(cli, tmp_path):  # noqa: F811
    [receipt] = enqueue(tmp_path, "A1")
    with sqlite3.connect(tmp_path / "q.db") as db:
        db.execute(
            "UPDATE queueing_messages SET message_id = 'not-a-uuid', updated_at = 'garbage' "
            "WHERE message_id = ?",
            (receipt.message_id.hex,),
        )
    shown = cli("show", str(receipt.tracking_id))
    assert shown.returncode == 0, shown.stderr
    assert "status    Pending" in shown.stdout
    assert "malformed message id is not a UUID; updated_at does not read as a time" in shown.stdout
    assert "stored    message_id: not-a-uuid" in shown.stdout
    assert cli("stats").returncode == 0
