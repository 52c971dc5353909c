"""A purge refuses a message type it cannot mean, as it refuses such a queue.

Found in review: `queueing purge --type OrderPlacd --yes` (misspelt) deleted nothing and exited 0,
while a misspelt `--queue` was refused; the HTTP API's ``DELETE messages?type=...`` the same. A type
the app no longer has is still taken while some message has it (its rows are only rows).
"""

from __future__ import annotations

import sqlite3

from .test_job_cli import enqueue
from .test_ops_api import Email
from .test_ops_cli import cli, count  # noqa: F401 - the fixture


def test_purge_refuses_a_misspelt_type_as_it_refuses_a_misspelt_queue(cli, tmp_path):  # noqa: F811
    enqueue(tmp_path, "A1", "B2")
    typo = cli("purge", "--type", "OrderPlacd", "--yes")
    queue_typo = cli("purge", "--queue", "order-placd", "--yes")
    assert typo.returncode == queue_typo.returncode == 1, typo.stdout + typo.stderr
    lines = [line for line in typo.stderr.splitlines() if line.strip()]
    assert lines == ["error: no message type named 'OrderPlacd' in app 'orders'"], typo.stderr
    assert "deleted" not in typo.stdout
    # refused before the question
    asked = cli("purge", "--type", "OrderPlacd", stdin="y\n")
    assert asked.returncode == 1
    assert "delete" not in asked.stdout
    assert count(cli) == 2
    done = cli("purge", "--type", "OrderPlaced", "--yes")
    assert done.returncode == 0, done.stderr
    assert "deleted 2 messages" in done.stdout


def test_purge_takes_a_type_the_app_no_longer_has_while_a_message_has_it(cli, tmp_path):  # noqa: F811
    enqueue(tmp_path, "A1", "B2")
    with sqlite3.connect(tmp_path / "q.db") as db:
        first = "(SELECT MIN(rowid) FROM queueing_messages)"
        db.execute(f"UPDATE queueing_messages SET type = 'RetiredType' WHERE rowid = {first}")
    done = cli("purge", "--type", "RetiredType", "--yes")
    assert done.returncode == 0, done.stderr
    assert "deleted 1 message" in done.stdout
    assert count(cli) == 1


async def test_the_http_purge_answers_404_for_an_unknown_type_as_for_an_unknown_queue(api):
    client, rt, _ = api
    await rt.app.enqueue(Email(to="a@x.io", subject="s"))
    typo = await client.request("DELETE", "/messages", params={"type": "Emial"})
    queue_typo = await client.request("DELETE", "/messages", params={"queue": "emials"})
    assert typo.status_code == queue_typo.status_code == 404, typo.text
    assert typo.json()["type"] == queue_typo.json()["type"]
    assert "Emial" in typo.json()["detail"]
    listed = await client.get("/messages", params={"type": "Emial"})  # a listing still answers empty
    assert listed.status_code == 200
    assert listed.json()["items"] == []
    done = await client.request("DELETE", "/messages", params={"type": "Email"})
    assert done.status_code == 200, done.text
    assert done.json()["deleted"] == 1
