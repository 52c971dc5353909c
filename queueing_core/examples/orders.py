"""A small shop's background work: the example app behind ``queueing serve``.

- ``OrderPlaced``    -> send the confirmation email, then enqueue the invoice and the payment capture
- ``GenerateInvoice`` -> slow (a plain ``def`` doing blocking work on a thread), returns the invoice
- ``CapturePayment``  -> talks to a flaky gateway: fails now and then (retried with backoff), a
                         declined card is not retryable (dead-lettered at once), and a circuit
                         breaker stops hammering the gateway when it is down

Behaviour knobs, for demos and tests: ``EXAMPLE_INVOICE_SECONDS`` (default 0.2) and
``EXAMPLE_PAYMENT_FAILURE_RATE`` (default 0.2).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import deque
from datetime import timedelta

from pydantic import BaseModel, Field

from queueing_core import (
    CircuitBreakerOptions,
    HandlerContext,
    NonRetryableError,
    QueueingApp,
    QueueMessage,
    RetryPolicy,
    queue,
)

log = logging.getLogger("queueing_core.examples.orders")


class ExampleKnobs:
    invoice_seconds = float(os.environ.get("EXAMPLE_INVOICE_SECONDS", "0.2"))
    payment_failure_rate = float(os.environ.get("EXAMPLE_PAYMENT_FAILURE_RATE", "0.2"))


knobs = ExampleKnobs()
#: the "email provider": the last 1,000 confirmations sent (a real app would call an API)
outbox: deque[dict[str, str]] = deque(maxlen=1000)


class OrderLine(BaseModel):
    sku: str = Field(min_length=1, max_length=64)
    quantity: int = Field(ge=1, le=10_000)
    unit_price_cents: int = Field(ge=0)


@queue(
    "order-placed",
    category="orders",
    example={
        "order_id": "ord-1001",
        "customer_email": "ada@example.com",
        "lines": [{"sku": "BOOK-42", "quantity": 1, "unit_price_cents": 2599}],
        "payment_token": "tok_visa",
    },
)
class OrderPlaced(QueueMessage):
    order_id: str = Field(min_length=1, max_length=64)
    customer_email: str = Field(pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$", max_length=254)
    lines: list[OrderLine] = Field(min_length=1, max_length=500)
    payment_token: str = Field(min_length=1, max_length=128)

    def total_cents(self) -> int:
        return sum(line.quantity * line.unit_price_cents for line in self.lines)


@queue(
    "generate-invoice",
    category="orders",
    time_limit=timedelta(seconds=30),
    max_concurrency=2,
    lease_duration=timedelta(seconds=60),
)
class GenerateInvoice(QueueMessage):
    order_id: str
    lines: list[OrderLine]


@queue(
    "capture-payment",
    category="payments",
    max_attempts=4,
    retry=RetryPolicy(base=timedelta(milliseconds=500), max_delay=timedelta(seconds=30)),
    circuit_breaker=CircuitBreakerOptions(failure_threshold=5, cooldown=timedelta(seconds=30)),
)
class CapturePayment(QueueMessage):
    order_id: str
    amount_cents: int = Field(ge=0)
    payment_token: str


class PaymentGatewayError(Exception):
    """The gateway timed out or answered 5xx: worth retrying."""


class CardDeclined(NonRetryableError):
    """The card was declined: retrying cannot help."""


app = QueueingApp("orders")


@app.handler()
async def send_confirmation(msg: OrderPlaced, ctx: HandlerContext) -> None:
    outbox.append(
        {"to": msg.customer_email, "order_id": msg.order_id, "subject": f"Thanks for order {msg.order_id}"}
    )
    ctx.log.info("confirmation sent to %s", msg.customer_email)
    await ctx.enqueue(GenerateInvoice(order_id=msg.order_id, lines=msg.lines))
    await ctx.enqueue(
        CapturePayment(order_id=msg.order_id, amount_cents=msg.total_cents(), payment_token=msg.payment_token)
    )


@app.handler()
def generate_invoice(msg: GenerateInvoice) -> dict[str, object]:
    time.sleep(knobs.invoice_seconds)  # rendering a PDF, say: blocking work, so a plain def
    total = sum(line.quantity * line.unit_price_cents for line in msg.lines)
    return {"invoice_number": f"INV-{msg.order_id}", "total_cents": total}


def _gateway_fails(msg: CapturePayment, attempt: int) -> bool:
    # deterministic per (message, attempt) so a demo run can be replayed
    digest = hashlib.sha256(f"{msg.message_id}:{attempt}".encode()).digest()
    return digest[0] / 256 < knobs.payment_failure_rate


@app.handler()
async def capture_payment(msg: CapturePayment, ctx: HandlerContext) -> dict[str, object]:
    if msg.payment_token == "tok_declined":  # noqa: S105 - the gateway's test token, not a secret
        raise CardDeclined(f"card declined for order {msg.order_id}")
    if _gateway_fails(msg, ctx.attempt):
        raise PaymentGatewayError(f"gateway timeout capturing {msg.amount_cents} cents")
    return {"captured_cents": msg.amount_cents, "attempt": ctx.attempt}
