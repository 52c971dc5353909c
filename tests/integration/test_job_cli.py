"""`queueing cancel`, `queueing show` and `queueing set-status` against a real SQLite file."""

from __future__ import annotations

import asyncio
import uuid

from queueing_core.examples.orders import OrderLine, OrderPlaced, app
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

from .test_ops_cli import cli  # noqa: F401 - the fixture


def order(order_id: str) -> OrderPlaced:
    return OrderPlaced(
        order_id=order_id,
        customer_email="a@example.com",
        lines=[OrderLine(sku="S", quantity=1, unit_price_cents=100)],
        payment_token="tok",
    )


def enqueue(tmp_path, *ids: str) -> list:
    async def go() -> list:
        rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db"))
        async with rt:
            return await app.enqueue_many([order(i) for i in ids])

    return asyncio.run(go())


def test_cancel_show_and_refuse_a_finished_message(cli, tmp_path):  # noqa: F811
    a, b = enqueue(tmp_path, "A1", "B2")
    r = cli("cancel", str(b.tracking_id))
    assert r.returncode == 0, r.stderr
    assert "Cancelled" in r.stdout
    assert str(b.message_id) in r.stdout
    shown = cli("show", str(b.tracking_id))
    assert shown.returncode == 0, shown.stderr
    assert "status    Cancelled" in shown.stdout
    assert str(b.tracking_id) in shown.stdout
    again = cli("cancel", str(b.tracking_id))
    assert again.returncode == 1
    assert "already cancelled" in again.stderr
    missing = cli("cancel", str(uuid.uuid4()))
    assert missing.returncode == 1
    assert "no message" in missing.stderr
    assert "status    Pending" in cli("show", str(a.message_id)).stdout


def test_set_status_where_a_body_property_matches(cli, tmp_path):  # noqa: F811
    a, b = enqueue(tmp_path, "A1", "B2")
    r = cli("set-status", "order-placed", "--where", "order_id", "--value", "A1", "--to", "OnHold")
    assert r.returncode == 0, r.stderr
    assert "1 message on order-placed set to OnHold" in r.stdout
    assert "status    OnHold" in cli("show", str(a.tracking_id)).stdout
    assert "status    Pending" in cli("show", str(b.tracking_id)).stdout
    bad = cli("set-status", "order-placed", "--where", "order_id') OR 1=1 --", "--value", "x", "--to", "X")
    assert bad.returncode == 2
    assert "path" in bad.stderr
    kit = cli("set-status", "order-placed", "--where", "order_id", "--value", '"B2"', "--to", "Succeeded")
    assert kit.returncode == 1
    assert "the kit sets itself" in kit.stderr
