"""``GET metrics``: the Prometheus text exposition format (version 0.0.4), written out by hand so the
kit needs no client library. Counts by status are the ones ``GET stats`` reads (the store's own
counters, never a scan of the messages); handled messages and waiting times are this process's."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..throughput import Throughput
from .models import Summary

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


def _value(value: float) -> str:
    """A sample's value, exact: ``{:g}`` kept 6 significant digits, so a count past a million came
    out rounded (1234567 as 1.23457e+06) and a counter stood still between steps of its last digit
    (rate() read 0, then a jump). Integers print whole; floats as Python's shortest round-trip repr,
    which the format's Go float parsing reads back to the same number."""
    if isinstance(value, int):  # bool too: a 0/1 gauge
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:  # exactly an integer: "3", not "3.0"
        return str(int(value))
    return repr(value)


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, str, float]]) -> list[str]:
    """``samples``: (suffix, rendered labels, value)."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{labels} {_value(value)}" for suffix, labels, value in samples]
    return lines


def render(summary: Summary, throughput: Throughput) -> str:
    counts: dict[str, dict[str, int]] = {}
    for q in summary.queues:  # two types may share a queue
        counts.setdefault(q.queue, {}).update(q.counts)
    for queue, c in summary.other_queues.items():
        counts.setdefault(queue, {}).update(c)
    lines = _family(
        "queueing_messages",
        "gauge",
        "Unarchived messages by queue and status (the counts of GET stats).",
        (
            ("", _labels(queue=q, status=s), n)
            for q, c in sorted(counts.items())
            for s, n in sorted(c.items())
        ),
    )
    lines += _family(
        "queueing_queue_paused",
        "gauge",
        "1 while the queue (or its message type) is paused on every host.",
        (("", _labels(queue=q.queue, type=q.type), float(q.paused or q.type_paused)) for q in summary.queues),
    )
    lines += _family(
        "queueing_handled_total",
        "counter",
        "Messages handled by this process since it started, by outcome (rate() gives throughput).",
        (("", _labels(queue=q, outcome=o), n) for (q, o), n in sorted(throughput.handled.items())),
    )
    lag = sorted(throughput.lag.items())
    lines += _family(
        "queueing_lag_seconds",
        "summary",
        "Time from when a message was due to when a handler of this process started it.",
        [
            *(("_sum", _labels(queue=q), x.total) for q, x in lag),
            *(("_count", _labels(queue=q), x.count) for q, x in lag),
        ],
    )
    lines += _family(
        "queueing_last_lag_seconds",
        "gauge",
        "The wait of the last message a handler of this process started, by queue.",
        (("", _labels(queue=q), x.last) for q, x in lag),
    )
    return "\n".join(lines) + "\n"
