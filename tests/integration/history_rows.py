"""Tables of long history for the plan tests: 100,000 rows over a few queues, as years of use leave
them. Mostly Succeeded and settled long ago (a third of those archived long ago), one in ten
dead-lettered, about one in a thousand leased (its lease long lapsed) and one in a thousand waiting."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

ROWS = 100_000
#: the rows' shape by their number ``n``, in SQL both databases read the same way
STATUS = """CASE WHEN n % 1000 = 0 THEN 'Pending' WHEN n % 997 = 0 THEN 'Leased'
                 WHEN n % 10 = 0 THEN 'DeadLettered' ELSE 'Succeeded' END"""
SETTLED = "n % 1000 <> 0 AND n % 997 <> 0"
ARCHIVED = f"n % 3 = 0 AND {SETTLED}"
COLUMNS = """message_id, tracking_id, queue, type, status, attempt, created_at, updated_at,
             available_at, settled_at, locked_until, headers, body, archived, archived_at"""


async def fill(prov: Any, queues: tuple[str, ...]) -> None:
    """:data:`ROWS` rows spread over ``queues``, on SQLite or PostgreSQL; the planner's statistics are
    refreshed on PostgreSQL (what autovacuum does after such a load)."""
    m = prov.tables.messages
    if prov.backend == "sqlite":
        rows = f"""
            WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < {ROWS}),
                 q(k, name) AS (SELECT row_number() OVER () - 1, value FROM json_each(:queues))
            INSERT INTO {m.name} ({COLUMNS}, awaited, lease_token)
            SELECT lower(hex(randomblob(16))), lower(hex(randomblob(16))),
                   (SELECT name FROM q WHERE k = n % {len(queues)}), 'Job', {STATUS}, 1,
                   datetime('2026-01-01', '+' || n || ' seconds'), '2026-01-01 00:00:00.000000',
                   datetime('2026-01-01', '+' || n || ' seconds'),
                   CASE WHEN {SETTLED} THEN '2026-02-01 00:00:00.000000' END, '2026-03-01 00:00:00.000000',
                   '{{}}', '{{}}', {ARCHIVED}, CASE WHEN {ARCHIVED} THEN '2026-02-02 00:00:00.000000' END,
                   0, 1
            FROM i"""
        params: dict[str, Any] = {"queues": json.dumps(queues)}
    else:
        rows = f"""
            INSERT INTO {m.fullname} ({COLUMNS})
            SELECT gen_random_uuid(), gen_random_uuid(), (CAST(:queues AS text[]))[1 + n % {len(queues)}],
                   'Job', {STATUS}, 1, now() - interval '90 days', now() - interval '90 days',
                   now() - interval '90 days' + n * interval '1 second',
                   CASE WHEN {SETTLED} THEN now() - interval '60 days' END, now() - interval '50 days',
                   '{{}}'::jsonb, '{{}}'::jsonb, {ARCHIVED},
                   CASE WHEN {ARCHIVED} THEN now() - interval '59 days' END
            FROM generate_series(1, {ROWS}) AS n"""
        params = {"queues": list(queues)}
    async with prov.engine.begin() as conn:
        await conn.execute(sa.text(rows), params)
    async with prov.engine.connect() as conn:
        if prov.backend == "postgresql":
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(sa.text(f"ANALYZE {m.fullname}"))
        assert (await conn.execute(sa.text(f"SELECT count(*) FROM {m.fullname}"))).scalar() == ROWS
