"""Every function ``build_app`` makes passes the checks the Python language worker runs as it indexes
the app. One function it refuses fails the whole metadata request: the host loads 0 functions (the
Storage trigger's ``context: func.Context | None`` did, found in review; the tests that call
``get_user_function()`` directly never ran the check).

The checks are restated from the worker's source, Azure/azure-functions-python-worker,
``azure_functions_worker/functions.py``: ``Registry.add_indexed_function`` ->
``is_context_required`` and the non-type hint check of ``validate_function_params`` (the same code in
the 2020 PyPI release and in the 4.34 worker). The worker itself is not installed here: it is
shipped with the Functions host, and its package pins ``azure-functions``, ``grpcio`` and ``protobuf``
to versions other than the app's.
"""

from __future__ import annotations

import inspect
import json
import typing
from datetime import timedelta
from typing import Any

import azure.functions as func
import pytest

from functions import build_app
from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.settings import QueueingSettings

from .conftest import functions_of

STORAGE_ENV = {"QueueingStorage": "UseDevelopmentStorage=true"}
SB_ENV = {**STORAGE_ENV, "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net"}


class FunctionLoadError(RuntimeError):
    pass


def worker_load_check(fn: Any) -> None:
    """What the worker asks of one indexed function's parameters (see the module's docstring)."""
    func = fn.get_user_function()
    name = fn.get_function_name()
    params = dict(inspect.signature(func).parameters)
    annotations = typing.get_type_hints(func)  # (what the worker reads: a hint that fails to resolve raises)
    bound = {b["name"] for b in json.loads(fn.get_function_json())["bindings"] if b["name"] != "$return"}
    # is_context_required
    if "context" in params and "context" not in bound:
        params.pop("context")
        if "context" in annotations:
            hint = annotations["context"]
            if not isinstance(hint, type) or hint.__name__ != "Context":
                raise FunctionLoadError(
                    f"cannot load the {name} function: the 'context' parameter is expected to be of "
                    f"type azure.functions.Context, got {hint!r}"
                )
    # validate_function_params: a bound parameter's hint is a type (or a generic). (Which parameters
    # may be left unbound is not restated: newer workers than the stored source hand the Service Bus
    # trigger's ``message_actions`` over without a binding.)
    for param in params.keys() & bound:
        if param in annotations:
            hint = annotations[param]
            if not isinstance(hint, type) and typing.get_origin(hint) is None:
                raise FunctionLoadError(f"cannot load the {name} function: {param} has the hint {hint!r}")


@queue("load-check")
class LoadCheck(QueueMessage):
    n: int = 0


def _app() -> QueueingApp:
    app = QueueingApp("load-check")

    @app.handler()
    async def handle(msg: LoadCheck) -> None:
        return None

    app.every(timedelta(minutes=5), LoadCheck(), name="load-check-tick")  # the schedules timer too
    return app


@pytest.mark.parametrize(
    ("settings", "env"),
    [
        (QueueingSettings(provider="storage_queue"), STORAGE_ENV),
        (
            QueueingSettings(
                provider="storage_queue", storage_delayed_store=True, database_url="postgresql://h/db"
            ),
            STORAGE_ENV,
        ),
        (QueueingSettings(provider="servicebus"), SB_ENV),
        (QueueingSettings(provider="sql", database_url="postgresql://h/db"), {}),
    ],
    ids=["storage_queue", "storage_queue-delayed-store", "servicebus", "sql"],
)
def test_every_function_of_every_transport_passes_the_python_workers_load_check(
    settings: QueueingSettings, env: dict[str, str]
) -> None:
    fns = functions_of(build_app(settings, _app(), env=env))
    # each kind of function is there: a trigger (queue transports), the timers and the ops API
    assert {"http_app_func", "queueing_retention", "queueing_schedules"} <= set(fns), sorted(fns)
    if settings.provider != "sql":
        assert any(n.endswith("_load_check") for n in fns), sorted(fns)
    for fn in fns.values():
        worker_load_check(fn)


def test_the_check_refuses_what_the_worker_refuses() -> None:
    """The restated check is not a formality: the annotation the Storage trigger had fails it."""

    async def on_message(msg: func.QueueMessage, context: func.Context | None = None) -> None:
        return None

    class Fn:
        def get_user_function(self) -> Any:
            return on_message

        def get_function_name(self) -> str:
            return "queue_x"

        def get_function_json(self) -> str:
            return json.dumps({"bindings": [{"name": "msg", "type": "queueTrigger"}]})

    with pytest.raises(FunctionLoadError, match="'context' parameter is expected"):
        worker_load_check(Fn())
