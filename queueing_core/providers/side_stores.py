"""What the brokers without their own history share (RabbitMQ, SQS): pause/circuit state, message
history and the delayed-message store in the SQL database of ``SideStores``, the dispatcher that
forwards due messages, and the ops actions that work through those stores.

A provider mixes this in, calls ``_use_stores`` when it is built, and supplies the transport steps:
``_dead_letter_pages`` (its dead-letter queue, page by page), ``_send_now`` (publish an envelope at once) and
``_purge_whole`` (empty a queue and its dead-letter queue), each given the logical queue name, and
the dispatcher's two (``forward_delayed``, ``dead_letter_delayed``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..errors import InvalidOperation
from ..messages import MessageStatus
from ..tracking import MessageQuery, MessageRecord, Removed, Reopen, nothing_to_reopen
from ..tracking.base import is_cancel_request, reopening
from .dead_letters import DEAD_STATES, DeadLetterOps, is_whole_queue
from .names import PhysicalNames

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from ..app import QueueingApp
    from ..clock import Clock
    from ..control.base import ControlStore
    from ..envelope import Envelope
    from .delayed import DelayedDispatcher, DelayedMessage, SqlDelayedStore
    from .sql.history import SideStores, SqlHistoryTracker
    from .sql.schedules import SqlTickStore


@dataclass(frozen=True)
class WholeQueuePurge:
    """What the purge of a whole queue and its dead-letter queue can tell."""

    #: None where every dead letter went (every dead letter's history may go); otherwise the ids of
    #: the dead letters removed, where letters another reader holds may have stayed (see
    #: :func:`empty_dead_letters`)
    dead: set[str] | None
    #: how many messages the transport's purge took off the live queue, where it says (AMQP's purge-ok
    #: carries a count, never which messages)
    purged: int | None = None
    #: after the purge the live queue had nothing waiting and no consumer, or its purge takes what a
    #: consumer holds too (SQS's). Otherwise a worker may hold deliveries it has not acked (running,
    #: or prefetched for its free slots), which AMQP's purge leaves, and which run
    live_all_gone: bool = True


#: states whose message waits in the delayed store (or in the broker's own delay)
LATER_STATES = (MessageStatus.FAILED.value, MessageStatus.SLEEPING.value)
#: states of a message that has left its transport (the purge deletes their history alone)
FINISHED = (MessageStatus.SUCCEEDED.value, MessageStatus.CANCELLED.value)
#: every state whose message may wait as a row of the delayed store: a delayed enqueue, a retry, a
#: wait asked for by its handler, a paused type's or a missing handler's recheck
STORED_STATES = (
    MessageStatus.PENDING.value,
    *LATER_STATES,
    MessageStatus.PAUSED.value,
    MessageStatus.WAITING_FOR_HANDLER.value,
)


class SideStoreOps(DeadLetterOps, PhysicalNames):
    stores: SideStores
    delayed: SqlDelayedStore
    dispatcher: DelayedDispatcher
    clock: Clock
    #: what a retry says about a delayed message that has already left the delayed store
    left_store_text = "it has already left the delayed store for its queue and runs shortly"
    #: history pruning needs no hurry
    maintenance_interval = 300.0

    def _use_stores(
        self, stores: SideStores, retries: int, clock: Clock, dispatcher_options: dict[str, Any] | None
    ) -> None:
        from .delayed import DelayedDispatcher

        self.stores = stores
        self.clock = clock
        self.delayed = stores.delayed_store(self.transport)
        self.dispatcher = DelayedDispatcher(
            self.delayed, self, retries=retries, clock=clock, **(dispatcher_options or {})
        )

    # -- the transport steps -------------------------------------------------------------------------
    async def _send_now(self, queue: str, envelope: Envelope) -> None:
        raise NotImplementedError

    async def _purge_whole(self, queue: str) -> WholeQueuePurge:
        """Empty ``queue`` and its dead-letter queue; what the transport can say of it (see
        :class:`WholeQueuePurge`)."""
        raise NotImplementedError

    async def forward_delayed(self, item: DelayedMessage) -> None:
        """Send a due message from the delayed store to its queue (the dispatcher calls this)."""
        raise NotImplementedError

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        """Dead-letter a delayed message the dispatcher could not forward."""
        raise NotImplementedError

    # -- wiring --------------------------------------------------------------------------------------
    def control_store(self) -> ControlStore:
        return self.stores.control

    def tracker(self) -> SqlHistoryTracker:
        return self.stores.history

    def schedule_store(self) -> SqlTickStore:
        """Schedule ticks in the side database: claimed, sent, then confirmed."""
        from .sql.schedules import SqlTickStore

        return SqlTickStore(self.stores.sql, transactional=False)

    def background_tasks(self) -> list[Any]:
        return [self.dispatcher.run]

    async def dispatch_due(self, budget_seconds: float) -> int:
        """Forward the due delayed messages within ``budget_seconds`` (for a Functions timer)."""
        return await self.dispatcher.dispatch_due(budget_seconds)

    async def maintain(self, app: QueueingApp | None = None) -> dict[str, int]:
        kept = self.capabilities.dead_letters_kept  # type: ignore[attr-defined]
        return {"history_pruned": await self.stores.history.prune(self.clock(), kept)}

    # -- ops -----------------------------------------------------------------------------------------
    async def ops_retry(
        self, record: MessageRecord, envelope: Envelope, now: datetime, reopen: Reopen = nothing_to_reopen
    ) -> bool:
        # the copy is sent before the original leaves: a failure in between leaves two, never none.
        # The original is found *before* the copy is sent and only what was found is removed after:
        # the copy may run, fail and be stored (or dead-lettered) again under the same message id in
        # between, and removing by id then would take the copy's own new place too.
        async def send() -> None:
            async with reopen():
                await self._send_now(record.queue, envelope)

        if record.status in LATER_STATES:
            rows = await self.delayed.copies(record.message_id)
            if not rows:
                raise InvalidOperation(
                    f"message {record.message_id} cannot be brought forward: {self.left_store_text}"
                )

            # made the copy sent here first (its envelope, due once the store's lease has passed, a
            # claim counted), and the history reopened in the same transaction (the history lives in
            # that database): a retry that stops after this leaves the rows to come back when the lease
            # ends, not when their delay was due, as the copy the history now describes, and their
            # forward then is a known repeat. Only while the history is as this retry read it: one
            # beside it that held the rows and sent its copy meanwhile has changed it, and a second
            # copy would run the message twice (the hold is undone with the refusal).
            async def reopen_with_them(conn: AsyncConnection) -> None:
                changes = reopening(now, envelope.expires_at)
                if not await self.stores.history.change_if_unchanged_on(conn, record, changes):
                    raise InvalidOperation(
                        f"message {record.message_id} changed while retrying it; look again"
                    )

            if not await self.delayed.hold(rows, envelope, then=reopen_with_them):
                raise InvalidOperation(
                    f"message {record.message_id} cannot be brought forward: its waiting copy left the "
                    "delayed store as the retry began (forwarded to its queue, where it runs shortly, "
                    "or purged)"
                )
            await self._send_now(record.queue, envelope)
            await self.delayed.take_message(record.message_id, rows=rows)
        elif record.status in DEAD_STATES:
            await self._dead_letters(record.queue, {str(record.message_id)}, before_removing=send)
        else:
            await send()
        return True

    async def ops_archive(self, record: MessageRecord, now: datetime) -> bool:
        return True  # a flag in the history; the message itself has left the queue

    async def ops_remove(self, query: MessageQuery, records: Sequence[MessageRecord]) -> set[uuid.UUID]:
        """Dead letters leave the dead-letter queue, delayed ones the delayed store; a purge of a whole
        queue empties the queue, its dead-letter queue and its delayed messages. A message waiting in a
        live queue cannot be picked out one by one (neither AMQP nor SQS deletes by id). Returns the
        ids of the messages removed: only their history goes (a delayed message's already went with
        its row, counted in ``forgotten``)."""
        if is_whole_queue(query):
            assert query.queue is not None
            # the delayed store first: a forward due meanwhile lands in the queue before its purge; the
            # history of what waited there goes with it while it still says so (as below)
            taken, forgotten, stays = await self.delayed.purge(
                self.physical(query.queue), history_while=STORED_STATES
            )
            # (a delayed message's history went with its row, counted in ``forgotten``: not returned,
            # as below, or the purge would count it twice; one stored there as the purge ran, a worker's
            # deferral of a message it had received, stays: left, with its history)
            rest = [
                r
                for r in records
                if not (r.message_id in taken and r.status in STORED_STATES) and r.message_id not in stays
            ]
            purge = await self._purge_whole(query.queue)
            dead = purge.dead
            held = 0
            if not purge.live_all_gone and purge.purged is not None:
                # a worker had received some: the transport says how many it took, never which, so
                # the history of all goes (theirs comes back as they run) and the rest count as left.
                # (A cancel request's message still waits in the queue, and is in the broker's count)
                live = [
                    r
                    for r in rest
                    if r.status not in DEAD_STATES and (r.status not in FINISHED or is_cancel_request(r))
                ]
                held = max(0, len(live) - purge.purged)
            return Removed(
                (
                    r.message_id
                    for r in rest
                    if dead is None or r.status not in DEAD_STATES or str(r.message_id) in dead
                ),
                forgotten,
                held,
            )
        removed: set[uuid.UUID] = set()
        forgotten = 0
        for queue in {r.queue for r in records}:
            recs = [r for r in records if r.queue == queue]
            dead = {str(r.message_id) for r in recs if r.status in DEAD_STATES}
            if dead:
                removed |= {uuid.UUID(i) for i in await self._dead_letters(queue, dead)}
            # any state whose message may wait as a row of the delayed store (a retry, a wait, a delayed
            # enqueue, a paused type's or a missing handler's recheck): the rows of the ids that have
            # one leave it; a message of the same state waiting in its live queue has none, and is left
            for status in sorted({r.status for r in recs if r.status in STORED_STATES}):
                later = [r.message_id for r in recs if r.status == status]
                # their history goes with them, in one transaction, while it still says what this purge
                # read (a purge that stopped in between would leave a record no later purge could
                # match); so they are not among the ids returned, whose history the purge deletes after:
                # one that no longer says so (an operator's retry sent its copy meanwhile, a Failed one
                # reopened as Pending) keeps its row and its history
                purged = await self.delayed.purge(self.physical(queue), later, history_while=(status,))
                forgotten += purged.forgotten
        return Removed((r.message_id for r in records if r.message_id in removed), forgotten)
