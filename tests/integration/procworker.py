"""A real worker process for the multi-process tests.

Handles ``Tick`` messages; each handling appends the message id to a log file with one unbuffered
O_APPEND write, so even a ``kill -9`` loses no record of a handler that ran.

    python -m tests.integration.procworker DB_URL SCHEMA WORKER_ID LOG_PATH HANDLER_SECONDS [GATE N]

With ``GATE N``, handlers of messages numbered N and up wait until the file GATE exists: the run
cannot end before the test lets it, however fast the machine or late the test's look.
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.logs import configure_logging
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

# the crash test wants a short lease (quick recovery); the others set PROC_LEASE_SECONDS
LEASE = timedelta(seconds=float(os.environ.get("PROC_LEASE_SECONDS", "2")))


@queue("ticks", lease_duration=LEASE, max_concurrency=8, max_attempts=20)
class Tick(QueueMessage):
    n: int


def main() -> None:
    url, schema, worker_id, log_path, seconds = sys.argv[1:6]
    gate, gated_from = (sys.argv[6], int(sys.argv[7])) if len(sys.argv) > 7 else (None, 0)
    configure_logging("WARNING")
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    pause = float(seconds)
    app = QueueingApp("procs")

    @app.handler()
    async def handle(msg: Tick) -> None:
        while gate is not None and msg.n >= gated_from and not os.path.exists(gate):
            await asyncio.sleep(0.05)
        os.write(fd, f"{msg.message_id}\n".encode())
        if pause:
            await asyncio.sleep(pause)

    provider = SqlProvider(
        url, schema=schema or None, worker_id=worker_id, maintenance_interval=0.5, connect_retries=30
    )
    worker = Worker(
        Runtime(app, provider),
        worker_id=worker_id,
        poll_min=0.01,
        poll_max=0.2,
        prefetch=4,
        shutdown_timeout=10,
    )
    print("ready", flush=True)
    asyncio.run(worker.run())


if __name__ == "__main__":
    main()
