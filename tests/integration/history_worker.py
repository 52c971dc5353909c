"""A real worker process for the history-convergence tests, configured from the environment like
``queueing serve`` (``bootstrap``), handling ``Beat`` messages.

With ``CRASH_AT_HISTORY=1`` it kills itself (SIGKILL, as ``kill -9``) at its first history write
after a settlement: the messages are settled on the transport, their history is not yet written.

    python -m tests.integration.history_worker
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Sequence
from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import bootstrap
from queueing_core.logs import configure_logging
from queueing_core.tracking import MessageRecord
from queueing_core.worker import Worker


@queue("beats", lease_duration=timedelta(seconds=10), max_concurrency=8)
class Beat(QueueMessage):
    n: int


def build_app() -> QueueingApp:
    app = QueueingApp("beats")

    @app.handler()
    async def handle(msg: Beat) -> None:
        await asyncio.sleep(0.01)

    return app


#: what ``QUEUEING_APP=tests.integration.history_worker:app`` loads (the CLI test)
app = build_app()


def main() -> None:
    configure_logging("WARNING")
    app = build_app()
    runtime = bootstrap(app)
    if os.environ.get("CRASH_AT_HISTORY") == "1":
        tracker = runtime.tracker
        write = tracker.upsert

        async def crash_at_outcomes(records: Sequence[MessageRecord]) -> None:
            if any(r.status == "Succeeded" for r in records):
                os.kill(os.getpid(), signal.SIGKILL)  # settled, history not written: the crash
            await write(records)

        tracker.upsert = crash_at_outcomes  # type: ignore[method-assign]
    worker = Worker(runtime, poll_min=0.01, poll_max=0.2, shutdown_timeout=5)
    print("ready", flush=True)
    asyncio.run(worker.run())


if __name__ == "__main__":
    main()
