"""A transport's side of the delayed store whose forwards stay under way until the test lets them land."""

from __future__ import annotations

import asyncio
import uuid

from queueing_core.providers.delayed import DelayedMessage


class Slow:
    """The transport's side: a forward under way (its confirm on the way) until ``go`` is set."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.landed: list[uuid.UUID] = []

    async def forward_delayed(self, item: DelayedMessage) -> None:
        self.entered.set()
        await self.go.wait()
        self.landed.append(item.message_id)

    async def dead_letter_delayed(self, item: DelayedMessage, description: str) -> None:
        raise AssertionError("not dead-lettered here")
