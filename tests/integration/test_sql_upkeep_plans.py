"""The periodic upkeep (lease sweep, expiry, retention) and the poll of a queue with no handler find
their rows through an index under a long history, on SQLite and PostgreSQL. A scan would read the
whole table again for every batch of a few thousand rows retention archives or deletes, and on SQLite
it would do so under the one write lock every worker's claims and settlements wait for (measured on
1.2M rows: about a second a pass, every 5 s)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue

from .history_rows import fill
from .test_sql_history_plan import nodes


@queue("upkeep")
class Job(QueueMessage):
    n: int


@queue("upkeep_short", keep_processed_for=timedelta(days=1))
class Short(QueueMessage):
    n: int


@queue("upkeep_waiting")
class Waiting(QueueMessage):
    n: int


#: partial indexes small whatever the history: the rows waiting to run, and the rows running now
SMALL_INDEXES = ("ix_queueing_messages_claim", "ix_queueing_messages_leased")


def sqlite_reads(plan: list[str], table: str) -> list[str]:
    """What reads the messages table (or its alias ``newer``) and is not a range of an index or the
    primary key, nor one of the partial indexes that hold only the rows waiting to run or running."""
    on_messages = [p for p in plan if f" {table} " in f"{p} " or " newer " in f"{p} "]
    assert on_messages, plan
    return [p for p in on_messages if not p.startswith("SEARCH") and not p.endswith(SMALL_INDEXES)]


async def test_upkeep_reads_an_index_under_a_long_history(sql_db):
    app = QueueingApp("upkeep")
    app.handler(Job)(lambda msg: None)
    app.handler(Short)(lambda msg: None)
    app.message(Waiting)  # no handler here: its rows are marked as waiting for one
    prov = sql_db.provider(listen=False)
    await prov.open(app)
    await fill(prov, ("upkeep", "upkeep_short", "upkeep_waiting"))
    m = prov.tables.messages
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if m.name in statement and statement.lstrip().split()[0].upper() in {"SELECT", "UPDATE", "DELETE"}:
            seen.append((statement, parameters))

    sa.event.listen(prov.engine.sync_engine, "before_cursor_execute", record)
    done = await prov.maintain(app)
    assert await prov.receive(app.subscription("Waiting"), 10) == []
    sa.event.remove(prov.engine.sync_engine, "before_cursor_execute", record)
    # the upkeep had work of every kind: rows past their retention, and leases that lapsed
    assert done["deleted_processed"] > 0, done
    assert done["archived"] > 0, done
    assert done["deleted_archived"] > 0, done
    assert done["leases_retried"] > 0, done
    assert len({" ".join(s.split()) for s, _ in seen}) >= 8  # sweep x4, expiry, retention x3, the poll
    async with prov.engine.connect() as conn:
        for statement, values in seen:
            said = " ".join(statement.split())
            if sql_db.backend == "sqlite":
                rows = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", values)
                plan = [str(r[3]) for r in rows]
                assert not sqlite_reads(plan, m.name), said
                # a batch of retention: its rows taken by primary key, not by a second range of an index
                assert " IN (SELECT" not in said or "PRIMARY KEY" in plan[0], (said, plan)
            else:
                raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {statement}", values)).scalar_one()
                plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
                used = [n for n in nodes(plan) if n.get("Relation Name") == m.name]
                assert used, said
                assert not [n for n in used if n["Node Type"] == "Seq Scan"], (said, json.dumps(plan))
                by_key = [n for n in used if str(n.get("Index Name", "")).endswith("_pkey")]
                assert "ANY (ARRAY(" not in said.upper() or by_key, (said, json.dumps(plan))
        await conn.rollback()
