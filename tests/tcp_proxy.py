"""A small asyncio TCP proxy that tests put in front of a service to cut it off and bring it back.

``cut()`` closes every connection through it and stops listening (a client sees "connection refused",
as when the service is down); ``restore()`` listens again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def up(self) -> bool:
        return self._server is not None

    async def start(self) -> int:
        if self.port == 0:
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = int(s.getsockname()[1])
        self._server = await asyncio.start_server(self._serve, self.host, self.port, reuse_address=True)
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._streams.update((writer, up_writer))
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in pumps:
                t.cancel()
            for w in (writer, up_writer):
                self._streams.discard(w)
                w.close()
            self._tasks.difference_update(pumps)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def cut(self) -> None:
        """Refuse new connections and drop the open ones."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._streams):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._streams.clear()
        await asyncio.sleep(0)

    async def restore(self) -> None:
        if self._server is None:
            await self.start()

    async def stop(self) -> None:
        await self.cut()
        for t in list(self._tasks):
            t.cancel()
