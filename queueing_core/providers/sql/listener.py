"""LISTEN/NOTIFY wake-ups on PostgreSQL, with reconnects. Polling covers the gaps."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy.engine import URL

from .engine import PasswordSource, libpq_conninfo

log = logging.getLogger("queueing.sql")

#: PostgreSQL's longest identifier (NAMEDATALEN - 1), in bytes; NOTIFY refuses a longer channel
MAX_IDENTIFIER = 63


def channel_name(base: str, schema: str | None) -> str:
    """The NOTIFY channel ``<base>_<schema>``. A name longer than PostgreSQL allows keeps its start and
    ends in a hash of the whole name: the same on every host, and two long schemas that share their
    first 40 characters still get their own channels. Short names are left as they always were."""
    name = f"{base}_{schema or 'public'}"
    if len(name.encode()) <= MAX_IDENTIFIER:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:16]
    return f"{name[: MAX_IDENTIFIER - len(digest) - 1]}_{digest}"


class PgListener:
    def __init__(
        self, url: URL, channel: str, *, also: Sequence[str] = (), password: PasswordSource | None = None
    ) -> None:
        self._conninfo = libpq_conninfo(url)
        self._password = password  # asked again on every reconnect: a token may have been renewed
        self.channel = channel
        #: more channels heard on the same connection (their payloads go to the same ``on_notify``)
        self.also = tuple(also)
        self.on_notify: Callable[[str], None] = lambda _queue: None
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="queueing-listen")
            # not essential: if LISTEN is slow or down, polling still finds the work
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.connected.wait(), 5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self.connected.clear()

    async def _run(self) -> None:
        import psycopg
        from psycopg import sql

        delay = 0.5
        while True:
            try:
                extra: dict[str, Any] = {} if self._password is None else {"password": await self._password()}
                conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True, **extra)
                async with conn:
                    for channel in (self.channel, *self.also):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self.connected.set()
                    delay = 0.5
                    async for note in conn.notifies():
                        self.on_notify(note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database went away: poll meanwhile, reconnect with backoff
                self.connected.clear()
                log.warning(
                    "LISTEN connection lost (%s); polling until it is back (retry in %.1fs)",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
