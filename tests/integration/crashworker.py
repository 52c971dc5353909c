"""A worker process whose handler kills it: the message that ends every run that takes it (a native
crash, the OOM killer) as far as the queue can tell. Configured from the environment (``QUEUEING_*``,
``QueueingStorage``), as ``queueing worker`` is; each run appends the message's number to LOG_PATH
with one unbuffered O_APPEND write before the process kills itself with SIGKILL.

    python -m tests.integration.crashworker LOG_PATH
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import bootstrap
from queueing_core.logs import configure_logging
from queueing_core.worker import Worker

ATTEMPTS = 3


@queue("crashing", lease_duration=timedelta(seconds=2), max_attempts=ATTEMPTS)
class Fatal(QueueMessage):
    n: int


def app_of() -> QueueingApp:
    return QueueingApp("crash")


def main() -> None:
    configure_logging("WARNING")
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    app = app_of()

    @app.handler()
    async def handle(msg: Fatal) -> None:
        os.write(fd, f"{msg.n}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)

    worker = Worker(bootstrap(app), poll_min=0.05, poll_max=0.2, shutdown_timeout=5)
    print("ready", flush=True)
    asyncio.run(worker.run())


if __name__ == "__main__":
    main()
