"""In-process provider: a queue per type inside this process, for tests and single instances.

Failures are retried with the same pipeline as every other transport, and dead letters are kept
(``provider.dead_letters``) instead of dropped. Nothing survives a restart; use the SQL provider for
durability.

Ordered queues (``@queue(ordered=True)``) process one message at a time, and a message that is
retried or deferred stays at the head: later messages wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..clock import utcnow
from ..decisions import Complete, DeadLetter, Expire, Release, due_at
from ..envelope import Envelope
from ..naming import Transport
from ..tracking.base import nothing_to_reopen
from ..transport import Capabilities, Delivery, Settlement

if TYPE_CHECKING:
    from ..app import QueueingApp, Subscription
    from ..tracking import MessageQuery, MessageRecord, Reopen

_seq = itertools.count()


def _message_id(raw: bytes) -> Any:
    try:
        return Envelope.decode(raw).message_id
    except Exception:
        return None


@dataclass(order=True, slots=True)
class _Item:
    due: datetime
    seq: int
    raw: bytes = field(compare=False)


@dataclass(slots=True)
class _Queue:
    ordered: bool = False
    ready: deque[_Item] = field(default_factory=deque)
    scheduled: list[_Item] = field(default_factory=list)  # a heap by (due, seq)
    head: _Item | None = None  # ordered mode: a retried/deferred message blocks the queue until due
    in_flight: int = 0
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: _Item, now: datetime) -> None:
        if item.due <= now:
            self.ready.append(item)
        else:
            heapq.heappush(self.scheduled, item)
        self.wakeup.set()

    def take(self, now: datetime, limit: int) -> list[_Item]:
        if self.head is not None:
            if self.head.due > now:
                return []
            self.ready.appendleft(self.head)
            self.head = None
        while self.scheduled and self.scheduled[0].due <= now:
            self.ready.append(heapq.heappop(self.scheduled))
        if self.ordered:
            # strict enqueue order among the messages that are due
            self.ready = deque(sorted(self.ready, key=lambda i: i.seq))
            limit = min(limit, 1 - self.in_flight)
        out: list[_Item] = []
        while self.ready and len(out) < limit:
            out.append(self.ready.popleft())
        return out

    def next_due(self) -> datetime | None:
        candidates = [i.due for i in (self.head,) if i is not None]
        if self.scheduled:
            candidates.append(self.scheduled[0].due)
        return min(candidates) if candidates else None

    def __len__(self) -> int:
        return len(self.ready) + len(self.scheduled) + (1 if self.head else 0)


class InProcessProvider:
    transport = Transport.INPROCESS
    capabilities = Capabilities(max_delay=None, push_wakeups=True)

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}
        self._ordered: set[str] = set()
        #: dead-lettered messages per queue, as settlements (the delivery keeps the raw body)
        self.dead_letters: dict[str, list[Settlement]] = {}

    def _q(self, name: str) -> _Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(ordered=name in self._ordered)
        return q

    async def open(self, app: QueueingApp) -> None:
        for sub in app.subscriptions():
            if sub.options.ordered:
                self._ordered.add(sub.queue)
                self._q(sub.queue).ordered = True

    async def close(self) -> None:
        return None

    async def send(self, envelopes: Sequence[Envelope], *, wait: bool = False) -> None:
        now = utcnow()
        for env in envelopes:
            self._q(env.queue).put(_Item(env.not_before or now, next(_seq), env.encode()), now)

    async def receive(self, sub: Subscription, max_messages: int) -> list[Delivery]:
        q = self._q(sub.queue)
        items = q.take(utcnow(), max_messages)
        q.in_flight += len(items)
        return [Delivery.of(i.raw, queue=sub.queue, handle=i) for i in items]

    async def wait_for_work(self, sub: Subscription, timeout: float) -> None:
        q = self._q(sub.queue)
        nd = q.next_due()
        if nd is not None:
            timeout = max(0.0, min(timeout, (nd - utcnow()).total_seconds()))
        q.wakeup.clear()
        if q.ready and not q.ordered:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(q.wakeup.wait(), timeout)

    async def settle(self, settlements: Sequence[Settlement]) -> None:
        now = utcnow()
        for s in settlements:
            d, decision = s.delivery, s.decision
            q = self._q(d.queue)
            q.in_flight = max(0, q.in_flight - 1)
            if isinstance(decision, Complete | Expire):
                q.wakeup.set()
                continue
            if isinstance(decision, DeadLetter):
                self.dead_letters.setdefault(d.queue, []).append(s)
                q.wakeup.set()
                continue
            if d.envelope is None:  # malformed is always dead-lettered above; nothing to re-send
                continue
            used = d.attempts_used(decision)
            due = due_at(decision, now) or now
            env = d.copy_after(decision, used)
            item = _Item(due, d.handle.seq if isinstance(d.handle, _Item) else next(_seq), env.encode())
            if q.ordered:
                q.head = item
                q.wakeup.set()
            elif isinstance(decision, Release):
                q.ready.appendleft(item)
                q.wakeup.set()
            else:
                q.put(item, now)

    async def renew(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        return []  # nothing can take a message from this process

    # -- ops actions: history lives in the runtime's tracker; these move the messages -------------
    def _forget(self, message_ids: set[Any]) -> set[Any]:
        """Drop queued copies and dead letters of these messages; returns the ids of those dropped."""
        dropped: set[Any] = set()

        def keep(mid: Any) -> bool:
            if mid in message_ids:
                dropped.add(mid)
                return False
            return True

        for name, q in self._queues.items():
            q.ready = deque(i for i in q.ready if keep(_message_id(i.raw)))
            q.scheduled = [i for i in q.scheduled if keep(_message_id(i.raw))]
            heapq.heapify(q.scheduled)
            if q.head is not None and not keep(_message_id(q.head.raw)):
                q.head = None
            self.dead_letters[name] = [
                s
                for s in self.dead_letters.get(name, [])
                if not (s.delivery.envelope and not keep(s.delivery.envelope.message_id))
            ]
        return dropped

    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        async with reopen():
            pass  # (recorded before the copy can run; nothing here can fail)
        # in memory nothing fails between dropping the original and queueing the copy
        self._forget({record.message_id})
        await self.send([envelope])
        return True

    async def ops_held(self, record: MessageRecord) -> str | None:
        return None  # a retry here is never left half done (see ops_retry)

    async def ops_release(self, record: MessageRecord, now: datetime) -> bool:
        return False  # nothing outside this process holds a message: there is no lease to release

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool:
        return True  # archiving is a flag in the history; the message left the queue when it finished

    async def ops_remove(self, query: MessageQuery, records: Sequence[MessageRecord]) -> set[Any]:
        """Queued copies and dead letters of these messages go; returns every id given, none of
        which it holds now (a finished message's history goes with the rest)."""
        ids = {r.message_id for r in records}
        self._forget(ids)
        return ids

    # -- test and ops helpers ------------------------------------------------------------------
    def depth(self, queue: str) -> int:
        return len(self._q(queue))

    def in_flight(self, queue: str) -> int:
        return self._q(queue).in_flight

    def queues(self) -> dict[str, int]:
        return {name: len(q) for name, q in self._queues.items()}
