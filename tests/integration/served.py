"""An ASGI app on a real uvicorn server in a thread, on a free loopback port, for the tests that need
what only a real server does (its own logging, real sockets, real Host headers)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(app: Any, port: int | None = None, **config: Any) -> Iterator[str]:
    """Yield ``http://127.0.0.1:<port>`` while ``app`` serves there; ``config`` goes to uvicorn."""
    port = port or free_port()
    config = {"log_level": "warning", "lifespan": "off", **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # generous: a loaded machine starts slowly
    while not server.started:
        assert thread.is_alive(), "the server stopped while starting"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
