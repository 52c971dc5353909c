"""Helpers to call Azure Functions the way the host does, with azure.functions objects."""

from __future__ import annotations

import json
import uuid
from typing import Any

import azure.functions as func
import pytest

from queueing_core.settings import QueueingSettings


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


def storage_settings(azurite: Any, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> QueueingSettings:
    """Storage Queues on Azurite, as an app's settings and connection say it, with names of its own."""
    tag = uuid.uuid4().hex[:8]
    monkeypatch.setenv("QueueingStorage", azurite.connection_string)
    return QueueingSettings(
        provider="storage_queue",
        queue_prefix=f"f{tag}-",
        control_table=f"ctl{tag}",
        tracker_table=f"hist{tag}",
        **settings,
    )
