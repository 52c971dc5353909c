"""The operator's views over a SQL store holding rows damaged outside the kit (an id that is not a UUID,
a time that does not read, a body or headers that are not what the kit writes), on SQLite and
PostgreSQL: every view answers 200, shows the good rows as they are and the damaged one marked with
what can be read and its stored text; the actions on a damaged row work by its own key or are refused
with a 4xx, never a 500."""

from __future__ import annotations

import re
import sqlite3

import httpx
import pytest
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
    if not store["pg"]:  # (PostgreSQL's uuid column refuses that)
        with sql_db.sync_engine().begin() as db:
            set_row(db, "queueing_messages", store["dead"].message_id.hex, tracking_id="nope")
    detail = await client.get(f"/ui/messages/{store['dead'].message_id}")
    assert detail.status_code == 200, detail.text
    assert "malformed" in detail.text.lower()
    assert re.search(r"infinity|garbage", detail.text)
    if not store["pg"]:
        assert "None" not in detail.text
        assert 'id="tracking-unreadable"' in detail.text

    # bulk actions count the damaged row with the rest: a retry refuses it, a purge deletes it
    csrf = re.search(r'"X-CSRF-Token": "([^"]+)"', (await client.get("/ui/")).text).group(1)
    headers = {**FORM, "X-CSRF-Token": csrf, "HX-Request": "true"}

    async def confirmed(action: str) -> str:
        """The run's form, carrying what the confirmation states (its count and selection)."""
        confirm = await client.post(
            "/ui/bulk", content=f"step=confirm&status=Pending&action={action}", headers=headers
        )
        carried = re.findall(r'name="(expected|selection)" value="([^"]*)"', confirm.text)
        assert ("expected", "3") in carried, confirm.text
        return f"step=run&status=Pending&action={action}&" + "&".join(f"{k}={v}" for k, v in carried)

    retried = await client.post("/ui/bulk", content=await confirmed("retry"), headers=headers)
    assert retried.status_code == 200, retried.text
    assert "Retried 0 message(s); 3 refused" in retried.text
    purged = await client.post("/ui/bulk", content=await confirmed("purge"), headers=headers)
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
    assert "message   does not read (see stored)" in shown.stdout
    assert "malformed message id is not a UUID; updated_at does not read as a time" in shown.stdout
    assert "stored    message_id: not-a-uuid" in shown.stdout
    assert cli("stats").returncode == 0


def set_row(db, table: str, key: str, **values: object) -> None:
    """Write ``values`` into the row whose stored message id is ``key``, as an outside hand would."""
    assignments = ", ".join(f"{name} = :{name}" for name in values)
    db.execute(sa.text(f"UPDATE {table} SET {assignments} WHERE message_id = :key"), {**values, "key": key})


async def page_through(client, limit: int = 1, **params) -> list[dict]:
    """Every item of the listing, ``limit`` a page, following the cursors (bounded: a loop fails)."""
    seen, cursor = [], None
    for _ in range(100):
        page = await client.get(
            "/messages", params={"limit": limit, **params} | ({"cursor": cursor} if cursor else {})
        )
        assert page.status_code == 200, page.text
        seen += page.json()["items"]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            return seen
    raise AssertionError(f"still paging after 100 pages ({len({i['tracking_id'] for i in seen})} rows seen)")


@pytest.mark.parametrize("sql_db", ["sqlite"], indirect=True)
async def test_sqlite_paging_through_times_not_stored_as_the_kit_writes_them(api, sql_db):
    """SQLite orders times by their stored text: a time that reads but is stored in another form (an ISO
    ``T``, no fraction as CURRENT_TIMESTAMP writes, an offset) must not move a page's cursor off that
    order; nor must damaged times tied among themselves and with good rows in the middle of it."""
    client, rt, _ = api
    sent = [await rt.app.enqueue(Email(to=f"{i}@x.io", subject="s")) for i in range(12)]
    times = [
        "2026-01-02T03:04:05",
        "2026-01-02 03:04:05",
        "2026-01-02 05:00:00+05:00",
        "2026-01-02 03:04:05.000000",
        "2026-01-02 03:04:05.000000",
        "2026-01-02 03:04:05.000000 junk",
        "2026-01-02 03:04:05.000000 junk",
        "2026-01-02 03:04:04.000000",
        "2026-01-02 03:04:05Z",
        "2026-01-02T03:04:05.000000",
    ]
    with sql_db.sync_engine().begin() as db:
        for receipt, at in zip(sent, times, strict=False):
            set_row(db, "queueing_messages", receipt.message_id.hex, created_at=at)
    expected = sorted(str(r.tracking_id) for r in sent)
    for limit in (1, 2, 3):
        seen = await page_through(client, limit)
        assert sorted(i["tracking_id"] for i in seen) == expected, limit


