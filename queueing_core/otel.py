"""OpenTelemetry for an app: the one module of the kit that imports ``opentelemetry``.

:func:`instrument` adds an enqueue middleware, a handle middleware and hooks to the app; nothing
else in the kit knows about OpenTelemetry, so an app that never calls it (``QUEUEING_OPENTELEMETRY``
unset) imports none of it and pays nothing.

- Each enqueued message gets a ``create <queue>`` span (kind PRODUCER), and that span's context
  travels in the envelope's headers as W3C ``traceparent`` / ``tracestate``.
- Each handler run is a ``process <queue>`` span (kind CONSUMER) whose parent is that context, so
  the producer and the handler share one trace even across processes and hosts. Under Azure
  Functions the invocation's own trace (from the host) is the parent instead and the producer's
  context is a link, so the run sits inside the invocation that Application Insights shows.
- Attributes follow the messaging semantic conventions (``messaging.system``,
  ``messaging.destination.name``, ``messaging.message.id``, ``messaging.operation.type``) plus the
  kit's ``queueing.attempt``, ``queueing.message.type`` and ``queueing.outcome``.
- Metrics: ``queueing.messages.processed`` / ``.failed`` / ``.dead_lettered`` / ``.expired``
  counters, ``messaging.process.duration`` (handler time, seconds) and ``queueing.queue.lag``
  (seconds from when a message was due to when its handler started).

The spans and metrics go wherever the global (or given) tracer and meter providers send them: set
up the OpenTelemetry SDK or a distribution (such as Azure Monitor's) as usual.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.trace import Link, SpanKind, StatusCode

from .clock import utcnow
from .context import host_trace
from .hooks import Event, Observation

if TYPE_CHECKING:
    from .app import QueueingApp
    from .context import HandlerContext
    from .envelope import Envelope

SCOPE = "queueing_core"
#: the kit's transports as ``messaging.system`` (the convention's names where it has one)
SYSTEMS = {
    "servicebus": "servicebus",
    "rabbitmq": "rabbitmq",
    "sqs": "aws_sqs",
    "storage_queue": "azure_storage_queues",
    "sql": "sql",
    "inprocess": "inprocess",
}
_MARK = "_queueing_otel"


class Instrumentation:
    def __init__(self, app: QueueingApp, tracer_provider: Any = None, meter_provider: Any = None) -> None:
        self.app = app
        self.tracer = trace.get_tracer(SCOPE, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, meter_provider=meter_provider)
        self.counters = {
            Event.SUCCEEDED: meter.create_counter(
                "queueing.messages.processed", "{message}", "Messages whose handler succeeded"
            ),
            Event.FAILED: meter.create_counter(
                "queueing.messages.failed", "{message}", "Handler failures with a retry scheduled"
            ),
            Event.DEAD_LETTERED: meter.create_counter(
                "queueing.messages.dead_lettered", "{message}", "Messages dead-lettered"
            ),
            Event.EXPIRED: meter.create_counter("queueing.messages.expired", "{message}", "Messages expired"),
        }
        self.duration = meter.create_histogram("messaging.process.duration", "s", "Duration of handler runs")
        self.lag = meter.create_histogram(
            "queueing.queue.lag", "s", "Time from when a message was due to when its handler started"
        )

    def system(self) -> str:
        producer = self.app._producer
        transport = producer.provider.transport.value if producer is not None else "unknown"
        return SYSTEMS.get(transport, transport)

    def _attributes(self, env: Envelope, queue: str) -> dict[str, Any]:
        return {
            "messaging.system": self.system(),
            "messaging.destination.name": queue,
            "messaging.message.id": str(env.message_id),
            "queueing.message.type": env.type,
            **({"messaging.message.conversation_id": env.correlation_id} if env.correlation_id else {}),
        }

    # -- producing -----------------------------------------------------------------------------------
    async def on_enqueue(
        self, env: Envelope, call_next: Callable[[Envelope], Awaitable[Envelope]]
    ) -> Envelope:
        # (the producer set ``env.queue`` itself: the queue of a type this app registered)
        attributes = {**self._attributes(env, env.queue), "messaging.operation.type": "create"}
        with self.tracer.start_as_current_span(
            f"create {env.queue}", kind=SpanKind.PRODUCER, attributes=attributes
        ):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            return await call_next(env.model_copy(update={"headers": {**env.headers, **carrier}}))

    # -- consuming -----------------------------------------------------------------------------------
    async def on_handle(self, ctx: HandlerContext, call_next: Callable[[], Awaitable[Any]]) -> Any:
        env = ctx.envelope
        # the queue of the subscription the message was received for, not the envelope's own
        # ``queue``: that is whatever its sender wrote, and as a metric attribute or in a span's name
        # each new value started a series or a name of its own, without bound
        queue = ctx.subscription.queue
        parent = propagate.extract(env.headers)
        links: list[Link] = []
        host = host_trace.get()
        if host is not None:  # an Azure Functions invocation: its trace is the parent
            producer = trace.get_current_span(parent).get_span_context()
            if producer.is_valid:
                links.append(Link(producer))
            parent = propagate.extract(
                {"traceparent": host[0], **({"tracestate": host[1]} if host[1] else {})}
            )
        attributes = {
            **self._attributes(env, queue),
            "messaging.operation.type": "process",
            "queueing.attempt": ctx.attempt,
        }
        due = env.not_before or env.created_at
        self.lag.record(
            max(0.0, (utcnow() - due).total_seconds()),
            {"messaging.system": attributes["messaging.system"], "messaging.destination.name": queue},
        )
        started = time.perf_counter()
        with self.tracer.start_as_current_span(
            f"process {queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            links=links,
            attributes=attributes,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            outcome = "failed"
            try:
                result = await call_next()
                outcome = "succeeded"
                return result
            finally:
                span.set_attribute("queueing.outcome", outcome)
                if outcome == "failed":
                    span.set_status(StatusCode.ERROR)
                self.duration.record(
                    time.perf_counter() - started,
                    {
                        "messaging.system": attributes["messaging.system"],
                        "messaging.destination.name": queue,
                        "queueing.outcome": outcome,
                    },
                )

    def observe(self, obs: Observation) -> None:
        counter = self.counters.get(obs.event)
        if counter is not None:
            counter.add(1, {"messaging.system": self.system(), "messaging.destination.name": obs.queue})


def instrument(
    app: QueueingApp, *, tracer_provider: Any = None, meter_provider: Any = None
) -> Instrumentation:
    """Trace and measure ``app`` (once; later calls return the same instrumentation). Call it at
    start-up, before the first enqueue; ``QUEUEING_OPENTELEMETRY=true`` does it for the hosts."""
    done: Instrumentation | None = getattr(app, _MARK, None)
    if done is not None:
        return done
    inst = Instrumentation(app, tracer_provider, meter_provider)
    app.use_enqueue_middleware(inst.on_enqueue)
    # outermost, so the span covers the app's own middleware too
    app.handle_middleware.insert(0, inst.on_handle)
    app.version += 1  # the pipeline rebuilds its cached middleware chains
    app.hooks.on(*inst.counters)(inst.observe)
    setattr(app, _MARK, inst)
    return inst
