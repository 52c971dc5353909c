"""A waiting message's reason that names a long type fits the SQL store.

A reason names the type or queue it waits on ("type '...' is paused", "circuit for '...' is open"),
and a type name may be 256 characters. PostgreSQL's reason column holds 128: the settlement of such a
deferral was refused, the lease lapsed, and the sweeper counted an attempt the handler never ran
(each cooldown or pause once more, until the message was dead-lettered unrun). Reasons are now cut to
what every store keeps."""

from __future__ import annotations

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.runtime import Runtime

LONG = "Billing." + "VeryLongMessageTypeName" * 9  # 215 characters


@queue("long-reasons", type_name=LONG)
class LongNamed(QueueMessage):
    n: int


async def test_a_paused_type_with_a_long_name_is_deferred_without_an_attempt(sql_db) -> None:
    app = QueueingApp("long-reasons")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: LongNamed) -> None:
        runs.append(msg.n)

    rt = Runtime(app, sql_db.provider(), control_ttl=0)
    await rt.open()
    try:
        receipt = await app.enqueue(LongNamed(n=1))
        sub = app.subscription(LONG)
        assert sub is not None
        (claimed,) = await rt.provider.receive(sub, 10)
        # an operator's pause lands between the claim and the pipeline's look (as does a circuit
        # opening on another host)
        await rt.control.set_paused("type", LONG, True)
        await rt.process_and_settle(claimed)
        rec = await rt.tracker.get(receipt.message_id)
        assert rec is not None
        assert runs == []
        assert (rec.status, rec.attempt) == (MessageStatus.PAUSED.value, 0)
        assert rec.reason is not None
        assert rec.reason.startswith(f"type '{LONG[:40]}")
        assert len(rec.reason) <= 128
    finally:
        await rt.close()
