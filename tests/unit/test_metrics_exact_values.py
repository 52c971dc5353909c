"""``GET metrics`` writes every sample's value exactly.

It used Python's ``{:g}`` (6 significant digits): from a million on, gauges and counters came out
rounded (1234567 as 1.23457e+06), and a counter stood still between steps of 10, 100, 1000..., so
rate() read 0 and then jumped. Integers now print whole, floats as their shortest exact repr, and
Prometheus' own parser reads back the very numbers.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from queueing_core.ops.models import QueueSummary, Summary
from queueing_core.ops.prometheus import render
from queueing_core.options import Health
from queueing_core.throughput import Lag, Throughput


def _summary(counts: dict[str, int], *, paused: bool = False) -> Summary:
    q = QueueSummary(
        queue="orders",
        type="Order",
        category=None,
        has_handler=True,
        paused=paused,
        type_paused=False,
        circuit=None,
        counts=counts,
        total=sum(counts.values()),
        health=Health.HEALTHY,
    )
    return Summary(provider="sql", generated_at=datetime.now(UTC), queues=[q], totals={})


def _lines(text: str) -> dict[str, str]:
    """Each sample line as written: name with labels -> the value's text."""
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))


def test_counts_and_counters_past_a_million_are_exact():
    tally = Throughput()
    tally.handled[("orders", "succeeded")] = 1_000_004
    tally.handled[("orders", "failed")] = 2**53 + 1  # past a float's integers: still exact
    tally.lag["orders"] = Lag(count=123_456_789, total=98_765.4321, last=0.1)
    text = render(_summary({"Succeeded": 1_234_567, "Pending": 0}), tally)
    lines = _lines(text)
    assert lines['queueing_messages{queue="orders",status="Succeeded"}'] == "1234567"
    assert lines['queueing_messages{queue="orders",status="Pending"}'] == "0"
    assert lines['queueing_handled_total{queue="orders",outcome="succeeded"}'] == "1000004"
    assert lines['queueing_handled_total{queue="orders",outcome="failed"}'] == str(2**53 + 1)
    assert lines['queueing_lag_seconds_count{queue="orders"}'] == "123456789"
    assert lines['queueing_lag_seconds_sum{queue="orders"}'] == "98765.4321"
    assert lines['queueing_last_lag_seconds{queue="orders"}'] == "0.1"
    assert lines['queueing_queue_paused{queue="orders",type="Order"}'] == "0"

    # what Prometheus reads back is the very number
    parsed = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert parsed[("queueing_messages", (("queue", "orders"), ("status", "Succeeded")))] == 1_234_567
    assert parsed[("queueing_handled_total", (("outcome", "succeeded"), ("queue", "orders")))] == 1_000_004
    assert parsed[("queueing_lag_seconds_sum", (("queue", "orders"),))] == 98_765.4321


def test_a_counter_moves_by_one_past_a_million():
    tally = Throughput()
    key = 'queueing_handled_total{queue="orders",outcome="succeeded"}'
    seen = []
    for n in (9_999_999, 10_000_000, 10_000_001):
        tally.handled[("orders", "succeeded")] = n
        seen.append(_lines(render(_summary({}), tally))[key])
    assert seen == ["9999999", "10000000", "10000001"]


def test_whole_floats_print_as_integers_and_odd_values_in_the_format_spelling():
    tally = Throughput()
    tally.lag["orders"] = Lag(count=2, total=3.0, last=float("inf"))
    lines = _lines(render(_summary({}, paused=True), tally))
    assert lines['queueing_queue_paused{queue="orders",type="Order"}'] == "1"
    assert lines['queueing_lag_seconds_sum{queue="orders"}'] == "3"
    assert lines['queueing_last_lag_seconds{queue="orders"}'] == "+Inf"
    tally.lag["orders"] = Lag(count=2, total=1e-7, last=float("nan"))
    lines = _lines(render(_summary({}), tally))
    assert lines['queueing_lag_seconds_sum{queue="orders"}'] == "1e-07"
    assert lines['queueing_last_lag_seconds{queue="orders"}'] == "NaN"
