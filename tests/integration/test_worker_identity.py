"""The worker id in the logs is the lease owner in the database: one id per process, not two."""

from __future__ import annotations

import asyncio
import logging

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage
from queueing_core.bootstrap import bootstrap
from queueing_core.settings import QueueingSettings
from queueing_core.worker import Worker


class Slow(QueueMessage):
    n: int


async def test_the_worker_logs_under_the_id_its_leases_carry(tmp_path, caplog):
    app = QueueingApp("identity")
    started, release = asyncio.Event(), asyncio.Event()

    @app.handler()
    async def hold(msg: Slow) -> None:
        started.set()
        await release.wait()

    db = tmp_path / "q.db"
    runtime = bootstrap(app, QueueingSettings(database_url=f"sqlite:///{db}"))
    with caplog.at_level(logging.INFO, logger="queueing.worker"):
        async with runtime, Worker(runtime, poll_min=0.01, poll_max=0.05) as worker:
            await app.enqueue(Slow(n=1))
            await asyncio.wait_for(started.wait(), timeout=30)
            engine = sa.create_engine(f"sqlite:///{db}")
            with engine.connect() as conn:
                owners = conn.execute(sa.text("SELECT locked_by FROM queueing_messages")).scalars().all()
            engine.dispose()
            release.set()
    assert owners == [worker.worker_id]
    assert f"worker {worker.worker_id} started" in caplog.text


def test_a_worker_id_that_contradicts_the_lease_owner_is_refused(tmp_path):
    app = QueueingApp("identity")
    runtime = bootstrap(app, QueueingSettings(database_url=f"sqlite:///{tmp_path}/q.db", worker_id="host-a"))
    assert Worker(runtime).worker_id == "host-a"
    with pytest.raises(ValueError, match="differs from the provider's lease owner"):
        Worker(runtime, worker_id="host-b")
