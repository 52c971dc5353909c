"""A long history does not move the claim off its partial index, and the hot tables carry the storage
parameters that keep vacuum ahead of it (PostgreSQL)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql.schema import HOT_TABLE_SETTINGS

from .history_rows import fill


@queue("hist")
class Job(QueueMessage):
    n: int


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a JSON plan, depth first."""
    out = [plan]
    for child in plan.get("Plans", []):
        out += nodes(child)
    return out


async def test_the_claim_reads_its_partial_index_under_a_large_history(pg_db):
    prov = pg_db.provider()
    app = QueueingApp("hist")
    app.message(Job)
    await prov.open(app)
    m = prov.tables.messages
    # the same queue as the claim: 100,000 rows of history and 100 waiting ones, so a plan on the
    # queue's other indexes, or a scan of the table, would be there to choose
    await fill(prov, ("hist",))
    now = prov.clock()
    text, params = prov.claim_sql("hist", 10, now, now + timedelta(seconds=30))
    async with prov.engine.connect() as conn:  # values bound by the driver, as when workers claim
        raw = (await conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {text}", params)).scalar_one()
        await conn.rollback()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]["Plan"]
    used = [n for n in nodes(plan) if n.get("Relation Name") == m.name]
    # the claim's row source is the partial index; the UPDATE itself names the table too
    assert any(n.get("Index Name") == "ix_queueing_messages_claim" for n in used), json.dumps(plan, indent=1)
    assert not any(n["Node Type"] == "Seq Scan" for n in used), json.dumps(plan, indent=1)
    # and it does claim the waiting rows, oldest first
    async with prov.claims.connect() as conn:
        rows = (await conn.exec_driver_sql(text, params)).all()
    assert len(rows) == 10


async def test_the_hot_tables_carry_fillfactor_and_autovacuum_settings(pg_db):
    prov = pg_db.provider()
    await prov.open(QueueingApp("hist"))
    async with prov.engine.connect() as conn:
        for table, wanted in HOT_TABLE_SETTINGS.items():
            options = (
                await conn.execute(
                    sa.text(
                        "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = :s AND c.relname = :t"
                    ),
                    {"s": pg_db.schema, "t": table},
                )
            ).scalar_one()
            have = dict(o.split("=", 1) for o in options)
            assert {k: float(v) for k, v in have.items()} == {k: float(v) for k, v in wanted.items()}
