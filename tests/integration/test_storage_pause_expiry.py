"""Storage Queues: a queue paused past its messages' expiry lost them without a trace.

While a queue is paused the worker does not receive from it ("receiving would only hand the work
back"). The storage TTL was the envelope's expiry plus ``ttl_grace`` (1 h; a message expires after
4 h by default), so a pause longer than that let the service drop the messages unseen: no "Expired"
record, the history said Pending for ever. Messages now go without a storage TTL; the worker records
the expiry when it reads the message after the resume. Times shortened: a 2 s time to live."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta

from queueing_core import MessageStatus, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.storage_queue import StorageConnection, StorageQueueProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import running


@queue("review_paused_expiry")
class Ping(QueueMessage):
    n: int


async def test_a_message_expiring_in_a_paused_storage_queue_is_recorded_expired(azurite):
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("review-pause-expiry", naming=QueueNaming(prefix=f"t{tag}-"))
    ran: list[int] = []

    @app.handler()
    async def ping(msg: Ping) -> None:
        ran.append(msg.n)

    p = StorageQueueProvider(
        StorageConnection(azurite.connection_string),
        control_table=f"ctl{tag}",
        tracker_table=f"hist{tag}",
    )
    rt = Runtime(app, p, pause_recheck=timedelta(milliseconds=200), control_ttl=0.05)
    await rt.open()
    try:
        await rt.control.set_paused("queue", "review_paused_expiry", True)
        r = await app.enqueue(Ping(n=1), ttl=timedelta(seconds=2))
        # the service keeps it: no time-to-live of its own (it was the expiry plus an hour)
        [stored] = await p.client(p.physical("review_paused_expiry")).peek_messages()
        assert stored.expires_on is None or stored.expires_on.year == 9999, stored.expires_on
        async with running(rt):
            await asyncio.sleep(6)  # paused past its expiry: the worker does not receive
            await rt.control.set_paused("queue", "review_paused_expiry", False)
            await asyncio.sleep(3)  # resumed: anything still in the queue is received now

        rec = await rt.tracker.get(r.message_id)
        poison = p.client(p.poison_name("review_paused_expiry"))
        try:
            dead = (await poison.get_queue_properties()).approximate_message_count or 0
        except Exception:  # the poison queue was never created: nothing was dead-lettered
            dead = 0
        main = p.client(p.physical("review_paused_expiry"))
        left = (await main.get_queue_properties()).approximate_message_count or 0
        assert ran == []
        # read after the resume and recorded Expired (it was in neither queue, and its history Pending)
        assert rec is not None
        assert (rec.status, dead, left) == (MessageStatus.EXPIRED, 0, 0)
    finally:
        for q in (p.physical("review_paused_expiry"), p.poison_name("review_paused_expiry")):
            with contextlib.suppress(Exception):
                await p.client(q).delete_queue()
        await rt.close()
