"""The HTTP operations API under ``/api/_system/queueing``.

Every route, the OpenAPI document included, requires the API key (``Authorization: Bearer <key>``
or ``X-API-Key: <key>``, compared in constant time). Errors are RFC 9457 problem details
(``application/problem+json``). Requests larger than ``max_body_bytes`` get 413 before any parsing.
"""

import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from fastapi import APIRouter, Body, Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InvalidOperation, MessageNotFound, MessageTooLarge, ProviderUnavailable
from ..tracking import MessageQuery
from .models import (
    QUEUE_NAME,
    STATUS_NAME,
    TYPE_NAME,
    ActionResult,
    CircuitResetResult,
    EnqueueResult,
    HealthReport,
    MessageContent,
    MessageDetail,
    MessagePage,
    MessageStats,
    MessageSummary,
    PauseResult,
    Problem,
    PurgeResult,
    SubscriptionInfo,
    Summary,
)
from .service import BodyInvalid, OpsService

log = logging.getLogger("queueing.api")

PREFIX = "/api/_system/queueing"
PROBLEM = "application/problem+json"
DEFAULT_MAX_BODY = 256 * 1024  # Service Bus standard's message size
MAX_BATCH = 1000


def problem(
    status: int,
    title: str,
    detail: str | None = None,
    *,
    instance: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = Problem(title=title, status=status, detail=detail, instance=instance, errors=errors)
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=PROBLEM, headers=headers
    )


def _problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": Problem, "content": {PROBLEM: {}}} for code in codes}


class Unauthorized(Exception):
    pass


