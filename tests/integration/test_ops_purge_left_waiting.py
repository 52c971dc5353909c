"""A purge says how many matching messages it had to leave: a message waiting in a live queue cannot be
taken out by id on a broker (AMQP and SQS delete by receipt, not by message id), and the purge answered
``deleted 0`` with nothing else, and the dashboard "Deleted 0 message(s)" after confirming three; the
three then ran (found in review)."""

from __future__ import annotations

from queueing_core import MessageStatus, QueueMessage, queue
from tests.contract.harness import ops_client, running, wait_until


@queue("purge_left")
class Note(QueueMessage):
    n: int


async def test_a_purge_counts_the_waiting_messages_it_could_not_remove(harness):
    app = harness.app()
    ran: list[int] = []

    @app.handler()
    async def handle(msg: Note) -> None:
        ran.append(msg.n)

    rt = await harness.runtime(app)
    sent = [await app.enqueue(Note(n=n)) for n in range(3)]  # no worker yet: they wait in the queue
    async with ops_client(rt) as client:
        res = await client.delete("/messages", params={"queue": "purge_left", "status": "Pending"})
        assert res.status_code == 200, res.text
        result = res.json()
    if harness.name in ("sqlite", "postgres", "inprocess"):
        assert (result["deleted"], result["left_waiting"]) == (3, 0), result
        return
    assert (result["deleted"], result["left_waiting"]) == (0, 3), result
    async with running(rt):  # what the answer said: they stay, and run
        await wait_until(lambda: _all_succeeded(rt, [s.message_id for s in sent]), what="the three runs")
    assert sorted(ran) == [0, 1, 2]


async def _all_succeeded(rt, ids) -> bool:
    for message_id in ids:
        rec = await rt.tracker.get(message_id)
        if rec is None or rec.status != MessageStatus.SUCCEEDED:
            return False
    return True


async def test_a_purge_of_finished_messages_deletes_their_history_and_leaves_nothing(harness):
    """A message that succeeded is nowhere on the transport: its history is all there is of it. Off SQL
    a purge by status took only what the transport removed, so a purge of succeeded messages deleted
    nothing, and said it left them waiting (found in review)."""
    app = harness.app()

    @app.handler()
    async def handle(msg: Note) -> None:
        return None

    rt = await harness.runtime(app)
    sent = [await app.enqueue(Note(n=n)) for n in range(3)]
    async with running(rt):
        await wait_until(lambda: _all_succeeded(rt, [s.message_id for s in sent]), what="the three runs")
    async with ops_client(rt) as client:
        res = await client.delete("/messages", params={"queue": "purge_left", "status": "Succeeded"})
        assert res.status_code == 200, res.text
        assert (res.json()["deleted"], res.json()["left_waiting"]) == (3, 0), res.json()
    assert [await rt.tracker.get(s.message_id) for s in sent] == [None, None, None]
