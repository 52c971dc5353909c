"""A worker process for the job-control tests: ``Chore`` handlers report progress, watch
``ctx.cancelled`` and return a result. Each event is one unbuffered O_APPEND line in the log file.

    python -m tests.integration.jobworker DB_URL SCHEMA LOG_PATH
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
from queueing_core.worker import Worker


@queue("chores", cancel_grace=timedelta(seconds=5), max_concurrency=4)
class Chore(QueueMessage):
    name: str
    steps: int = 1
    #: a path: the handler holds until a file is there (the test says when it may finish)
    gate: str = ""


def build_app(log: int | None = None) -> QueueingApp:
    app = QueueingApp("jobs")

    def note(text: str) -> None:
        if log is not None:
            os.write(log, f"{text}\n".encode())

    @app.handler()
    async def handle(msg: Chore, ctx: HandlerContext) -> dict[str, object]:
        note(f"started {msg.name}")
        while msg.gate and not os.path.exists(msg.gate):
            await asyncio.sleep(0.02)
        for step in range(1, msg.steps + 1):
            await ctx.report_progress(step, msg.steps, f"{msg.name} step {step}")
            if ctx.cancelled.is_set():
                note(f"cancelled {msg.name}")
                return {"stopped_at": step}
            await asyncio.sleep(0.05)
        note(f"finished {msg.name}")
        return {"name": msg.name, "steps": msg.steps, "pid": os.getpid()}

    return app


def main() -> None:
    url, schema, log_path = sys.argv[1:4]
    configure_logging("WARNING")
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    provider = SqlProvider(url, schema=schema or None, maintenance_interval=0.5, connect_retries=30)
    # the control store is looked at only once a minute here: a prompt cancellation came by NOTIFY
    worker = Worker(Runtime(build_app(fd), provider), poll_min=0.01, poll_max=0.2, cancel_poll=60.0)
    print("ready", flush=True)
    asyncio.run(worker.run())


if __name__ == "__main__":
    main()
