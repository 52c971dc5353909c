"""A Service Bus queue name holding '/' is refused where the Bicep creates the queue.

Service Bus itself takes '/' in a queue name, and so does the kit's runtime. But `queueing infra params`
writes the name into ``serviceBusQueues``, and infra/modules/servicebus.bicep declares the queue as a
child resource (``parent: namespace, name: q.name``): Azure Resource Manager reserves '/' in resource
names, so '<namespace>/payments/capture' has one segment too many for
``Microsoft.ServiceBus/namespaces/queues`` and the deployment fails. The generator and the Functions app
(whose queues are the Bicep's) refuse such a name up front, naming the rule, as they refuse an
over-long one.
"""

from __future__ import annotations

import pytest

from functions import build_app
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.errors import ConfigurationError
from queueing_core.infra import check_names, queues_for, render
from queueing_core.naming import QueueNaming, Transport
from queueing_core.settings import QueueingSettings
from tests.infra.bicep_tools import accessor, body, module_file, resources_of


@queue("Payments/Capture")
class Capture(QueueMessage):
    amount: int


@queue("capture")
class Plain(QueueMessage):
    amount: int


def _app(message: type[QueueMessage], naming: QueueNaming | None = None) -> QueueingApp:
    app = QueueingApp("slashes", naming=naming) if naming else QueueingApp("slashes")
    app.message(message)
    return app


def test_the_bicep_names_a_queue_by_its_generated_name_as_is():
    # what makes '/' fatal: the queue is a child resource named by the generated name itself
    [res] = resources_of(module_file("servicebus"), "Microsoft.ServiceBus/namespaces/queues").values()
    cfg = body(res)
    assert (cfg["parent"], accessor(cfg["name"])) == ("namespace", "q.name")


def test_a_service_bus_queue_name_with_a_slash_is_refused_with_the_rule():
    with pytest.raises(ConfigurationError, match=r"'Payments/Capture'.*reserves '/'") as err:
        queues_for(_app(Capture))
    assert "servicebus" in str(err.value)
    with pytest.raises(ConfigurationError, match="reserves '/'"):
        render(_app(Capture))


def test_a_prefix_or_suffix_with_a_slash_is_refused_too():
    with pytest.raises(ConfigurationError, match=r"'tenant1/capture'.*reserves '/'"):
        render(_app(Plain, QueueNaming("tenant1/", "")))
    with pytest.raises(ConfigurationError, match=r"'capture/blue'.*reserves '/'"):
        render(_app(Plain, QueueNaming("", "/blue")))


def test_storage_queues_alone_are_not_held_to_the_service_bus_rule():
    # a Storage-only check sanitizes the name into Storage's rules: no '/' is left to refuse
    check_names(_app(Capture), (Transport.STORAGE_QUEUE,))


def test_the_functions_app_on_service_bus_refuses_it():
    env = {
        "QueueingStorage": "UseDevelopmentStorage=true",
        "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net",
    }
    with pytest.raises(ConfigurationError, match="reserves '/'"):
        build_app(QueueingSettings(provider="servicebus"), _app(Capture), env=env)
