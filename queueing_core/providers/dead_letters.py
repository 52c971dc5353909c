"""Finding dead letters by message id: one way for every transport with a dead-letter queue.

A dead-letter queue can only be read from its head. To reach a letter deep in it, the reader keeps
each letter it passes over *held* (locked on Service Bus and RabbitMQ, hidden on Storage Queues and
SQS) so the next read returns the letters after it, and hands them all back once the scan ends. A
letter is matched by its exact message id (the broker's id attribute or the envelope's own field),
never by searching its text: the id of one message may appear in the body of another.

A transport supplies a :class:`DeadLetterPages`; :func:`scan_dead_letters` does the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Sequence
from typing import Generic, Protocol, TypeVar

from ..envelope import malformed_id
from ..messages import MessageStatus
from ..tracking import MessageQuery, MessageRecord

log = logging.getLogger("queueing.dead_letters")

T = TypeVar("T")

#: the most dead letters one scan holds at a time (the rest wait for the next scan)
SCAN_LIMIT = 5000
#: how long a scan hides the letters it passes over where a hold is a visibility timeout (a scan that
#: dies leaves them hidden this long; one that takes longer meets them again and ends there)
HOLD_SECONDS = 30


def id_in_text(text: str) -> str:
    """The message id a dead letter's text carries: the envelope's ``message_id`` field, or the id the
    history gives a message that is not an envelope."""
    return str(malformed_id(text))


def is_whole_queue(query: MessageQuery) -> bool:
    """A purge of everything in one queue (the transport can empty the queue itself)."""
    return query.queue is not None and query.model_dump(exclude_none=True) == {"queue": query.queue}


class DeadLetterPages(Protocol, Generic[T]):
    """A transport's dead-letter queue, read page by page."""

    async def next_page(self) -> list[T]:
        """The next dead letters, held so the following call moves on; empty at the end."""
        ...

    def message_id(self, item: T) -> str:
        """The exact message id of a dead letter."""
        ...

    def key(self, item: T) -> Hashable:
        """What tells this letter from every other in the queue (its sequence number, its id)."""
        ...

    async def remove(self, item: T) -> None: ...

    async def hand_back(self, items: Sequence[T]) -> None:
        """Make the letters passed over available again (best effort: a hold also lapses by itself)."""
        ...

    async def total(self) -> int | None:
        """How many letters the queue holds, those held or hidden included (0 where nothing outlives
        a reader that held letters; None when it cannot tell)."""
        ...


async def scan_dead_letters(
    pages: DeadLetterPages[T], wanted: set[str] | None, *, remove: bool = True, limit: int = SCAN_LIMIT
) -> set[str]:
    """Remove (or, with ``remove=False``, only find) the dead letters whose message id is in
    ``wanted`` (``None``: every one), reading the whole queue.

    Returns the ids found; when removing, also the wanted ids the queue does not hold at all (the
    scan read every letter and none was out of its sight, held by an earlier reader that died), so
    a history that still lists them can let them go."""
    found: set[str] = set()
    held: list[T] = []
    keys: set[Hashable] = set()
    seen = removed = 0
    complete = False
    try:
        while seen < limit:
            # a hold that lapsed during a long scan brings a letter back: the scan has come round
            page = [item for item in await pages.next_page() if pages.key(item) not in keys]
            if not page:
                complete = True
                break
            keys.update(pages.key(item) for item in page)
            seen += len(page)
            for item in page:
                mid = pages.message_id(item)
                held.append(item)  # handed back unless removed, also when removing it fails
                if wanted is not None and mid not in wanted:
                    continue
                if remove:
                    await pages.remove(item)
                    held.pop()
                    removed += 1
                found.add(mid)
        if not complete:
            log.warning("dead-letter scan stopped after %d letters; repeat the action for the rest", seen)
        elif remove and wanted is not None:
            total = await pages.total()
            if total is not None and total <= seen - removed:  # no letter was out of the scan's sight
                found |= wanted
    finally:
        with contextlib.suppress(Exception):
            await pages.hand_back(held)
    return found


class DeadLetterOps:
    """The ops side of a transport with a dead-letter queue and a separate history."""

    async def _dead_letters(self, queue: str, wanted: set[str] | None, *, remove: bool = True) -> set[str]:
        """Remove (or only find) the dead letters of ``queue`` with these message ids (None: all);
        returns the ids found."""
        raise NotImplementedError

    async def ops_held(self, record: MessageRecord) -> str | None:
        """DeadLettered while the dead-letter queue still holds the message whatever its history says
        (an operator's retry stopped part-way), so a retry can finish the job."""
        found = await self._dead_letters(record.queue, {str(record.message_id)}, remove=False)
        return MessageStatus.DEAD_LETTERED.value if found else None