@pytest.mark.parametrize("sql_db", ["sqlite"], indirect=True)
async def test_sqlite_an_id_that_reads_but_is_not_stored_as_the_kit_writes_it_is_damaged(api, sql_db):
    """SQLite keeps whatever text was written: a dead letter whose id is another message's in capitals
    reads as that message's id, but the kit's lookups never reach it by that id. It is shown damaged,
    with no id an action could take (which would act on the other message)."""
    client, rt, _ = api
    good, other = [await rt.app.enqueue(Email(to=f"{i}@x.io", subject="s")) for i in range(2)]
    with sql_db.sync_engine().begin() as db:
        set_row(db, "queueing_messages", good.message_id.hex, status="Succeeded")
        set_row(
            db,
            "queueing_messages",
            other.message_id.hex,
            status="DeadLettered",
            message_id=good.message_id.hex.upper(),
        )
    [dead] = (await client.get("/messages", params={"status": "DeadLettered"})).json()["items"]
    assert dead["message_id"] is None
    assert dead["malformed"] == "message id is not stored as the kit writes it"
    assert dead["stored"] == {"message_id": good.message_id.hex.upper()}
    assert dead["tracking_id"] == str(other.tracking_id)
    detail = (await client.get(f"/messages/{good.message_id}")).json()
    assert (detail["status"], detail["malformed"]) == ("Succeeded", None)


async def test_find_by_tracking_id_prefers_a_readable_row(api, sql_db):
    """A damaged row sharing a message's tracking id, whose time sorts first (``garbage`` on SQLite,
    ``infinity`` on PostgreSQL): a cancel by that tracking id acts on the message, not on it."""
    client, rt, _ = api
    real, damaged = [await rt.app.enqueue(Email(to=f"{i}@x.io", subject="s")) for i in range(2)]
    pg = sql_db.backend == "postgresql"
    with sql_db.sync_engine().begin() as db:
        set_row(
            db,
            "queueing_messages",
            damaged.message_id if pg else damaged.message_id.hex,
            tracking_id=real.tracking_id if pg else real.tracking_id.hex,
            created_at="infinity" if pg else "garbage",
        )
    found = await jobs.find(rt, real.tracking_id)
    assert (found.message_id, found.malformed) == (real.message_id, None)
    cancel = await client.post(f"/messages/{real.tracking_id}/cancel")
    assert cancel.status_code == 200, cancel.text
    assert cancel.json()["message_id"] == str(real.message_id)
    assert (await client.get(f"/messages/{damaged.message_id}")).json()["status"] == "Pending"


@pytest.mark.parametrize("sql_db", ["sqlite"], indirect=True)
async def test_find_by_tracking_id_takes_the_newest_message_when_its_time_reads(api, sql_db):
    """A tracking id used again: the newer message, damaged in a field other than its time, is still
    the one found, not the older one (a cancel must not answer "already succeeded" for the old one
    while the new one runs)."""
    _, rt, _ = api
    older = await rt.app.enqueue(Email(to="old@x.io", subject="s"))
    newer = await rt.app.enqueue(Email(to="new@x.io", subject="s"))
    with sql_db.sync_engine().begin() as db:
        set_row(db, "queueing_messages", older.message_id.hex, status="Succeeded")
        set_row(
            db, "queueing_messages", newer.message_id.hex, tracking_id=older.tracking_id.hex, headers="[1]"
        )
    found = await jobs.find(rt, older.tracking_id)
    assert found.message_id == newer.message_id
    assert found.malformed is not None


