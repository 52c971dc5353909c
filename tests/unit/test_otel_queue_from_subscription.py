"""Spans and metrics name the queue a message was received from, not the one its envelope names.

Found in review: the handler span's name (``process <queue>``) and the ``messaging.destination.name``
of the duration and lag metrics came from the envelope's ``queue``, which its sender writes. Messages
on one queue whose envelopes named a new queue each made a new metric series and span name each,
without bound (the counters, fed by the received-from queue, kept one).
"""

from __future__ import annotations

import uuid

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.clock import utcnow
from queueing_core.envelope import Envelope
from queueing_core.otel import instrument
from queueing_core.providers.inprocess import _Item
from queueing_core.testing import in_process, run_until_idle

SENT = 20


@queue("invoices")
class SendInvoice(QueueMessage):
    order_id: str


async def test_envelopes_naming_other_queues_make_one_series() -> None:
    app = QueueingApp("billing")
    ran: list[str] = []

    @app.handler()
    async def send(msg: SendInvoice) -> None:
        ran.append(msg.order_id)

    spans = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    instrument(app, tracer_provider=tracer, meter_provider=MeterProvider(metric_readers=[reader]))
    rt = in_process(app)
    async with rt:
        now = utcnow()
        for i in range(SENT):
            # put on the queue "invoices" by another producer, each envelope naming a queue of its own
            env = Envelope(
                type="SendInvoice",
                queue=f"invoices-{uuid.uuid4()}",
                message_id=uuid.uuid4(),
                tracking_id=uuid.uuid4(),
                created_at=now,
                body={"order_id": f"o-{i}"},
            )
            rt.provider._q("invoices").put(_Item(now, i, env.encode()), now)
        await run_until_idle(rt)
    assert len(ran) == SENT
    consumer = [s for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    assert {s.name for s in consumer} == {"process invoices"}
    assert {s.attributes["messaging.destination.name"] for s in consumer} == {"invoices"}
    for metric in reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics:
        points = list(metric.data.data_points)
        assert len(points) == 1, metric.name
        assert points[0].attributes["messaging.destination.name"] == "invoices"
