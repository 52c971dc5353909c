"""OpenTelemetry in one process: outcomes on spans, the metrics, the Functions host's trace continued."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from queueing_core import NonRetryableError, QueueingApp, QueueMessage, queue
from queueing_core.context import host_trace
from queueing_core.otel import instrument
from queueing_core.testing import in_process, run_until_idle

HOST_TRACE = "0af7651916cd43dd8448eb211c80319c"
HOST_PARENT = f"00-{HOST_TRACE}-b7ad6b7169203331-01"


@queue("jobs", max_attempts=2)
class Job(QueueMessage):
    fail: bool = False


@pytest.fixture
def traced():
    app = QueueingApp("otel")

    @app.handler()
    async def handle(msg: Job) -> None:
        if msg.fail:
            raise NonRetryableError("no")

    spans = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    inst = instrument(app, tracer_provider=tracer, meter_provider=MeterProvider(metric_readers=[reader]))
    assert instrument(app) is inst  # once per app
    return app, spans, reader


def metric_points(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    out: dict[str, list] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


async def test_spans_carry_the_outcome_and_metrics_count_each_kind(traced):
    app, spans, reader = traced
    rt = in_process(app)
    async with rt:
        for fail in (False, False, True):
            await app.enqueue(Job(fail=fail))
        await run_until_idle(rt, raise_errors=False)
    consumer = [s for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    outcomes = sorted(s.attributes["queueing.outcome"] for s in consumer)
    assert outcomes == ["failed", "succeeded", "succeeded"]
    failed = next(s for s in consumer if s.attributes["queueing.outcome"] == "failed")
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.events[0].name == "exception"
    points = metric_points(reader)
    assert sum(p.value for p in points["queueing.messages.processed"]) == 2
    assert sum(p.value for p in points["queueing.messages.dead_lettered"]) == 1
    assert sum(p.count for p in points["messaging.process.duration"]) == 3
    assert sum(p.count for p in points["queueing.queue.lag"]) == 3
    assert {p.attributes["messaging.destination.name"] for p in points["queueing.messages.processed"]} == {
        "jobs"
    }


async def test_under_a_functions_host_its_trace_is_the_parent_and_the_producer_a_link(traced):
    app, spans, _ = traced
    rt = in_process(app)
    async with rt:
        await app.enqueue(Job())
        [create] = spans.get_finished_spans()
        token = host_trace.set((HOST_PARENT, ""))
        try:
            await run_until_idle(rt)
        finally:
            host_trace.reset(token)
    process = spans.get_finished_spans()[-1]
    assert format(process.context.trace_id, "032x") == HOST_TRACE
    assert process.parent.span_id == 0xB7AD6B7169203331
    assert [link.context.span_id for link in process.links] == [create.context.span_id]


def test_the_setting_switches_it_on_for_the_hosts_and_is_off_by_default():
    from queueing_core.bootstrap import bootstrap
    from queueing_core.otel import Instrumentation
    from queueing_core.settings import QueueingSettings

    plain = QueueingApp("plain")
    bootstrap(plain, QueueingSettings(provider="inprocess"))
    assert plain.handle_middleware == []
    assert plain.enqueue_middleware == []
    traced = QueueingApp("traced")
    bootstrap(traced, QueueingSettings(provider="inprocess", opentelemetry=True))
    [on_handle] = traced.handle_middleware
    assert isinstance(on_handle.__self__, Instrumentation)
