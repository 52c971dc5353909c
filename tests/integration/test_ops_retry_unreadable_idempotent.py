"""An operator's retry of an idempotent type's dead letter whose body no longer reads as its model.

Before it is sent again, the retry of an idempotent message takes it out of its identity's superseded
versions, and so keys its body. A body that no longer validates (the model was made stricter since it
was dead-lettered, or it was dead-lettered for its body) or whose identity function raises made that
step raise: the API answered 500 and logged the body's values, and the dashboard's bulk retry stopped
at the first such message, newest first, so no older dead letter was ever tried. Such a body cannot be
keyed, so nothing can have superseded it: its copy is sent, and the worker dead-letters it again with
its reason. And one message's unexpected failure no longer stops a bulk retry.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from pydantic import field_validator

from queueing_core import MessageStatus, NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.ops.service import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from tests.contract.harness import all_have, ops_client, running, wait_until

#: the rules deployed after the messages were dead-lettered (set by each test through monkeypatch)
STRICT = {"on": False}
SECRET = "tok_secret_4242"


def _sku_key(msg: Any) -> str:
    if STRICT["on"] and msg.cents < 0:
        raise ValueError(f"cannot key {msg.card_token} at {msg.cents}")
    return str(msg.sku)


@queue("retry-unreadable-model", idempotent=True, identity="sku", max_attempts=1)
class Price(QueueMessage):
    sku: str
    cents: int
    card_token: str = SECRET

    @field_validator("cents")
    @classmethod
    def _not_negative(cls, v: int) -> int:
        if STRICT["on"] and v < 0:
            raise ValueError(f"a price cannot be negative: {v}")
        return v


@queue("retry-unreadable-identity", idempotent=True, identity=_sku_key, max_attempts=1)
class Keyed(QueueMessage):
    sku: str
    cents: int
    card_token: str = SECRET


async def _dead_lettered(rt: Runtime, app: QueueingApp, *messages: QueueMessage) -> list[Any]:
    ids = [(await app.enqueue(m)).message_id for m in messages]
    async with running(rt):
        await wait_until(lambda: all_have(rt, ids, MessageStatus.DEAD_LETTERED), what="dead letters")
    return ids


def _runtime(runs: list[str]) -> tuple[QueueingApp, Runtime]:
    app = QueueingApp("retry-unreadable")

    @app.handler()
    async def price(msg: Price) -> None:
        runs.append(msg.sku)
        raise NonRetryableError("gateway down")

    @app.handler()
    async def keyed(msg: Keyed) -> None:
        runs.append(msg.sku)
        raise NonRetryableError("gateway down")

    return app, Runtime(app, InProcessProvider(), control_ttl=0.05)


@pytest.mark.parametrize("mtype", [Price, Keyed], ids=["model-made-stricter", "identity-raises"])
async def test_a_retry_is_scheduled_and_the_worker_dead_letters_it_again_with_its_reason(
    mtype, monkeypatch, caplog
):
    runs: list[str] = []
    app, rt = _runtime(runs)
    await rt.open()
    try:
        [mid] = await _dead_lettered(rt, app, mtype(sku="B", cents=-54321))
        monkeypatch.setitem(STRICT, "on", True)  # the new rules are deployed
        caplog.set_level(logging.DEBUG)
        async with ops_client(rt) as client:
            res = await client.post(f"/messages/{mid}/retry")
        assert res.status_code == 200, res.text
        assert res.json()["status"] == "Pending"
        # what the retry logged (the worker's dead letter below states its reason, as it always has)
        logged = caplog.text
        assert "retried as it is" in logged
        assert SECRET not in logged, logged
        assert "-54321" not in logged, logged

        async def dead_again() -> bool:
            rec = await rt.tracker.get(mid)
            return rec is not None and rec.status == MessageStatus.DEAD_LETTERED

        async with running(rt):
            await wait_until(dead_again, what="the retried copy dead-lettered again")
        rec = await rt.tracker.get(mid)
        assert rec.reason == "invalid-body", rec  # with the reason the operator can act on
        assert runs == ["B"]  # the handler never saw the body it cannot read
    finally:
        await rt.close()


def _bulk_form(queue_name: str, step: str, confirmation: str | None = None) -> dict[str, str]:
    """The bulk retry's form; the run's carries what the confirmation states (count, selection)."""
    form = {"queue": queue_name, "status": "DeadLettered", "action": "retry", "step": step}
    if confirmation is None:
        return form
    carried = re.findall(r'name="(expected|selection)" value="([^"]*)"', confirmation)
    return {**form, **dict(carried)}


async def test_a_bulk_retry_goes_past_a_newest_dead_letter_that_no_longer_reads(monkeypatch):
    runs: list[str] = []
    app, rt = _runtime(runs)
    await rt.open()
    try:
        good, bad = await _dead_lettered(rt, app, Price(sku="A", cents=100), Price(sku="B", cents=-5))
        monkeypatch.setitem(STRICT, "on", True)
        async with ops_client(rt) as client:
            confirm = await client.post("/ui/bulk", data=_bulk_form("retry-unreadable-model", "confirm"))
            assert re.search(r"Retry <strong>2</strong>", confirm.text), confirm.text
            run = _bulk_form("retry-unreadable-model", "run", confirm.text)
            done = await client.post("/ui/bulk", data=run)
        assert done.status_code == 200, done.text
        assert "Retried 2 message(s)." in done.text, done.text
        assert (await rt.tracker.get(good)).status == MessageStatus.PENDING
        assert (await rt.tracker.get(bad)).status == MessageStatus.PENDING
    finally:
        await rt.close()


async def test_one_messages_unexpected_failure_does_not_stop_a_bulk_retry(monkeypatch, caplog):
    runs: list[str] = []
    app, rt = _runtime(runs)
    await rt.open()
    try:
        ids = await _dead_lettered(rt, app, Price(sku="A", cents=1), Price(sku="B", cents=2))
        real_retry = OpsService.retry
        failed: list[Any] = []

        async def retry(self: OpsService, message_id: Any) -> Any:
            if not failed:  # the first one tried (the newest) fails as no operator could foresee
                failed.append(message_id)
                raise RuntimeError(f"unforeseen, with {SECRET}")
            return await real_retry(self, message_id)

        monkeypatch.setattr(OpsService, "retry", retry)
        async with ops_client(rt) as client:
            confirm = await client.post("/ui/bulk", data=_bulk_form("retry-unreadable-model", "confirm"))
            run = _bulk_form("retry-unreadable-model", "run", confirm.text)
            done = await client.post("/ui/bulk", data=run)
        assert done.status_code == 200, done.text
        assert "Retried 1 message(s); 1 refused." in done.text, done.text
        assert f"message {failed[0]}: failed unexpectedly" in done.text
        assert SECRET not in done.text
        [older] = [i for i in ids if i != failed[0]]
        assert (await rt.tracker.get(older)).status == MessageStatus.PENDING
        assert (await rt.tracker.get(failed[0])).status == MessageStatus.DEAD_LETTERED
        assert "dashboard bulk retry of message" in caplog.text  # the details are in the log
    finally:
        await rt.close()
