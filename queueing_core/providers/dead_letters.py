"""Finding dead letters by message id: one way for every transport with a dead-letter queue.

A dead-letter queue can only be read from its head. To reach a letter deep in it, the reader keeps
each letter it passes over *held* (locked on Service Bus and RabbitMQ, hidden on Storage Queues and
SQS) so the next read returns the letters after it, and hands them all back once the scan ends. A
letter is matched by its exact message id (the broker's id attribute or the envelope's own field),
never by searching its text: the id of one message may appear in the body of another.

An operator's retry locates before it sends: the letters of the message are found and held, the
copy is sent, and only the letters held are removed (by their transport keys, never by id again), so
a copy that runs and is dead-lettered again meanwhile keeps its new letter.

A transport supplies a :class:`DeadLetterPages`; :func:`scan_dead_letters` does the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, Protocol, TypeVar

from ..envelope import DEAD_AT, DESCRIPTION, REASON, Envelope, malformed_id
from ..errors import InvalidArgument, InvalidOperation
from ..messages import MessageStatus
from ..tracking import MessageQuery, MessageRecord

log = logging.getLogger("queueing.dead_letters")

T = TypeVar("T")

#: the statuses of a message whose letter waits in a dead-letter queue
DEAD_STATES = (MessageStatus.DEAD_LETTERED.value, MessageStatus.EXPIRED.value)
#: the most dead letters one scan holds at a time (the rest wait for the next scan)
SCAN_LIMIT = 5000
#: how long a scan hides the letters it passes over where a hold is a visibility timeout (a scan that
#: dies leaves them hidden this long; one that takes longer meets them again and ends there, not
#: knowing what lies further on)
HOLD_SECONDS = 30


def id_in_text(text: str) -> str:
    """The message id a dead letter's text carries: the envelope's ``message_id`` field, or the id the
    history gives a message that is not an envelope."""
    return str(malformed_id(text))


class WholeQueue(MessageQuery):
    """The query of a purge asked to empty its one queue whole (see :func:`whole_queue`)."""


def whole_queue(query: MessageQuery) -> WholeQueue:
    """``query``, naming one queue and nothing else, as a purge that empties that queue on the
    transport itself: the messages with no history go too, and, where the transport's purge takes
    them (``purge_takes_held``), those a worker holds. Made only on an operator's explicit request (the
    API's ``all=true``, the CLI's ``--all``, the dashboard's "Empty queue"), never because a query
    happens to name a queue alone: that purge goes message by message and leaves held ones."""
    if not _queue_alone(query):
        raise InvalidArgument(
            "all", "empties one whole queue: give it with the queue alone (or with no filter at all)"
        )
    return WholeQueue(queue=query.queue)


def is_whole_queue(query: MessageQuery) -> bool:
    """A purge of everything in one queue, asked for as such (the transport empties the queue)."""
    return isinstance(query, WholeQueue) and _queue_alone(query)


def _queue_alone(query: MessageQuery) -> bool:
    return query.queue is not None and query.model_dump(exclude_none=True) == {"queue": query.queue}


class DeadLetterPages(Protocol, Generic[T]):
    """A transport's dead-letter queue, read page by page.

    A transport whose :meth:`key` stays with its letter for good, also once a hold lapsed and the
    letter was read again (a sequence number, a queue message id; not a delivery tag), says so with
    a class attribute ``keys_outlive_holds = True``: an operator's retry then finds a located letter
    whose hold lapsed during its send again by that key (without it, the retry reports the failure
    and leaves the letter, a duplicate)."""

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
        """How many letters the queue holds, those held or hidden included (None when it cannot
        tell: then a purge never takes a letter it did not meet for gone)."""
        ...


@dataclass
class LetterPass(Generic[T]):
    """One read of a dead-letter queue from its head."""

    #: to hand back when the pass ends: letters passed over, or found and not removed
    held: list[T] = field(default_factory=list)
    #: found and held for removal later (an operator's retry removes them after its copy is sent)
    located: list[T] = field(default_factory=list)
    found: set[str] = field(default_factory=set)
    seen: int = 0
    removed: int = 0
    complete: bool = False
    #: it met letters it had passed over again: their holds lapsed, and what lies after them is unknown
    came_round: bool = False


async def read_letters(
    pages: DeadLetterPages[T],
    picked: Callable[[T], bool],
    how: Literal["find", "locate", "remove"],
    run: LetterPass[T],
    limit: int,
    enough: Callable[[], bool] = lambda: False,
) -> None:
    """Read to the end of the queue (or ``limit`` letters, or until ``enough``): each letter
    ``picked`` is only found, located (held for later) or removed at once; the others are held."""
    keys: set[Hashable] = set()
    while run.seen < limit and not enough():
        read = await pages.next_page()
        page = [item for item in read if pages.key(item) not in keys]
        if not page:
            # only an empty read is the end. Letters met before mean their holds lapsed during a long
            # scan: they come back ahead of those not read yet (Service Bus hands out a lapsed letter
            # in its sequence order), so more may lie further on (found in review)
            run.complete = not read
            run.came_round = bool(read)
            return
        keys.update(pages.key(item) for item in page)
        run.seen += len(page)
        for n, item in enumerate(page):
            if not picked(item):
                run.held.append(item)
                continue
            if how == "locate":
                run.located.append(item)
            else:
                run.held.append(item)  # handed back unless removed, also when removing it fails
                if how == "remove":
                    try:
                        await pages.remove(item)
                    except BaseException:
                        run.held.extend(page[n + 1 :])  # read too: handed back with the others
                        raise
                    run.held.pop()
                    run.removed += 1
            run.found.add(pages.message_id(item))
    if run.seen >= limit and not enough():
        # at the limit: one more read tells a queue of exactly ``limit`` letters (read to its end) from
        # a longer one; what it reads is held with the rest, and handed back
        read = await pages.next_page()
        more = [item for item in read if pages.key(item) not in keys]
        run.held.extend(more)
        run.complete = not read  # (letters met before: their holds lapsed, see above)
        run.came_round = bool(read) and not more


async def scan_dead_letters(
    pages: DeadLetterPages[T],
    wanted: set[str] | None,
    *,
    remove: bool = True,
    limit: int = SCAN_LIMIT,
    before_removing: Callable[[], Awaitable[None]] | None = None,
) -> set[str]:
    """Remove (or, with ``remove=False``, only find) the dead letters whose message id is in
    ``wanted`` (``None``: every one), reading the whole queue.

    With ``before_removing`` (an operator's retry sends its copy there) the scan only *locates*: the
    letters found stay held while it reads on; once it has read to the end it hands back the letters
    passed over, awaits ``before_removing``, and then removes exactly the letters it located, by
    their transport keys. A copy that runs and is dead-lettered again in the meantime leaves a new
    letter the scan never read, and that letter stays (removing by id after the send would take it
    too, and the message would be nowhere). A located letter whose hold lapsed meanwhile (a short
    peek-lock) is read again and removed by its key where that key outlives a hold (see
    :func:`_remove_again`); where it cannot be told again, the error is raised and the letter stays:
    a duplicate, never a loss. A retry that located nothing without reading to the end (``limit``
    letters read, or the scan met letters again whose holds had lapsed) sends nothing and raises
    :class:`InvalidOperation`: its letter may lie further on.

    Returns the ids found; when removing, also the wanted ids the queue does not hold at all (the
    scan read every letter and none was out of its sight, held by an earlier reader that died), so
    a history that still lists them can let them go."""
    run: LetterPass[T] = LetterPass()
    how: Literal["find", "locate", "remove"] = (
        "find" if not remove else "remove" if before_removing is None else "locate"
    )
    try:
        await read_letters(
            pages, lambda item: wanted is None or pages.message_id(item) in wanted, how, run, limit
        )
        if run.came_round:
            log.warning(
                "dead-letter scan met letters again after %d letters: it took longer than their holds, "
                "and the letters after them were not read; repeat the action for the rest",
                run.seen,
            )
        elif not run.complete:
            log.warning("dead-letter scan stopped after %d letters; repeat the action for the rest", run.seen)
        if before_removing is not None and not run.complete and not run.located:
            # the letter may lie past the letters read: a copy sent now would run the message and leave
            # its letter where no listing shows it, to run again at a later retry (found in review)
            if run.came_round:
                raise InvalidOperation(
                    f"its dead letter was not among the {run.seen} letters of the dead-letter queue read "
                    "before the scan took longer than it may hold them (they came back, and the letters "
                    "after them were not read): nothing was sent; retry it again, or retry or purge "
                    "older dead letters first"
                )
            raise InvalidOperation(
                f"its dead letter was not among the first {run.seen} letters of the dead-letter queue "
                f"(a scan reads at most {limit}): nothing was sent; retry or purge older dead letters "
                "first, then retry it again"
            )
        if before_removing is not None:
            # the letters passed over need not wait for the copy; the located ones stay held (and
            # are handed back with the rest if the read fails before this: see ``finally``)
            located, run.located = run.located, []
            passed, run.held = run.held, located
            with contextlib.suppress(Exception):
                await pages.hand_back(passed)
            await before_removing()
            lapsed: list[T] = []
            failure: Exception | None = None
            for item in located:
                try:
                    await pages.remove(item)
                    run.removed += 1
                except Exception as exc:
                    lapsed.append(item)
                    failure = failure or exc
            run.held = lapsed
            if lapsed:
                if not getattr(pages, "keys_outlive_holds", False):
                    assert failure is not None
                    raise failure
                run.held = []  # their holds are gone: nothing of theirs to hand back
                run.removed += await _remove_again(pages, {pages.key(item) for item in lapsed}, limit)
        if run.complete and how == "remove" and wanted is not None:
            try:
                total = await pages.total()
            except Exception as exc:  # (the letters found are removed: only the answer is lost)
                log.warning("could not count the dead-letter queue after a scan: %s", exc)
                total = None
            if total is not None and total <= run.seen - run.removed:  # no letter was out of sight
                run.found |= wanted
    finally:
        with contextlib.suppress(Exception):
            await pages.hand_back(run.held + run.located)
    return run.found


def started_again(env: Envelope, expiration: timedelta | None, since: datetime) -> Envelope:
    """``env``, one of the kit's dead letters an operator moved back to its live queue with the
    transport's own tools (AWS's DLQ redrive, RabbitMQ's "Move messages" or a shovel), started again as
    the kit's own retry sends one: no attempts used, its type's ``expiration`` from ``since``, and
    without the marks of its dead-lettering. Kept as it came, it carried the attempts its message had
    used (all of them): its first delivery was past its last attempt, and it was dead-lettered again
    unrun."""
    kept = {k: v for k, v in env.headers.items() if k not in (REASON, DESCRIPTION, DEAD_AT)}
    try:
        expires_at = since + expiration if expiration is not None else None
    except OverflowError:  # (past the year 9999: as good as none)
        expires_at = None
    return env.with_attempt(0, headers=kept, expires_at=expires_at)


async def empty_dead_letters(pages: DeadLetterPages[T], limit: int) -> set[str] | None:
    """Remove every dead letter a scan meets, at most ``limit`` (those there when the purge began: one
    that arrives meanwhile may stay, history and all). None when the queue's count then says no letter
    is left, none held by another reader either: every dead letter's history may go, also that of
    letters an earlier purge removed before it failed. Otherwise the ids of the letters removed, so
    only their history goes (a letter another reader held stays, and so does its history)."""
    found = await scan_dead_letters(pages, None, limit=limit)
    try:
        left = await pages.total()
    except Exception as exc:  # (the letters found are removed: only the answer is lost)
        log.warning("could not count the dead-letter queue after a purge: %s", exc)
        left = None
    return None if left == 0 else found


async def _remove_again(pages: DeadLetterPages[T], keys: set[Hashable], limit: int) -> int:
    """Remove the letters with these keys, located earlier, whose hold lapsed before they could be
    removed (a peek-lock shorter than the scan's last wait and the copy's send). Only a transport
    whose key stays with its letter for good (a sequence number, a queue message id: not a delivery
    tag, which each channel numbers afresh) says so with ``keys_outlive_holds``; the copy's own
    new letter has a key of its own, so it stays. Letters not met again (another reader holds them)
    stay too, as duplicates."""
    again: LetterPass[T] = LetterPass()
    try:
        await read_letters(
            pages,
            lambda item: pages.key(item) in keys,
            "remove",
            again,
            limit,
            lambda: again.removed >= len(keys),
        )
    finally:
        with contextlib.suppress(Exception):
            await pages.hand_back(again.held)
    if again.removed < len(keys):
        log.warning(
            "%d dead letter(s) of a retried message were not met again and stay as duplicates",
            len(keys) - again.removed,
        )
    return again.removed


class DeadLetterOps:
    """The ops side of a transport with a dead-letter queue and a separate history. A transport
    supplies :meth:`_dead_letter_pages`; reading and removing are :func:`scan_dead_letters`'s."""

    def _dead_letter_pages(self, queue: str) -> AbstractAsyncContextManager[DeadLetterPages[Any]]:
        """``queue``'s dead-letter queue, read page by page (its transport's errors translated)."""
        raise NotImplementedError

    async def _dead_letters(
        self,
        queue: str,
        wanted: set[str] | None,
        *,
        remove: bool = True,
        before_removing: Callable[[], Awaitable[None]] | None = None,
    ) -> set[str]:
        """Remove (or only find) the dead letters of ``queue`` with these message ids (None: all);
        returns the ids found. ``before_removing``: see :func:`scan_dead_letters`."""
        async with self._dead_letter_pages(queue) as pages:
            return await scan_dead_letters(pages, wanted, remove=remove, before_removing=before_removing)

    async def ops_held(self, record: MessageRecord) -> str | None:
        """DeadLettered while the dead-letter queue still holds the message whatever its history says
        (an operator's retry stopped part-way), so a retry can finish the job."""
        found = await self._dead_letters(record.queue, {str(record.message_id)}, remove=False)
        return MessageStatus.DEAD_LETTERED.value if found else None
