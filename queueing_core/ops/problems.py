"""Problem details (RFC 9457): the one shape of every error the ops API answers.

Which of the kit's errors becomes which status lives here, once. The kit's own messages for a caller
(a refused action, an argument it cannot use) are the ``detail``; anything else is a 500 whose details
go to the log, once, and never to the client.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import (
    InvalidArgument,
    InvalidOperation,
    MessageNotFound,
    MessageTooLarge,
    MissingPermission,
    NotSupported,
    ProviderUnavailable,
    QueueingError,
)
from .models import Problem
from .service import BodyInvalid

log = logging.getLogger("queueing.api")

PROBLEM = "application/problem+json"
#: problem types are URNs: stable names a client can switch on, with no server behind them
TYPE_PREFIX = "urn:queueing-kit:problem:"
NOSNIFF = {"X-Content-Type-Options": "nosniff"}
#: at most this many validation errors are listed (a 1,000-item batch can have thousands)
MAX_ERRORS = 50

#: the kit's errors a caller can act on: (class, status, type, title); the first match wins
KIT_ERRORS: tuple[tuple[type[QueueingError], int, str, str], ...] = (
    (MessageNotFound, 404, "not-found", "Not found"),
    (NotSupported, 409, "not-supported", "Not supported by this transport"),
    (InvalidOperation, 409, "invalid-state", "Not allowed in the message's current state"),
    (MessageTooLarge, 413, "message-too-large", "Message too large"),
    (BodyInvalid, 422, "invalid-body", "Invalid message"),
    (InvalidArgument, 422, "invalid-argument", "Invalid argument"),
)


def problem(
    status: int,
    kind: str,
    detail: str | None = None,
    *,
    title: str | None = None,
    instance: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A problem response; ``kind`` names its type (``urn:queueing-kit:problem:<kind>``)."""
    shown = errors[:MAX_ERRORS] if errors is not None else None
    body = Problem(
        type=TYPE_PREFIX + kind,
        title=title or HTTPStatus(status).phrase,
        status=status,
        detail=detail,
        instance=instance,
        errors=shown,
        error_count=len(errors) if errors is not None and len(errors) > MAX_ERRORS else None,
    )
    # `instance` echoes the request's path (unauthenticated too): a browser must never read the
    # answer as anything but JSON
    return JSONResponse(
        body.model_dump(exclude_none=True),
        status_code=status,
        media_type=PROBLEM,
        headers={**NOSNIFF, **(headers or {})},
    )


def kit_problem(exc: QueueingError, instance: str) -> JSONResponse:
    """The answer to one of the kit's errors raised while serving a request."""
    for cls, status, kind, title in KIT_ERRORS:
        if isinstance(exc, cls):
            errors = getattr(exc, "errors", None)
            return problem(
                status,
                kind,
                str(exc),
                title=title,
                instance=instance,
                errors=without_input(errors) if errors is not None else None,
            )
    if isinstance(exc, MissingPermission):
        # the deployment lacks a role: the answer names the role to grant (no secret in it), the log too
        log.warning("ops API: the store refused for want of a right: %s", exc)
        return problem(503, "missing-permission", str(exc), title="Store refused", instance=instance)
    if isinstance(exc, ProviderUnavailable):
        # the reason names hosts and endpoints: the log has it, the client needs only "try again"
        log.warning("ops API: the queue store is unavailable: %s", exc)
        return problem(
            503,
            "store-unavailable",
            "the queue store cannot be reached now; try again shortly",
            title="Queue store unavailable",
            instance=instance,
            headers={"Retry-After": "5"},
        )
    return internal_error(exc, instance)


def internal_error(exc: BaseException, instance: str) -> JSONResponse:
    # %r: the path is the client's, and may hold line breaks meant to forge log lines
    log.error("ops API request for %r failed", instance, exc_info=exc)
    return problem(500, "internal", "the server logged the details", instance=instance)


def without_input(errors: list[Any]) -> list[dict[str, Any]]:
    """Validation errors as JSON, without the ``input`` pydantic attaches: an answer never echoes the
    request (a 260 KB body would come back doubled, and whatever it held with it)."""
    out = []
    for e in errors:
        item = {k: v for k, v in dict(e).items() if k not in ("input", "url")}
        if "ctx" in item:
            item["ctx"] = {k: str(v) for k, v in item["ctx"].items()}
        item["loc"] = [p if isinstance(p, int) else str(p) for p in item.get("loc", ())]
        out.append(item)
    return out


class ErrorBoundary:
    """Outermost: whatever escapes the app becomes one logged 500 problem, and nothing re-raises it,
    so the server (uvicorn, the Functions host) does not log it a second time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            response = internal_error(exc, scope.get("path", ""))
            if not started:  # past the status line there is nothing left to answer with
                await response(scope, receive, send)
