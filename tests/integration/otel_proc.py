"""One side of the cross-process trace test: ``produce`` enqueues a message, ``consume`` handles it;
each records its spans with OpenTelemetry's in-memory exporter and writes them to a JSON file.
``plain`` does both without OpenTelemetry and prints the ``opentelemetry`` modules loaded.

    python -m tests.integration.otel_proc produce|consume|plain DB_URL SPANS_PATH
"""

from __future__ import annotations

import asyncio
import json
import sys

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.bootstrap import bootstrap
from queueing_core.settings import QueueingSettings
from queueing_core.testing import run_until_idle


@queue("traced")
class Traced(QueueMessage):
    n: int


def build_app() -> QueueingApp:
    app = QueueingApp("traced")

    @app.handler()
    async def handle(msg: Traced) -> None:
        pass

    return app


def spans_out(exporter, path: str) -> None:
    spans = [
        {
            "name": s.name,
            "kind": s.kind.name,
            "trace_id": format(s.context.trace_id, "032x"),
            "span_id": format(s.context.span_id, "016x"),
            "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
            "attributes": dict(s.attributes or {}),
        }
        for s in exporter.get_finished_spans()
    ]
    with open(path, "w") as f:
        json.dump(spans, f)


async def main(role: str, url: str, path: str) -> None:
    app = build_app()
    exporter = None
    if role != "plain":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from queueing_core.otel import instrument

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        instrument(app, tracer_provider=provider)
    # through the hosts' own start-up, which reads QUEUEING_OPENTELEMETRY (unset here)
    rt = bootstrap(app, QueueingSettings(provider="sql", database_url=url))
    async with rt:
        if role in ("produce", "plain"):
            await app.enqueue(Traced(n=1))
        if role in ("consume", "plain"):
            assert await run_until_idle(rt) == 1
    if exporter is not None:
        spans_out(exporter, path)
    else:
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("opentelemetry"))))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
