"""A handler's "run again at" of ``datetime.max`` ("never") is kept a day short of the year 10000: kept
as the last moment of 9999 in UTC, PostgreSQL gave it back in a session zone ahead of UTC (PGTZ, or
the server's default) as a year 10000, and every read of the message's history failed while it
slept (found in review)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime
from typing import Any

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import make_provider
from queueing_core.runtime import Runtime
from queueing_core.settings import QueueingSettings
from queueing_core.tracking.base import MessageQuery
from queueing_core.worker import Worker
from tests.services import POSTGRES_URL, drop_schema


@queue("far-never")
class Never(QueueMessage):
    n: int = 0


async def test_a_year_9999_run_again_time_reads_back_in_a_session_ahead_of_utc(monkeypatch: Any) -> None:
    monkeypatch.setenv("PGTZ", "Asia/Tokyo")
    schema = f"far_{uuid.uuid4().hex[:8]}"
    app = QueueingApp("far-never")

    @app.handler()
    async def handle(msg: Never) -> datetime:
        return datetime.max  # "never again", naive: taken as UTC now

    cfg = QueueingSettings(provider="sql", database_url=POSTGRES_URL, database_schema=schema)
    rt = Runtime(app, make_provider(cfg))
    try:
        await rt.open()
        sent = await app.enqueue(Never())
        w = Worker(rt, shutdown_timeout=1, poll_min=0.05, poll_max=0.2, schedules=False)
        await w.start()
        for _ in range(100):
            rec = await rt.tracker.get(sent.message_id)
            if rec is not None and rec.status == "Sleeping":
                break
            await asyncio.sleep(0.1)
        await w.shutdown()
        rec = await rt.tracker.get(sent.message_id)
        assert rec is not None
        assert rec.status == "Sleeping", rec
        page = await rt.tracker.query(MessageQuery(queue="far-never"), limit=10)
        assert [r.message_id for r in page.items] == [sent.message_id]
    finally:
        await rt.close()
        await drop_schema(schema)
