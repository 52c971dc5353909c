"""An ordered queue's claim finds the head of its line without reading the queue's history, on SQLite
and PostgreSQL: its running messages on the lease sweeper's partial index, its waiting ones on the
claim's. One lookup of both kinds in id order walked the history from its oldest row on SQLite (found
in review): 53 ms a claim with 200,000 settled rows in the queue, 0.4 ms with none, under the write
lock every other claim and settlement waits for (``bench/RESULTS.md``, "Ordered queues under a long
history")."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta
from typing import Any

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql.statements import claim_params

from .history_rows import fill
from .test_sql_history_plan import nodes
from .test_sql_upkeep_plans import sqlite_reads


@queue("ordered_hist", ordered=True)
class Job(QueueMessage):
    n: int


async def test_an_ordered_claim_reads_no_history(sql_db):
    app = QueueingApp("ordered")
    app.handler(Job)(lambda msg: None)
    prov = sql_db.provider(listen=False)
    await prov.open(app)
    await fill(prov, ("ordered_hist",))  # 100,000 rows, nearly all of them history
    m = prov.tables.messages
    now = datetime.now(UTC)
    if sql_db.backend == "sqlite":
        assert prov._hot is not None
        head = prov._hot.claim_head
        lease = now + timedelta(seconds=30)
        values = head.params(claim_params("ordered_hist", 1, now, lease))
        with sqlite3.connect(sql_db.url.removeprefix("sqlite:///")) as conn:
            plan = [str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {head.sql}", values)]
        assert not sqlite_reads(plan, m.name), plan
        assert not [p for p in plan if " leased " in f"{p} " and "ix_queueing_messages_leased" not in p], plan
        assert not [p for p in plan if " waiting " in f"{p} " and "ix_queueing_messages_claim" not in p], plan
        return
    text, params = prov.claim_sql("ordered_hist", 1, now, now + timedelta(seconds=30), ordered=True)
    async with prov.engine.connect() as conn:
        raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {text}", params)).scalar_one()
        await conn.rollback()
    plan: dict[str, Any] = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    used = [n for n in nodes(plan) if n.get("Relation Name") == m.name]
    assert not [n for n in used if n["Node Type"] == "Seq Scan"], json.dumps(plan, indent=1)
    indexes = {n.get("Index Name") for n in used if n["Node Type"] != "ModifyTable"}
    assert indexes <= {
        "ix_queueing_messages_leased",
        "ix_queueing_messages_claim",
        "queueing_messages_pkey",
    }, indexes
