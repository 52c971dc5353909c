"""Storage Queues and Service Bus refuse, when the runtime opens, queue names that would share a queue.

An app with ``orders`` and ``orders-poison`` on Storage Queues, run by a worker (``queueing serve``),
dead-lettered an ``orders`` message to ``orders-poison``, which was also a live queue: its consumer ran
the ``orders`` handler again on the dead letter, which then went to ``orders-poison-poison``, where no
retry or purge of ``orders`` looks. The runtime checked names on SQS and RabbitMQ only; the Functions
app checked Storage and Service Bus at indexing, but a worker never did. ``queueing check`` had a weaker
check of its own, and showed names without ``QUEUEING_QUEUE_PREFIX``/``SUFFIX`` (found in review). All
of them now run :func:`queueing_core.infra.check_names`.
"""

from __future__ import annotations

import textwrap

import pytest

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.connections import _AZURITE, ServiceBusConnection, StorageConnection
from queueing_core.control import MemoryControlStore
from queueing_core.errors import ConfigurationError
from queueing_core.naming import Transport
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MemoryTracker
from tests.unit.test_logs_and_cli import run_cli


@queue("orders")
class Order(QueueMessage):
    order_id: str


@queue("orders-poison")
class OrderProblem(QueueMessage):
    order_id: str


@queue("Orders")
class UpperOrder(QueueMessage):
    order_id: str


@queue("Payments/Capture")
class Capture(QueueMessage):
    amount: int


def _app(*types: type[QueueMessage]) -> QueueingApp:
    app = QueueingApp("first-use-names")
    for t in types:
        app.message(t)
    return app


# an unreachable account: the refusal comes before anything is created or connected
_NOWHERE = _AZURITE.replace("127.0.0.1", "192.0.2.1")


async def test_the_runtime_on_storage_queues_refuses_a_queue_named_like_anothers_poison_queue():
    from queueing_core.providers.storage_queue import StorageQueueProvider

    rt = Runtime(_app(Order, OrderProblem), StorageQueueProvider(StorageConnection(_NOWHERE)))
    with pytest.raises(ConfigurationError) as caught:
        await rt.open()
    assert "'orders-poison' is also the name of queue 'orders' (its poison queue)" in str(caught.value)
    assert not rt.is_open
    await rt.close()


async def test_the_runtime_on_service_bus_refuses_two_queues_it_names_alike():
    from queueing_core.providers.servicebus import ServiceBusProvider

    connection = ServiceBusConnection("Endpoint=sb://192.0.2.1/;SharedAccessKeyName=k;SharedAccessKey=x")
    provider = ServiceBusProvider.from_connection(
        connection, control=MemoryControlStore(), tracker=MemoryTracker()
    )
    rt = Runtime(_app(Order, UpperOrder), provider)
    try:
        with pytest.raises(ConfigurationError, match="is also the name of queue"):
            await rt.open()
    finally:
        await provider.close()


class _OnServiceBus(InProcessProvider):
    transport = Transport.SERVICE_BUS


async def test_a_worker_on_service_bus_still_takes_a_name_with_a_slash():
    # the Bicep's rule (ARM reads '/' as a separator): Service Bus and the runtime take such a name
    rt = Runtime(_app(Capture), _OnServiceBus())
    await rt.open()
    assert rt.is_open
    await rt.close()


def _write_app(tmp_path) -> None:
    (tmp_path / "poisonapp.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage, queue
        @queue("orders")
        class Order(QueueMessage):
            order_id: str
        @queue("orders-poison")
        class OrderProblem(QueueMessage):
            order_id: str
        app = QueueingApp("poison")
        app.message(Order)
        app.message(OrderProblem)
        """
        )
    )


def test_check_refuses_a_queue_named_like_anothers_poison_queue(tmp_path):
    _write_app(tmp_path)
    r = run_cli("check", "--app", "poisonapp:app", "--transport", "storage_queue", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    [line] = r.stderr.splitlines()
    assert "'orders-poison' is also the name of queue 'orders' (its poison queue)" in line
    assert "ok" not in r.stdout.split()
    # the same app on a transport without a poison queue is fine
    assert run_cli("check", "--app", "poisonapp:app", "--transport", "sql", cwd=tmp_path).returncode == 0


def test_check_takes_a_service_bus_name_with_a_slash_as_the_worker_does(tmp_path):
    # (the Bicep cannot create it: `infra params` says so; a worker that creates its queues takes it)
    (tmp_path / "slashapp.py").write_text(
        textwrap.dedent(
            """
        from queueing_core import QueueingApp, QueueMessage, queue
        @queue("payments/capture")
        class Capture(QueueMessage):
            amount: int
        app = QueueingApp("slash")
        app.message(Capture)
        """
        )
    )
    r = run_cli("check", "--app", "slashapp:app", "--transport", "servicebus", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_shows_the_names_with_the_queue_prefix_and_suffix():
    env = {"QUEUEING_QUEUE_PREFIX": "prod-", "QUEUEING_QUEUE_SUFFIX": "-blue"}
    app = "queueing_core.examples.orders:app"
    r = run_cli("check", "--app", app, "--transport", "storage_queue", env=env)
    assert r.returncode == 0, r.stderr
    assert "prod-order-placed-blue" in r.stdout
    # a prefix is not sanitizing: no note that the name was changed
    assert "(sanitized)" not in r.stdout
