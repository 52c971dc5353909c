"""``queueing serve``: the worker and (from the ops issue on) the HTTP API in one process."""

from __future__ import annotations

import logging

from .settings import QueueingSettings
from .worker import Worker

log = logging.getLogger("queueing.serve")


async def serve_worker_and_api(worker: Worker, cfg: QueueingSettings, host: str | None, port: int) -> None:
    await worker.run()
