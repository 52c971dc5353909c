"""Helpers to call Azure Functions the way the host does, with azure.functions objects."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import azure.functions as func


def functions_of(app: func.FunctionApp) -> dict[str, Any]:
    """Name -> Function (``get_functions`` may run once per app: build a fresh app per test)."""
    return {f.get_function_name(): f for f in app.get_functions()}


def bindings(fn: Any) -> list[dict[str, Any]]:
    return json.loads(fn.get_function_json())["bindings"]


def user(fn: Any) -> Any:
    return fn.get_user_function()


class Context(func.Context):
    """The invocation context the host passes (only what the ASGI adapter reads)."""

    def __init__(self, name: str = "http_app_func") -> None:
        self._name = name

    @property
    def invocation_id(self) -> str:
        return "00000000-0000-0000-0000-000000000001"

    @property
    def thread_local_storage(self) -> Any:
        return None

    @property
    def function_name(self) -> str:
        return self._name

    @property
    def function_directory(self) -> str:
        return "."

    @property
    def trace_context(self) -> Any:
        return None

    @property
    def retry_context(self) -> Any:
        return None


@dataclass
class RecordingActions:
    """Stands in for ServiceBusMessageActions (which only works inside the Functions worker): records
    the settlement, which the test then applies to the in-memory Service Bus as the host would."""

    done: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)

    def complete(self, message: Any) -> None:
        self.done.append(("complete", message, {}))

    def abandon(self, message: Any) -> None:
        self.done.append(("abandon", message, {}))

    def deadletter(
        self,
        message: Any,
        deadletter_reason: str | None = None,
        deadletter_error_description: str | None = None,
    ) -> None:
        self.done.append(
            (
                "deadletter",
                message,
                {"reason": deadletter_reason, "error_description": deadletter_error_description},
            )
        )

    async def apply(self, receiver: Any) -> None:
        for action, message, kw in self.done:
            if action == "complete":
                await receiver.complete_message(message)
            elif action == "abandon":
                await receiver.abandon_message(message)
            else:
                await receiver.dead_letter_message(message, **kw)
