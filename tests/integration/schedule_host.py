"""A real host process for the schedule tests: a worker whose app enqueues a ``Beat`` every second.

Each handled beat appends its tick to a log file with one unbuffered O_APPEND write.

    python -m tests.integration.schedule_host DB_URL SCHEMA WORKER_ID LOG_PATH
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta

from queueing_core import HandlerContext, QueueingApp, QueueMessage, queue
from queueing_core.logs import configure_logging
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.schedules import TICK_HEADER
from queueing_core.worker import Worker


@queue("beats")
class Beat(QueueMessage):
    pass


def build_app(fd: int) -> QueueingApp:
    app = QueueingApp("beats")
    app.every(timedelta(seconds=1), Beat(), name="beat")

    @app.handler()
    async def handle(msg: Beat, ctx: HandlerContext) -> None:
        os.write(fd, f"{ctx.headers[TICK_HEADER]} {msg.message_id}\n".encode())

    return app


def main() -> None:
    url, schema, worker_id, log_path = sys.argv[1:5]
    configure_logging("WARNING")
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    provider = SqlProvider(url, schema=schema or None, worker_id=worker_id, connect_retries=30)
    worker = Worker(Runtime(build_app(fd), provider), poll_min=0.01, poll_max=0.2, shutdown_timeout=10)

    async def announce() -> None:
        await worker.started.wait()
        print("ready", flush=True)

    async def run() -> None:
        ready = asyncio.create_task(announce())
        await worker.run()
        await ready

    asyncio.run(run())


if __name__ == "__main__":
    main()
