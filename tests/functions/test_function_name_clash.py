"""Queue names that turn into one Function name: the host indexes the app (``get_functions``) and
refuses it whole ("does not have a unique function name": no function loads), so each queue must
get a name of its own, and queues that clash with none keep the name they were deployed under."""

from __future__ import annotations

import pytest

from functions import build_app
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ConfigurationError
from queueing_core.settings import QueueingSettings

from .conftest import bindings, functions_of

SB_ENV = {
    "QueueingStorage": "UseDevelopmentStorage=true",
    "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net",
}
LONG = "a" * 130  # past what a Function name keeps (128, its prefix included)


@queue("orders.v1")
class ClashDotted(QueueMessage):
    n: int = 0


@queue("orders-v1")
class ClashDashed(QueueMessage):
    n: int = 0


@queue("orders_v1")
class ClashPlain(QueueMessage):
    n: int = 0


@queue("order-placed-clash")
class ClashFree(QueueMessage):
    n: int = 0


@queue(f"{LONG}.one")
class ClashLongOne(QueueMessage):
    n: int = 0


@queue(f"{LONG}.two")
class ClashLongTwo(QueueMessage):
    n: int = 0


def app_of(*types: type[QueueMessage]) -> QueueingApp:
    app = QueueingApp("clash")
    for t in types:

        async def handle(msg: QueueMessage) -> None:
            return None

        app.handler(t)(handle)
    return app


def indexed(*types: type[QueueMessage]) -> dict[str, str]:
    """Function name -> the queue its trigger binds, as the host indexes the app."""
    fa = build_app(QueueingSettings(provider="servicebus"), app_of(*types), env=SB_ENV)
    return {
        name: bindings(fn)[0]["queueName"]
        for name, fn in functions_of(fa).items()
        if name.startswith("servicebus_")
    }


def test_queues_differing_only_in_dots_and_dashes_each_get_a_function():
    found = indexed(ClashDotted, ClashDashed, ClashFree)
    assert found == {
        # the suffix is fixed by the queue name alone: the same on every build and every release
        "servicebus_orders_v1_2c443d9a": "orders.v1",
        "servicebus_orders_v1_041e2a28": "orders-v1",
        "servicebus_order_placed_clash": "order-placed-clash",  # no clash: its name as before
    }


def test_a_queue_whose_own_name_is_the_function_name_keeps_it():
    found = indexed(ClashPlain, ClashDotted)
    assert found == {"servicebus_orders_v1": "orders_v1", "servicebus_orders_v1_2c443d9a": "orders.v1"}


def test_a_queue_alone_keeps_its_plain_name():
    assert indexed(ClashDashed) == {"servicebus_orders_v1": "orders-v1"}


def test_names_cut_at_128_characters_stay_apart():
    found = indexed(ClashLongOne, ClashLongTwo)
    assert sorted(found.values()) == [f"{LONG}.one", f"{LONG}.two"]
    assert all(len(name) <= 128 for name in found)


def test_a_queue_named_like_anothers_suffixed_name_is_refused_naming_both():
    @queue("orders_v1_2c443d9a")
    class ClashSuffixed(QueueMessage):
        n: int = 0

    with pytest.raises(
        ConfigurationError, match=r"'orders_v1_2c443d9a'.*'orders\.v1'|'orders\.v1'.*'orders_v1_2c443d9a'"
    ):
        indexed(ClashDotted, ClashDashed, ClashSuffixed)
