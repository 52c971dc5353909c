"""A dead letter on SQS must be one SQS takes, or its message runs again on every attempt and ends
with the wrong reason (found in review): a letter fits where its message did (its description gives
way), and its texts hold only what SQS takes.

Against moto's server, with two of SQS's rules moto does not apply stated here from AWS's
documentation: a queue created before SQS raised its limit to 1 MiB takes 262,144 bytes (made so
here; moto enforces a queue's ``MaximumMessageSize``), and SQS refuses a body or a String attribute
holding a character outside #x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF
(``InvalidMessageContents``; moto takes them, so the client below refuses them as SQS does)."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, QueueNaming, queue
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sqs import DESCRIPTION, MAX_ENVELOPE_BYTES, REASON, SqsProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, running, wait_until
from tests.contract.harness_sqs import sqs_client
from tests.services import fresh_prefix

_REFUSED = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


class RefusingWhatSqsRefuses:
    """moto's client, answering an entry that holds a character SQS refuses as SQS's batch does."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def send_message_batch(self, *, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:
        taken, failed = [], []
        for e in Entries:
            texts = [e["MessageBody"], *(v["StringValue"] for v in e.get("MessageAttributes", {}).values())]
            if any(_REFUSED.search(t) for t in texts):
                self.refused += 1
                failed.append(
                    {
                        "Id": e["Id"],
                        "SenderFault": True,
                        "Code": "InvalidMessageContents",
                        "Message": "invalid",
                    }
                )
            else:
                taken.append(e)
        answer = self._client.send_message_batch(QueueUrl=QueueUrl, Entries=taken) if taken else {}
        return {"Successful": answer.get("Successful", []), "Failed": [*answer.get("Failed", []), *failed]}


@queue("Fits.Tool", max_attempts=3, lease_duration=timedelta(seconds=2))
class Tool(QueueMessage):
    blob: str = ""


async def _dead_lettered_once(
    tmp_path: Any, client: Any, error: str, blob: int, small_dlq: bool
) -> dict[str, Any]:
    """Run one ``Tool`` message whose handler refuses it with ``error``; returns its dead letter."""
    app = QueueingApp("sqsfit", naming=QueueNaming(prefix=fresh_prefix()))
    runs: list[int] = []

    @app.handler(Tool, max_concurrency=1)
    async def handle(msg: Tool, ctx: Any) -> None:
        runs.append(ctx.attempt)
        raise NonRetryableError(error)

    provider = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    dlq = provider.dead_letter_name(app.naming.physical("Fits.Tool", provider.transport))
    if small_dlq:
        sqs_client().create_queue(QueueName=dlq, Attributes={"MaximumMessageSize": "262144"})
    await rt.open()
    try:
        overhead = len(rt.producer.envelope_for(Tool()).encode())
        r = await app.enqueue(Tool(blob="x" * max(0, blob - overhead)))
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [r.message_id], MessageStatus.DEAD_LETTERED), what="dead letter"
            )
        rec = await rt.tracker.get(r.message_id)
        assert rec is not None
        assert rec.reason == "non-retryable", rec
        assert runs == [1]
        [letter] = sqs_client().receive_message(
            QueueUrl=await provider._url("Fits.Tool", dead=True),
            MaxNumberOfMessages=10,
            MessageAttributeNames=["All"],
        )["Messages"]
        return letter
    finally:
        await rt.close()


async def test_the_dead_letter_of_a_message_at_the_size_limit_fits_its_queue(tmp_path: Any) -> None:
    # a refusal that quotes its input: each quote is two characters once JSON-escaped in the letter
    letter = await _dead_lettered_once(
        tmp_path, sqs_client(), "rejected: " + '"' * 3500, MAX_ENVELOPE_BYTES - 200, small_dlq=True
    )
    assert letter["MessageAttributes"][REASON]["StringValue"] == "non-retryable"
    assert letter["MessageAttributes"][DESCRIPTION]["StringValue"].startswith("NonRetryableError: rejected: ")


async def test_a_dead_letter_whose_reason_holds_what_sqs_refuses_is_sent_with_it_replaced(
    tmp_path: Any,
) -> None:
    client = RefusingWhatSqsRefuses(sqs_client())
    letter = await _dead_lettered_once(
        tmp_path, client, "tool said: \x1b[31merror\x1b[0m \x07 \uffff", 0, small_dlq=False
    )
    assert client.refused == 0
    described = letter["MessageAttributes"][DESCRIPTION]["StringValue"]
    assert described.startswith("NonRetryableError: tool said: \ufffd[31merror\ufffd[0m \ufffd \ufffd\n")


@queue("Fits.Note", max_attempts=3, lease_duration=timedelta(seconds=2))
class Note(QueueMessage):
    text: str


async def test_a_body_holding_u_ffff_is_sent_and_dead_lettered_as_sqs_takes_it(tmp_path: Any) -> None:
    """JSON may hold U+FFFF raw in a string (pydantic writes it so), which SQS refuses: the kit's own
    enqueue of such text failed, and the dead letter of another producer's body that escaped it was
    refused on every try (found in review). The kit's bodies now escape it: the same JSON."""
    client = RefusingWhatSqsRefuses(sqs_client())
    app = QueueingApp("sqsfit", naming=QueueNaming(prefix=fresh_prefix()))
    seen: list[str] = []

    @app.handler(Note, max_concurrency=1)
    async def handle(msg: Note) -> None:
        seen.append(msg.text)
        if msg.text.startswith("refuse"):
            raise NonRetryableError("refused")

    provider = SqsProvider(client, stores=SideStores(f"sqlite:///{tmp_path}/side.db"), receive_wait=0)
    rt = Runtime(app, provider)
    await rt.open()
    try:
        ours = await app.enqueue(Note(text="ok \ufffe\uffff"))
        theirs = rt.producer.envelope_for(Note(text="refuse \uffff"))
        escaped = json.dumps(json.loads(theirs.encode_text()))  # another producer's (ensure_ascii)
        sqs_client().send_message(QueueUrl=await provider._url("Fits.Note"), MessageBody=escaped)
        async with running(rt):
            await wait_until(
                lambda: all_have(rt, [ours.message_id], MessageStatus.SUCCEEDED), what="ours ran"
            )
            dead = MessageStatus.DEAD_LETTERED
            await wait_until(lambda: all_have(rt, [theirs.message_id], dead), what="theirs dead-lettered")
        assert client.refused == 0
        assert sorted(seen) == ["ok \ufffe\uffff", "refuse \uffff"]  # each once, the text whole
        [letter] = sqs_client().receive_message(QueueUrl=await provider._url("Fits.Note", dead=True))[
            "Messages"
        ]
        assert json.loads(letter["Body"])["body"]["text"] == "refuse \uffff"
    finally:
        await rt.close()
