"""The app the dashboard's browser tests serve: a slow queue to watch counts move, and a payment step
that dead-letters while a "broken gateway" file exists (so a bulk retry can then succeed)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from queueing_core import NonRetryableError, QueueingApp, QueueMessage, queue


@queue("ui-orders", max_concurrency=1, example={"order_id": "ord-1", "amount_cents": 2599})
class ChargeCard(QueueMessage):
    order_id: str
    amount_cents: int


@queue("ui-reports", example={"name": "daily"})
class BuildReport(QueueMessage):
    name: str


app = QueueingApp("ui-tests")


def _broken() -> bool:
    flag = os.environ.get("UI_TEST_BROKEN_FILE")
    return flag is not None and Path(flag).exists()


@app.handler()
async def charge(msg: ChargeCard) -> dict[str, str]:
    await asyncio.sleep(float(os.environ.get("UI_TEST_SECONDS", "0.1")))
    if _broken():
        raise NonRetryableError(f"payment gateway refused order {msg.order_id}")
    return {"charged": msg.order_id}


@app.handler()
async def report(msg: BuildReport) -> None:
    await asyncio.sleep(0.05)
