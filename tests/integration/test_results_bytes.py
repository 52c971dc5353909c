"""A result that is bytes but not UTF-8 (``b"\\xff"``: a hash digest, an image a handler returns)
made ``fit_result`` raise (pydantic's JSON mode raises UnicodeDecodeError), in the ``else:`` of the
handler's try, outside every ``except``: the work was done, but the message was not settled, and it ran
again and again (found by a review). A result that cannot be dumped is now kept cleaned, or as its
repr."""

from __future__ import annotations

import asyncio

from queueing_core import QueueMessage, queue
from queueing_core.pipeline import fit_result
from tests.contract.harness import HARNESSES, running


@queue("review-r3-bytes", max_attempts=2)
class Digest(QueueMessage):
    key: str


def test_fit_result_keeps_a_binary_result():
    fit_result(b"\xff\x00digest")  # raises UnicodeDecodeError


async def test_a_handler_returning_binary_bytes_succeeds_once():
    h = HARNESSES["inprocess"]()
    app = h.app()
    runs: list[str] = []

    @app.handler()
    async def handle(msg: Digest, ctx):
        runs.append(msg.key)
        return b"\xff\xfe"

    rt = await h.runtime(app)
    sent = await app.enqueue(Digest(key="k"))
    async with running(rt):
        await asyncio.sleep(2.0)
        final = await app.status(sent.tracking_id)
    assert (final.status, runs) == ("Succeeded", ["k"]), (final.status, final.description, runs)
