"""``fit_result``'s last resort was ``repr(value)`` (found by a review), which raises for an object whose
``__repr__`` raises (an ORM object whose repr reads a lazy attribute after its session closed). The
work is done, but the message is not settled and runs again (as for the bytes result of r3)."""

from __future__ import annotations

import asyncio

from queueing_core import QueueMessage, queue
from queueing_core.pipeline import fit_result
from tests.contract.harness import HARNESSES, running


class Detached:
    def __repr__(self) -> str:
        raise RuntimeError("instance is not bound to a session")


@queue("review-r4-bad-repr", max_attempts=2)
class Load(QueueMessage):
    key: str


def test_fit_result_does_not_raise_on_a_bad_repr():
    fit_result({"row": Detached()})


async def test_a_handler_returning_an_object_with_a_bad_repr_succeeds_once():
    h = HARNESSES["inprocess"]()
    app = h.app()
    runs: list[str] = []

    @app.handler()
    async def handle(msg: Load, ctx):
        runs.append(msg.key)
        return Detached()

    rt = await h.runtime(app)
    sent = await app.enqueue(Load(key="k"))
    async with running(rt):
        await asyncio.sleep(2.0)
        final = await app.status(sent.tracking_id)
    assert (final.status, runs) == ("Succeeded", ["k"]), (final.status, final.description, runs)
