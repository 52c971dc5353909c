"""For race tests on two real PostgreSQL connections: whether a statement waits for a lock."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


async def waiting_for_a_lock(prov: Any, table: str) -> bool:
    """Some statement naming ``table`` (schema-qualified) waits for a lock another transaction holds."""
    async with prov.engine.connect() as conn:
        waiting = await conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :q"),
            {"q": f"%{table}%"},
        )
        return bool(waiting.scalar())
