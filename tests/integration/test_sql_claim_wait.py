"""A claim that waited long still starts its runs with their leases.

A review found a claim's lease end set before the claim waited (for SQLite's write lock, which another
process held; or for a pooled connection): the rows came back with their leases over, the next sweep
of any host took the message back, and on its last attempt dead-lettered it while its run went on,
whose success was then refused. A claim that returns with less than two thirds of its lease left now
renews the leases at once, and does not run any that the sweep took meanwhile.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("claim-wait", lease_duration=timedelta(seconds=2), max_attempts=1)
class Short(QueueMessage):
    n: int = 0


async def test_a_claim_that_waited_past_its_lease_renews_before_its_run_starts(tmp_path):
    path = tmp_path / "q.db"
    app = QueueingApp("claim-wait")

    @app.handler()
    async def handle(msg: Short) -> None:
        return None

    prov = SqlProvider(f"sqlite:///{path}", worker_id="w1", maintenance_interval=3600)
    rt = Runtime(app, prov)
    await rt.open()
    try:
        r = await app.enqueue(Short())
        locked = threading.Event()

        def another_process_writes() -> None:  # a long write of another process (a purge, a rebuild)
            conn = sqlite3.connect(path)
            conn.execute("BEGIN IMMEDIATE")
            locked.set()
            time.sleep(3)
            conn.execute("COMMIT")
            conn.close()

        writer = threading.Thread(target=another_process_writes)
        writer.start()
        assert await asyncio.to_thread(locked.wait, 5)
        sub = app.subscription("Short")
        assert sub is not None
        started = prov.lease_clock()
        [d] = await prov.receive(sub, 10)
        waited = prov.lease_clock() - started
        await asyncio.to_thread(writer.join)
        assert waited > timedelta(seconds=2), f"the claim did not wait out the lease ({waited})"
        assert d.lease_until is not None
        assert d.lease_until - prov.lease_clock() > timedelta(seconds=1)  # renewed on its return
        swept = await prov.maintain(app)  # the upkeep every host runs
        assert not swept.get("leases_retried"), swept
        await prov.settle([Settlement(d, Complete())])
        assert not d.refused
        assert (await rt.tracker.get(r.message_id)).status == "Succeeded"
    finally:
        await rt.close()
