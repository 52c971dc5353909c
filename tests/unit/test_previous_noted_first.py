"""An idempotent message's success is noted for its identity before its history says Succeeded.

The next version's ``ctx.previous`` comes from that note: one who saw the success recorded and sent
the next version at once got ``ctx.previous`` None while the note was still on its way (seen in CI,
on RabbitMQ under load)."""

from __future__ import annotations

from typing import Any

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.testing import in_process, run_until_idle


@queue("noted-prices", idempotent=True, identity="sku")
class Price(QueueMessage):
    sku: str
    price: int


async def test_the_identity_knows_the_success_before_the_history_shows_it() -> None:
    app = QueueingApp("noted-first")
    seen: list[int | None] = []

    @app.handler()
    async def handle(msg: Price, ctx: Any) -> None:
        seen.append(ctx.previous.price if ctx.previous is not None else None)

    rt = in_process(app)
    await rt.open()
    try:
        write = rt.history.write
        noted_when_written: list[list[str]] = []

        async def written(records: Any, rows: Any = None) -> bool:
            # what the identity said as the history was about to say Succeeded
            assert rt.identities is not None
            found = await rt.identities.store.identity_doc("Price", "A")
            noted_when_written.append(list(found[0].get("succeeded") or []) if found else [])
            return await write(records, rows)

        rt.history.write = written  # type: ignore[method-assign]
        first = await app.enqueue(Price(sku="A", price=10))
        await run_until_idle(rt)
        assert noted_when_written[-1][:1] == [str(first.message_id)]
        await app.enqueue(Price(sku="A", price=12))
        await run_until_idle(rt)
        assert seen == [None, 10]
    finally:
        await rt.close()
