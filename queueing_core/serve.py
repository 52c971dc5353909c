"""``queueing serve``: the worker and the ops API in one process, one event loop, one runtime."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
from collections.abc import Iterator

from .errors import ConfigurationError
from .settings import QueueingSettings
from .worker import Worker, _within

log = logging.getLogger("queueing.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """Bind before starting anything, so a taken port is one clear error and not a half-started host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigurationError("--port", f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


async def serve_worker_and_api(worker: Worker, cfg: QueueingSettings, host: str | None, port: int) -> None:
    if host is None:
        await worker.run()
        return
    import uvicorn

    from .ops.api import create_app
    from .ops.guard import LocalOnly
    from .ops.service import OpsService

    key = cfg.api_key.get_secret_value() if cfg.api_key else None
    if key is None and not is_loopback(host):
        raise ConfigurationError(
            "QUEUEING_API_KEY",
            f"not set, and the API would listen on {host} without authentication",
            "set a key, or serve on 127.0.0.1",
        )
    sock = bind(host, port)
    port = int(sock.getsockname()[1])  # the port bound, when 0 asked for any
    api = create_app(
        OpsService(worker.runtime),
        api_key=key,
        # without a key: requests from this machine only, and never from a page of another site
        local=LocalOnly(host, port) if key is None else None,
        max_body_bytes=cfg.api_max_body_bytes,
    )

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the worker owns SIGTERM/SIGINT
            yield

    # the worker owns SIGINT, so uvicorn's "press CTRL+C again to force quit" cannot end a request
    # that never finishes: its graceful shutdown is bounded instead (then its requests are cancelled;
    # uvicorn takes whole seconds)
    grace = max(1, math.ceil(worker.close_floor))
    server = Server(
        uvicorn.Config(
            api,
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=grace,
        )
    )
    if key is None:
        log.warning(
            "QUEUEING_API_KEY is not set: the ops API answers requests without a key sent to %s:%d "
            "(or localhost) from this machine, and refuses those a web page of another site makes",
            host,
            port,
        )
    log.info("ops API on http://%s:%d/api/_system/queueing", host, port)
    shown = f"[{host}]" if ":" in host else host
    # the one line a new user needs: where to look
    print(
        f"dashboard: http://{shown}:{port}/api/_system/queueing/ui/"
        + (" (sign in with QUEUEING_API_KEY)" if key else " (no key: open to this machine only)"),
        flush=True,
    )
    api_task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await worker.run()
    finally:
        server.should_exit = True
        await _api_stopped(api_task, grace)


async def _api_stopped(api_task: asyncio.Task[None], grace: int) -> None:
    """Wait for the API server to stop: its requests get ``grace`` (uvicorn's bounded graceful
    shutdown: then it cancels them and returns), and the server a second more to notice the stop
    and close; then it is cancelled and left, not awaited (a request that ignores its cancellation
    must not hold the host)."""
    # (uvicorn looks at ``should_exit`` every 0.1 s, and waits 0.1 s for its connections to close)
    within = grace + 1.0
    if not await _within(api_task, within):
        log.warning("the ops API did not stop within %.1fs: the stop goes on without it", within)
