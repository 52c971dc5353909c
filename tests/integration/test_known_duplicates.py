"""Where a transport cannot avoid a duplicate, it is recognised: a Service Bus original that comes back
after its copy was sent (completing it failed) is completed without running the handler, and the
duplicate shows in its history."""

from __future__ import annotations

from datetime import timedelta

from azure.servicebus.exceptions import MessageLockLostError

from queueing_core import MessageStatus, QueueingApp, QueueMessage, RetryPolicy, queue
from queueing_core.fakes.servicebus import FakeServiceBusNamespace
from queueing_core.testing import in_memory_servicebus
from tests.contract.harness import record, running, wait_until


@queue(
    "dup/copies",
    max_attempts=5,
    lease_duration=timedelta(seconds=30),
    retry=RetryPolicy(base=timedelta(milliseconds=200), jitter=0),
)
class Charge(QueueMessage):
    n: int


async def test_an_original_back_after_its_copy_was_sent_is_completed_without_running():
    app = QueueingApp("dup")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Charge, ctx) -> None:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            raise ConnectionError("gateway down")

    ns = FakeServiceBusNamespace()
    rt = in_memory_servicebus(app, ns, provider_options={"receive_wait": 0.1})
    await rt.open()
    receiver = rt.provider._receiver("dup/copies")
    real_complete = receiver.complete_message
    failed: list[int] = []

    async def complete_fails_once(m):
        # the first retry's copy is out; then the lock is lost and the original is back in the queue
        if not failed:
            failed.append(m.sequence_number)
            await receiver.abandon_message(m)
            raise MessageLockLostError(message="The lock on the message lock has expired.")
        return await real_complete(m)

    receiver.complete_message = complete_fails_once
    receipt = await app.enqueue(Charge(n=1))
    async with running(rt):

        async def done() -> bool:
            rec = await record(rt, receipt.message_id)
            return rec.status == MessageStatus.SUCCEEDED and bool(rec.duplicates)

        await wait_until(done, timeout=30)
        await wait_until(lambda: not ns._queue(rt.provider.physical("dup/copies")).active, timeout=30)
    assert failed, "the fault was injected"
    rec = await record(rt, receipt.message_id)
    # attempt 1 failed and sent its copy; the copy's run succeeded; the returning original did not run
    assert runs == [1, 2]
    assert rec.duplicates == 1
    assert rec.copied_from == str(failed[0])
    await rt.close()
