"""Queue naming: every transport's rules, sanitizing is total, idempotent and keeps identities."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from queueing_core.naming import InvalidQueueName, QueueNaming, Transport, is_valid, sanitize, validate

CLOUD = [Transport.SERVICE_BUS, Transport.STORAGE_QUEUE, Transport.SQS, Transport.RABBITMQ]
names = st.text(min_size=0, max_size=400)


@pytest.mark.parametrize("transport", CLOUD)
@given(name=names)
@settings(max_examples=300, deadline=None)
def test_sanitized_names_are_valid_and_stable(transport, name):
    out = sanitize(name, transport)
    validate(out, transport)  # raises if the result breaks a rule
    assert sanitize(out, transport) == out


@pytest.mark.parametrize("transport", CLOUD)
@given(name=names)
@settings(max_examples=200, deadline=None)
def test_valid_names_are_left_alone(transport, name):
    if is_valid(name, transport):
        assert sanitize(name, transport) == name


@pytest.mark.parametrize("transport", CLOUD)
@given(a=st.text(min_size=300, max_size=320), b=st.text(min_size=300, max_size=320))
@settings(max_examples=100, deadline=None)
def test_long_names_that_differ_stay_distinct(transport, a, b):
    if a != b:
        assert sanitize(a, transport) != sanitize(b, transport)


@pytest.mark.parametrize(
    ("transport", "name", "rule"),
    [
        (Transport.STORAGE_QUEUE, "ab", "length must be 3-63"),
        (Transport.STORAGE_QUEUE, "Orders", "characters"),
        (Transport.STORAGE_QUEUE, "-orders", "start and end"),
        (Transport.STORAGE_QUEUE, "ord--ers", "consecutive dashes"),
        (Transport.STORAGE_QUEUE, "x" * 64, "length"),
        (Transport.SERVICE_BUS, "x" * 261, "length must be 1-260"),
        (Transport.SERVICE_BUS, "orders/", "start and end"),
        (Transport.SERVICE_BUS, "ord ers", "characters"),
        (Transport.SQS, "x" * 81, "length must be 1-80"),
        (Transport.SQS, "orders.v1", "characters"),
        (Transport.RABBITMQ, "amq.orders", "reserved"),
        (Transport.RABBITMQ, "é" * 200, "bytes"),
    ],
)
def test_each_rule_is_named(transport, name, rule):
    with pytest.raises(InvalidQueueName, match=rule) as info:
        validate(name, transport)
    assert info.value.rule  # the rule travels with the error for `queueing infra params`


def test_examples_of_sanitizing():
    assert sanitize("OrderPlaced", Transport.STORAGE_QUEUE) == "orderplaced"
    assert sanitize("Billing.Invoice_Ready", Transport.STORAGE_QUEUE) == "billing-invoice-ready"
    assert sanitize("Billing.Invoice_Ready", Transport.SERVICE_BUS) == "Billing.Invoice_Ready"
    assert sanitize("Billing.Invoice_Ready", Transport.SQS) == "Billing-Invoice_Ready"
    assert sanitize("a", Transport.STORAGE_QUEUE).startswith("a-")
    assert sanitize("amq.x", Transport.RABBITMQ) == "q-amq.x"


def test_prefix_and_suffix_compose_before_sanitizing():
    naming = QueueNaming(prefix="Prod_", suffix="-EU")
    assert naming.physical("OrderPlaced", Transport.STORAGE_QUEUE) == "prod-orderplaced-eu"
    assert naming.physical("OrderPlaced", Transport.SERVICE_BUS) == "Prod_OrderPlaced-EU"