@pytest.fixture
async def history_rt(tmp_path):
    """A transport without history of its own (in process) over the SQL history (SQLite): the runtime
    and the history database's engine, where rows are damaged by hand."""
    from queueing_core.providers.inprocess import InProcessProvider
    from queueing_core.providers.sql.history import SideStores
    from queueing_core.runtime import Runtime

    from .test_ops_api import build_app

    stores = SideStores(f"sqlite:///{tmp_path}/history.db")
    rt = Runtime(build_app()[0], InProcessProvider(), tracker=stores.history)
    await rt.open()
    await stores.open()
    yield rt, sa.create_engine(f"sqlite:///{tmp_path}/history.db")
    await rt.close()
    await stores.close()


async def history_record(rt, status: str, **fields):
    from datetime import UTC, datetime
    from uuid import uuid4

    from queueing_core.tracking import MessageRecord

    now = datetime.now(UTC)
    rec = MessageRecord(
        message_id=uuid4(),
        tracking_id=uuid4(),
        type="Email",
        queue="emails",
        status=status,
        created_at=now,
        updated_at=now,
        body={"to": "a@x.io", "subject": "s"},
        **fields,
    )
    await rt.tracker.upsert([rec])
    return rec


def stored_row(engine, message_id) -> dict:
    with engine.connect() as db:
        row = db.execute(
            sa.text("SELECT * FROM queueing_history WHERE message_id = :id"), {"id": message_id.hex}
        ).first()
    return dict(row._mapping)


async def test_actions_on_a_damaged_history_row_keep_what_is_stored(history_rt):
    """With the history beside the transport, archive and cancel write the history themselves: on a
    damaged row they change the columns they act on, by the row's key, and leave the stored text (and
    the damage) as it was, never the record's stand-ins."""
    rt, engine = history_rt
    dead = await history_record(rt, "DeadLettered", reason="MaxAttemptsExceeded")
    waiting = await history_record(rt, "Pending")
    with engine.begin() as db:
        for rec in (dead, waiting):
            set_row(db, "queueing_history", rec.message_id.hex, created_at="garbage", headers="not json {")
    ops = OpsService(rt)
    assert "created_at" in ((await ops.record(dead.message_id)).malformed or "")
    await ops.archive(dead.message_id)
    done = await jobs.cancel(rt, waiting.tracking_id)
    assert done.status == "Cancelled"
    for rec, changed in ((dead, {"archived": 1}), (waiting, {"status": "Cancelled"})):
        row = stored_row(engine, rec.message_id)
        assert (row["created_at"], row["headers"], row["tracking_id"]) == (
            "garbage",
            "not json {",
            rec.tracking_id.hex,
        )
        assert {k: row[k] for k in changed} == changed
        assert "created_at" in ((await ops.record(rec.message_id)).malformed or "")


async def test_a_purge_of_a_history_with_a_damaged_row_deletes_what_it_counts(history_rt):
    """A damaged history row whose message id does not read matches a purge like any other: the
    transport cannot be asked for a message by an id that is not one, so its history goes with the
    status's others (a message the transport still holds writes its history again when it runs), and
    the count says so."""
    from queueing_core.tracking import MessageQuery

    rt, engine = history_rt
    good, damaged = [await rt.app.enqueue(Email(to=f"{i}@x.io", subject="s")) for i in range(2)]
    assert await rt.tracker.get(damaged.message_id) is not None
    with engine.begin() as db:
        set_row(db, "queueing_history", damaged.message_id.hex, message_id="not-a-uuid")
    result = await OpsService(rt).purge(MessageQuery(queue="emails", status=("Pending",)))
    assert result.deleted == 2
    with engine.connect() as db:
        assert db.execute(sa.text("SELECT count(*) FROM queueing_history")).scalar() == 0
    assert rt.provider.depth("emails") == 1  # the good one left the queue; the other is still there
    assert await rt.tracker.get(good.message_id) is None
