"""Load a :class:`QueueingApp` from ``MODULE:ATTR`` (like uvicorn's app strings)."""

from __future__ import annotations

import importlib
import os
import sys

from .app import QueueingApp
from .errors import ConfigurationError


def load_app(spec: str, *, setting: str = "--app") -> QueueingApp:
    """Import ``module:attr``; a bad spec raises :class:`ConfigurationError` naming ``setting``.

    Registration errors (a duplicate handler, say) raised while importing propagate unchanged so
    the caller can report them as what they are.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(
            setting, f"{spec!r} is not MODULE:ATTR", "e.g. queueing_core.examples.orders:app"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # apps usually live in the project the command runs from
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ConfigurationError(setting, f"cannot import module {module_name!r}: {exc}") from None
        raise
    try:
        app = getattr(module, attr)
    except AttributeError:
        raise ConfigurationError(setting, f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(app, QueueingApp):
        raise ConfigurationError(setting, f"{spec} is a {type(app).__name__}, not a QueueingApp")
    return app
