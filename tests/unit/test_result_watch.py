"""``result`` stops watching exactly the message it watched, even when a later look at the tracking id
finds another message (a retry by copy shares its tracking id)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

import pytest

from queueing_core import jobs
from queueing_core.messages import MessageStatus
from queueing_core.tracking import MessageRecord


class Watching:
    def __init__(self) -> None:
        self.watched: list[UUID] = []
        self.unwatched: list[UUID] = []

    async def watch_result(self, message_id: UUID, wake: asyncio.Event) -> bool:
        self.watched.append(message_id)
        return True

    def unwatch_result(self, message_id: UUID, wake: asyncio.Event) -> None:
        self.unwatched.append(message_id)


def record(mid: UUID, tid: UUID, status: MessageStatus) -> MessageRecord:
    now = datetime.now(UTC)
    return MessageRecord(
        message_id=mid,
        tracking_id=tid,
        type="T",
        queue="q",
        status=status.value,
        created_at=now,
        updated_at=now,
        result={"ok": True} if status is MessageStatus.SUCCEEDED else None,
    )


async def test_result_unwatches_the_id_it_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    tid, first, copy = uuid4(), uuid4(), uuid4()
    looks = iter([record(first, tid, MessageStatus.PENDING), record(copy, tid, MessageStatus.SUCCEEDED)])

    async def find(runtime: Any, tracking_id: UUID) -> MessageRecord:
        return next(looks)

    monkeypatch.setattr(jobs, "find", find)
    provider = Watching()
    runtime: Any = type("R", (), {"provider": provider})()
    assert await jobs.result(runtime, tid, timeout=30) == {"ok": True}
    assert provider.watched == [first]
    assert provider.unwatched == [first]