class BodyLimit:
    """Refuse bodies over the limit: by Content-Length at once, or while streaming a chunked body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(scope, receive, send)
                return
        seen = 0
        chunks: list[Message] = []
        while True:  # buffer the body (bounded by the limit), then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await self._refuse(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = problem(
            413,
            "Request body too large",
            f"the body exceeds {self.limit} bytes (QUEUEING_API_MAX_BODY_BYTES)",
        )
        await response(scope, receive, send)


def create_app(
    ops: OpsService | Callable[[], Awaitable[OpsService]],
    *,
    api_key: str | None,
    allow_anonymous: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    prefix: str = PREFIX,
) -> FastAPI:
    """The API over ``ops`` (or a coroutine function building it on first use, for serverless hosts).

    Without ``api_key`` every request is refused with 401 unless ``allow_anonymous`` (which
    ``queueing serve`` sets only when it listens on loopback).
    """
    app = FastAPI(
        title="queueing-kit operations API",
        version="1",
        description="Inspect and steer the queues: statistics, messages, retry, archive, purge, "
        "pause/resume, circuits, and enqueue over HTTP.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    cached: dict[str, OpsService] = {}

    async def service() -> OpsService:
        if isinstance(ops, OpsService):
            return ops
        if "ops" not in cached:
            cached["ops"] = await ops()
        return cached["ops"]

    header_key = APIKeyHeader(
        name="X-API-Key", auto_error=False, description="The API key (QUEUEING_API_KEY)"
    )
    bearer = HTTPBearer(auto_error=False, description="The API key as a bearer token")

    async def authenticate(
        request: Request,
        _key: Annotated[str | None, Security(header_key)] = None,  # declared for the OpenAPI document
        _token: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
    ) -> None:
        if api_key is None:
            if allow_anonymous:
                return
            raise Unauthorized(
                "this API has no key configured (set QUEUEING_API_KEY); it refuses every request"
            )
        # Read the raw headers: a header that is present counts as a credential even when it is empty
        # or malformed, and every credential presented must be valid.
        supplied: list[str] = []
        if "x-api-key" in request.headers:
            supplied.append(request.headers["x-api-key"])
        if "authorization" in request.headers:
            scheme, _, credentials = request.headers["authorization"].partition(" ")
            supplied.append(credentials.strip() if scheme.lower() == "bearer" else "")
        if not supplied:
            raise Unauthorized("send the API key as `Authorization: Bearer <key>` or `X-API-Key: <key>`")
        if not all(c and hmac.compare_digest(c.encode(), api_key.encode()) for c in supplied):
            raise Unauthorized("the API key is not valid")

    Ops = Annotated[OpsService, Depends(service)]
    router = APIRouter(
        prefix=prefix, dependencies=[Depends(authenticate)], responses=_problems(400, 401, 422, 503)
    )
    QueueName = Annotated[str, Path(pattern=QUEUE_NAME, description="a queue name (see subscriptions)")]
    TypeName = Annotated[str, Path(pattern=TYPE_NAME, description="a message type name")]
    MessageId = Annotated[UUID, Path(description="the message id")]

    def filters(
        queue: Annotated[str | None, Query(pattern=QUEUE_NAME)] = None,
        type: Annotated[str | None, Query(pattern=TYPE_NAME)] = None,
        status: Annotated[
            list[Annotated[str, StringConstraints(pattern=STATUS_NAME)]] | None,
            Query(description="repeat for several; `Archived` selects archived messages"),
        ] = None,
        created_from: Annotated[datetime | None, Query(description="inclusive, ISO 8601")] = None,
        created_to: Annotated[datetime | None, Query(description="exclusive, ISO 8601")] = None,
        archived: Annotated[bool | None, Query()] = None,
        correlation_id: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    ) -> MessageQuery:
        return MessageQuery(
            queue=queue,
            type=type,
            status=tuple(status) if status else None,
            created_from=created_from,
            created_to=created_to,
            archived=archived,
            correlation_id=correlation_id,
        )

    Filters = Annotated[MessageQuery, Depends(filters)]

    @router.get(
        "/stats", response_model=Summary, summary="Summary of every queue: counts, pause, circuit, health"
    )
    async def stats(ops: Ops) -> Summary:
        return await ops.summary()

    @router.get(
        "/subscriptions",
        response_model=list[SubscriptionInfo],
        summary="Registered types, queues and options",
    )
    async def subscriptions(ops: Ops) -> list[SubscriptionInfo]:
        return ops.subscriptions()

    @router.get("/messages", response_model=MessagePage, summary="List messages, newest first")
    async def messages(
        ops: Ops,
        query: Filters,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        cursor: Annotated[str | None, Query(max_length=512)] = None,
    ) -> MessagePage:
        return await ops.list_messages(query, limit=limit, cursor=cursor)

    @router.get("/messages/stats", response_model=MessageStats, summary="Message counts by status and queue")
    async def message_stats(
        ops: Ops, queue: Annotated[str | None, Query(pattern=QUEUE_NAME)] = None
    ) -> MessageStats:
        return await ops.message_stats(queue)

    @router.get(
        "/messages/waiting",
        response_model=list[MessageSummary],
        summary="Messages not processed yet (pending, retrying, sleeping, paused, waiting for a handler)",
    )
    async def waiting(
        ops: Ops,
        take: Annotated[int, Query(ge=1, le=500)] = 50,
        queue: Annotated[str | None, Query(pattern=QUEUE_NAME)] = None,
    ) -> list[MessageSummary]:
        return await ops.waiting(take, queue)

    @router.get("/messages/{id}", response_model=MessageDetail, responses=_problems(404))
    async def message(ops: Ops, id: MessageId) -> MessageDetail:
        return await ops.message(id)

    @router.get("/messages/{id}/content", response_model=MessageContent, responses=_problems(404))
    async def content(ops: Ops, id: MessageId) -> MessageContent:
        return await ops.content(id)

    @router.post(
        "/messages/{id}/retry",
        response_model=ActionResult,
        responses=_problems(404, 409),
        summary="Process again with fresh attempts (dead-lettered, failed, expired, abandoned...)",
    )
    async def retry(ops: Ops, id: MessageId) -> ActionResult:
        return await ops.retry(id)

    @router.post(
        "/messages/{id}/lease/release",
        response_model=ActionResult,
        responses=_problems(404, 409),
        summary="Take a message back from the worker holding it",
    )
    async def release(ops: Ops, id: MessageId) -> ActionResult:
        return await ops.release_lease(id)

    @router.post("/messages/{id}/archive", response_model=ActionResult, responses=_problems(404, 409))
    async def archive(ops: Ops, id: MessageId) -> ActionResult:
        return await ops.archive(id)

    @router.delete(
        "/messages",
        response_model=PurgeResult,
        summary="Delete the messages that match the filters (never those a worker holds)",
    )
    async def purge(
        ops: Ops,
        query: Filters,
        all: Annotated[bool, Query(description="required to purge with no filter")] = False,
    ) -> PurgeResult:
        if query == MessageQuery() and not all:
            raise RequestValidationError(
                [
                    {
                        "type": "missing",
                        "loc": ["query"],
                        "input": None,
                        "msg": "give at least one filter, or all=true to purge everything",
                    }
                ]
            )
        return await ops.purge(query)

    @router.post("/queues/{queueName}/pause", response_model=PauseResult, responses=_problems(404))
    async def pause_queue(ops: Ops, queueName: QueueName) -> PauseResult:
        return await ops.set_paused("queue", queueName, True)

    @router.post("/queues/{queueName}/resume", response_model=PauseResult, responses=_problems(404))
    async def resume_queue(ops: Ops, queueName: QueueName) -> PauseResult:
        return await ops.set_paused("queue", queueName, False)

    @router.post("/types/{type}/pause", response_model=PauseResult, responses=_problems(404))
    async def pause_type(ops: Ops, type: TypeName) -> PauseResult:
        return await ops.set_paused("type", type, True)

    @router.post("/types/{type}/resume", response_model=PauseResult, responses=_problems(404))
    async def resume_type(ops: Ops, type: TypeName) -> PauseResult:
        return await ops.set_paused("type", type, False)

    @router.post("/types/{type}/circuit/reset", response_model=CircuitResetResult, responses=_problems(404))
    async def reset_circuit(ops: Ops, type: TypeName) -> CircuitResetResult:
        await ops.reset_circuit(type)
        return CircuitResetResult(type=type)

    @router.post(
        "/queues/{queueName}/messages",
        response_model=EnqueueResult,
        status_code=201,
        responses=_problems(404, 413),
        summary="Enqueue one message or a list (validated against the model)",
    )
    async def enqueue(
        ops: Ops,
        queueName: QueueName,
        body: Annotated[
            dict[str, Any] | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BATCH)],
            Body(description=f"a message body, or a list of 1 to {MAX_BATCH}"),
        ],
        delay_seconds: Annotated[float | None, Query(ge=0, le=366 * 86400)] = None,
        correlation_id: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    ) -> EnqueueResult:
        bodies = body if isinstance(body, list) else [body]
        items = await ops.enqueue(queueName, bodies, delay=delay_seconds, correlation_id=correlation_id)
        return EnqueueResult(enqueued=items)

    @router.get(
        "/health",
        response_model=HealthReport,
        summary="Health per queue: Unhealthy when dead-lettered or abandoned messages wait for a person",
        description="Always 200 with the status in the body: this reports the queues, not whether this "
        "process can serve (a load balancer must not drop an API host over one dead letter). The store "
        "being unreachable is a 503.",
    )
    async def health(ops: Ops) -> HealthReport:
        return await ops.health()

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(schema)

    app.include_router(router)
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = Problem.model_json_schema()

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return problem(
            401,
            "Unauthorized",
            str(exc),
            instance=request.url.path,
            headers={"WWW-Authenticate": 'Bearer realm="queueing"'},
        )

    @app.exception_handler(MessageNotFound)
    async def not_found(request: Request, exc: MessageNotFound) -> JSONResponse:
        return problem(404, "Not found", str(exc), instance=request.url.path)

    @app.exception_handler(InvalidOperation)
    async def conflict(request: Request, exc: InvalidOperation) -> JSONResponse:
        return problem(409, "Not allowed in the message's current state", str(exc), instance=request.url.path)

    @app.exception_handler(BodyInvalid)
    async def body_invalid(request: Request, exc: BodyInvalid) -> JSONResponse:
        return problem(
            422, "Invalid message", str(exc), instance=request.url.path, errors=_jsonable(exc.errors)
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = _jsonable(list(exc.errors()))
        first = errors[0] if errors else {}
        field = ".".join(str(p) for p in first.get("loc", []))
        return problem(
            422,
            "Invalid request",
            f"{field}: {first.get('msg', 'invalid')}",
            instance=request.url.path,
            errors=errors,
        )

    @app.exception_handler(MessageTooLarge)
    async def too_large(request: Request, exc: MessageTooLarge) -> JSONResponse:
        return problem(413, "Message too large", str(exc), instance=request.url.path)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return problem(422, "Invalid request", str(exc), instance=request.url.path)

    @app.exception_handler(ProviderUnavailable)
    async def unavailable(request: Request, exc: ProviderUnavailable) -> JSONResponse:
        return problem(503, "Queue store unavailable", str(exc), instance=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem(exc.status_code, str(exc.detail), instance=request.url.path)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        log.exception("ops API request %s %s failed", request.method, request.url.path)
        return problem(500, "Internal error", "the server logged the details", instance=request.url.path)

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    return app


def _jsonable(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic errors may carry exceptions or other objects in ``ctx``/``input``: make them JSON."""
    out = []
    for e in errors:
        item = dict(e)
        if "ctx" in item:
            item["ctx"] = {k: str(v) for k, v in item["ctx"].items()}
        if "input" in item and not isinstance(
            item["input"], str | int | float | bool | type(None) | list | dict
        ):
            item["input"] = str(item["input"])
        item.pop("url", None)
        out.append(item)
    return out
