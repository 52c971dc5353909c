"""Two handles on one schedule tick store, standing for two hosts: shared by the schedule-store tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from queueing_core import QueueingApp
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.schedules import SqlTickStore
from queueing_core.schedules import MemoryTickStore, TickStore
from tests.services import POSTGRES_URL, drop_schema, require


@asynccontextmanager
async def two_tick_stores(
    kind: str, request: pytest.FixtureRequest, tmp_path: Any
) -> AsyncIterator[tuple[TickStore, TickStore, SqlProvider | None]]:
    """``kind``: memory, sqlite, postgres (tick and messages in one transaction), sqlite-claim,
    postgres-claim (the side database's claim-send-confirm) or tables (Azurite). Yields both handles and,
    on SQL, the first host's provider; deletes only the schema, file or table it made."""
    if kind == "memory":
        one = MemoryTickStore()
        yield one, one, None
        return
    if kind == "tables":
        from azure.data.tables.aio import TableClient

        from queueing_core.providers.tables import TablesControlStore

        azurite = request.getfixturevalue("azurite")
        name = f"t{uuid.uuid4().hex[:24]}"
        controls = [
            TablesControlStore(
                TableClient.from_connection_string(azurite.connection_string, name), create_table=True
            )
            for _ in range(2)
        ]
        try:
            yield controls[0].schedule_store(), controls[1].schedule_store(), None
        finally:
            async with TableClient.from_connection_string(azurite.connection_string, name) as client:
                await client.delete_table()
            for c in controls:
                await c.aclose()
        return
    schema = None
    if kind.startswith("postgres"):
        require("PostgreSQL", "127.0.0.1", 5432)
        schema = f"qs_{uuid.uuid4().hex[:10]}"
        providers = [SqlProvider(POSTGRES_URL, schema=schema, listen=False) for _ in range(2)]
    else:
        providers = [SqlProvider(f"sqlite:///{tmp_path}/ticks.db") for _ in range(2)]
    try:
        for p in providers:
            await p.open(QueueingApp("t"))
        transactional = not kind.endswith("claim")
        a, b = (SqlTickStore(p, transactional=transactional) for p in providers)
        yield a, b, providers[0]
    finally:
        for p in providers:
            await p.close()
        if schema:
            await drop_schema(schema)
