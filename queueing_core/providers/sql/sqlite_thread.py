"""aiosqlite's thread for a connection of the kit's SQLite pool: the calls queued on it, counted until
each has ended, so that the hot path knows when nothing but itself can be using the connection.

aiosqlite runs every call on a connection in one thread of its own, in the order the calls were queued
(its ``Connection._tx``, which that thread reads). The SQLite hot path may run its calls on the event
loop's own thread instead (``sqlite_driver``), which is safe only while no call is queued on that
thread or running there: then the ``sqlite3`` connection is the event loop's alone for as long as its
call runs, since only the event loop's thread queues calls and the call never awaits. :class:`Calls`
replaces the connection's queue for everyone who queues on it (aiosqlite itself, SQLAlchemy's adapter
through it, the kit's own close), and counts each call from its queuing to its end in the thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sqlite_driver import Inline


class Calls:
    """aiosqlite's queue of calls to its thread, each call counted from its queuing to its end.

    Two counters, each written by one thread only (queued by the queuing one, under a lock since
    aiosqlite may also queue from a garbage collector's finalizer; ended by aiosqlite's thread), so
    neither loses a count; the connection is idle when they are equal."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self._lock = threading.Lock()
        self._queued = 0
        self._ended = 0
        #: the hot path's own bookkeeping for this connection (``sqlite_driver``), once it has run inline
        self.inline: Inline | None = None

    def put_nowait(self, item: tuple[Any, Callable[[], Any]]) -> None:
        future, function = item
        with self._lock:
            self._queued += 1
        self._queue.put_nowait((future, functools.partial(self._run, function)))

    def _run(self, function: Callable[[], Any]) -> Any:
        """In aiosqlite's thread: the call, counted as ended however it ends."""
        try:
            return function()
        finally:
            with self._lock:
                self._ended += 1

    @property
    def idle(self) -> bool:
        """No call queued on the thread, none running there."""
        return self._queued == self._ended

    def __getattr__(self, name: str) -> Any:
        # only the queue's reading side is handed on: a way of queuing other than ``put_nowait`` (in a
        # later aiosqlite) would go uncounted, and the hot path would take a busy connection for idle
        if name in _READING:
            return getattr(self._queue, name)
        raise AttributeError(
            f"the counted queue of aiosqlite's calls has no {name!r} (only put_nowait queues)"
        )


#: what of aiosqlite's queue the counted one hands on: its reading side
_READING = frozenset({"get", "get_nowait", "empty", "qsize"})


def count_calls(conn: Any) -> None:
    """Count the calls queued on ``conn`` (an ``aiosqlite.Connection`` not yet started): its thread
    keeps reading the queue it was made with, and everyone who queues goes through :class:`Calls`."""
    conn._tx = Calls(conn._tx)


def calls_of(conn: Any) -> Calls | None:
    """The counted queue of ``conn``, if the kit's connector made it (a caller's engine's is not)."""
    calls = getattr(conn, "_tx", None)
    return calls if isinstance(calls, Calls) else None


def another_user_returned(adapted: Any) -> None:
    """A user other than the hot path gave the pooled connection back (``adapted``: SQLAlchemy's
    adapter of the aiosqlite connection): what the hot path read of its settings may have changed
    (a ``PRAGMA`` through the engine), so it is read again before its next call on the event loop."""
    calls = calls_of(getattr(adapted, "_connection", None))
    if calls is not None and calls.inline is not None:
        calls.inline.settings = None
