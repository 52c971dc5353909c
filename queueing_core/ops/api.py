"""The HTTP operations API under ``/api/_system/queueing``.

Layers, outermost first: :class:`~.problems.ErrorBoundary` (anything unexpected: one logged 500),
:class:`~.guard.Guard` (authentication and cross-site rules, before anything else answers),
:class:`BodyLimit` (413 before parsing), then the routes. Every error is RFC 9457 problem details
(``application/problem+json``); no answer echoes the request's body.
"""

import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from fastapi import APIRouter, Body, Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import APIKeyHeader, HTTPBearer
from pydantic import AfterValidator, BeforeValidator, Field, StringConstraints
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..clock import to_utc
from ..errors import QueueingError
from ..messages import non_finite
from ..tracking import MessageQuery
from .guard import ApiKeyHeaders, Credential, Guard, LocalOnly, is_json
from .models import (
    MAX_STATUSES,
    QUEUE_NAME,
    SCHEDULE_NAME,
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
    ScheduleInfo,
    StatusUpdate,
    StatusUpdateResult,
    SubscriptionInfo,
    Summary,
    distinct_statuses,
)
from .problems import PROBLEM, ErrorBoundary, kit_problem, problem, without_input
from .prometheus import CONTENT_TYPE
from .service import BodyInvalid, OpsService

PREFIX = "/api/_system/queueing"
DEFAULT_MAX_BODY = 256 * 1024  # Service Bus standard's message size
MAX_BATCH = 1000
#: query parameters a host adds on its own (the Azure Functions key travels as ``code``)
HOST_PARAMETERS = frozenset({"code"})
#: text a filter may hold: no control characters (PostgreSQL refuses NUL in text; none belongs there)
PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(?:[Tt ].*)?")


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
            "body-too-large",
            f"the body exceeds {self.limit} bytes (QUEUEING_API_MAX_BODY_BYTES)",
            instance=scope["path"],
        )
        await response(scope, receive, send)


def _problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    ref = {"$ref": "#/components/schemas/Problem"}
    return {code: {"description": "problem details", "content": {PROBLEM: {"schema": ref}}} for code in codes}


def _one_or_many(value: Any) -> Any:
    """A single body becomes a list of one; anything but an object or a list is refused by name."""
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list):
        return value
    raise PydanticCustomError(
        "body_shape", "Input should be a JSON object or a list of 1 to {max} objects", {"max": MAX_BATCH}
    )


JsonObject = dict[str, Any]
Batch = Annotated[list[JsonObject], Field(min_length=1, max_length=MAX_BATCH)]
#: an object or a list of them; errors name the real problem (too many items, item 3 not an object)
Bodies = Annotated[Batch, BeforeValidator(_one_or_many, json_schema_input_type=JsonObject | Batch)]
#: a flag is exactly `true` or `false`: `all=yes` must not purge everything
Flag = Literal["true", "false"]


def _iso_8601(value: Any) -> Any:
    # pydantic would also read `0.5` or `1700000000` as seconds since 1970: a filter that decides what
    # a purge deletes takes the documented form only
    if isinstance(value, str) and not ISO_DATE.fullmatch(value):
        raise PydanticCustomError("iso_8601", "Input should be an ISO 8601 date or date-time")
    return value


#: times in filters are compared with stored UTC times; without an offset a time is UTC
UtcTime = Annotated[datetime, BeforeValidator(_iso_8601), AfterValidator(to_utc)]
Printable = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=PRINTABLE)]


def refuse_non_finite(bodies: Sequence[dict[str, Any]]) -> None:
    """Bodies holding NaN or an infinity are refused (422, each place named), before validation: the
    JSON parser takes ``NaN``, ``Infinity`` and ``1e999``, a float field takes them, and the store then
    keeps null (SQLite) or refuses the row (PostgreSQL): the message would not arrive as sent."""
    errors = [
        {
            "type": "finite_number",
            "loc": ["body", *([index] if len(bodies) > 1 else []), *path],
            "msg": "Input should be a finite number: JSON has no NaN or Infinity",
        }
        for index, item in enumerate(bodies)
        for path in non_finite(item)
    ]
    if errors:
        raise BodyInvalid(errors)


def create_app(
    ops: OpsService | Callable[[], Awaitable[OpsService]],
    *,
    api_key: str | None,
    local: LocalOnly | None = None,
    credentials: tuple[Credential, ...] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY,
    prefix: str = PREFIX,
) -> FastAPI:
    """The API over ``ops`` (or a coroutine function building it on first use, for serverless hosts).

    With ``api_key`` every request needs it. Without one, every request is refused with 401 unless
    ``local`` allows keyless requests from this machine (``queueing serve`` on loopback).
    ``credentials`` adds other ways to sign in (a browser session) beside the key.
    """
    app = FastAPI(
        title="queueing-kit operations API",
        version="1",
        description="Inspect and steer the queues: statistics, messages, retry, archive, purge, "
        "pause/resume, circuits, and enqueue over HTTP.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        # a redirect would be built from the request's Host header; `/stats/` is simply not found
        redirect_slashes=False,
    )
    cached: dict[str, OpsService] = {}

    async def service() -> OpsService:
        if isinstance(ops, OpsService):
            return ops
        if "ops" not in cached:
            cached["ops"] = await ops()
        return cached["ops"]

    # The Guard checks credentials before routing; these declare them in the OpenAPI document.
    header_key = APIKeyHeader(
        name="X-API-Key", auto_error=False, description="The API key (QUEUEING_API_KEY)"
    )
    bearer = HTTPBearer(auto_error=False, description="The API key as a bearer token")

    def documented(_key: Any = Security(header_key), _token: Any = Security(bearer)) -> None:
        pass

    # (method, path) -> (query parameters it takes, those that may repeat); from the OpenAPI document
    declared: dict[tuple[str, str], tuple[frozenset[str], frozenset[str]]] = {}

    def no_stray_parameters(request: Request) -> None:
        """Unknown and repeated single-valued query parameters are refused: with `stauts=Pending` or
        `queue=a&queue=b`, a purge would otherwise delete more than the caller meant."""
        route = request.scope.get("route")
        nothing: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        # (path_format: the path as the OpenAPI document writes it, "{queueName:path}" as "{queueName}")
        known, repeatable = declared.get((request.method, getattr(route, "path_format", "")), nothing)
        errors = []
        for name in dict.fromkeys(request.query_params.keys()):
            if name not in known and name not in HOST_PARAMETERS:
                errors.append({"type": "unknown", "loc": ["query", name[:64]], "msg": "unknown parameter"})
            elif name not in repeatable and len(request.query_params.getlist(name)) > 1:
                errors.append({"type": "repeated", "loc": ["query", name], "msg": "given more than once"})
        if errors:
            raise RequestValidationError(errors)

    def json_body(request: Request) -> None:
        types = request.headers.getlist("content-type")
        if len(types) != 1 or not is_json(types[0]):
            raise StarletteHTTPException(415, "send the body as `Content-Type: application/json`")

    Ops = Annotated[OpsService, Depends(service)]
    keyless = api_key is None and not credentials and local is not None
    router = APIRouter(
        prefix=prefix,
        # the document declares the key only where one is asked for
        dependencies=[*([] if keyless else [Depends(documented)]), Depends(no_stray_parameters)],
        responses=_problems(400, 401, 403, 422, 500, 503),
    )
    QueueName = Annotated[str, Path(pattern=QUEUE_NAME, description="a queue name (see subscriptions)")]
    TypeName = Annotated[str, Path(pattern=TYPE_NAME, description="a message type name")]
    MessageId = Annotated[UUID, Path(description="the message id")]

    def filters(
        queue: Annotated[str | None, Query(pattern=QUEUE_NAME)] = None,
        type: Annotated[str | None, Query(pattern=TYPE_NAME)] = None,
        status: Annotated[
            Annotated[
                list[Annotated[str, StringConstraints(pattern=STATUS_NAME)]],
                AfterValidator(distinct_statuses),
            ]
            | None,
            Query(
                description="repeat for several (at most "
                f"{MAX_STATUSES} different ones); `Archived` selects archived messages. SQL accepts "
                "custom statuses; the other providers only the kit's and the queues' default statuses"
            ),
        ] = None,
        created_from: Annotated[UtcTime | None, Query(description="inclusive; UTC without an offset")] = None,
        created_to: Annotated[UtcTime | None, Query(description="exclusive; UTC without an offset")] = None,
        archived: Annotated[Flag | None, Query(description="exactly `true` or `false`")] = None,
        correlation_id: Annotated[Printable | None, Query()] = None,
    ) -> MessageQuery:
        return MessageQuery(
            queue=queue,
            type=type,
            status=tuple(status) if status else None,
            created_from=created_from,
            created_to=created_to,
            archived=None if archived is None else archived == "true",
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
        cursor: Annotated[str | None, Query(max_length=512, description="the next_cursor last given")] = None,
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
        "/messages/{id}/cancel",
        response_model=ActionResult,
        responses=_problems(404, 409),
        summary="Cancel by message id (else the newest with that tracking id): a waiting message never "
        "runs, a running one is told to stop",
    )
    async def cancel(ops: Ops, id: MessageId) -> ActionResult:
        return await ops.cancel(id)

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
        summary="Delete the messages that match the filters (never those a worker holds); all=true with "
        "the queue alone empties that queue whole",
        responses=_problems(404),  # a queue the app does not have
    )
    async def purge(
        ops: Ops,
        query: Filters,
        all: Annotated[
            Flag,
            Query(
                description="exactly `true`: with no filter, purge everything; with the queue alone, empty "
                "that queue whole on its transport (messages without history too, and those a worker "
                "holds where the transport's purge takes them)"
            ),
        ] = "false",
    ) -> PurgeResult:
        if query == MessageQuery() and all != "true":
            raise RequestValidationError(
                [
                    {
                        "type": "missing",
                        "loc": ["query"],
                        "msg": "give at least one filter, or all=true to purge everything",
                    }
                ]
            )
        # a queue alone, without all=true, is purged message by message, as every other filter is
        return await ops.purge(query, whole=all == "true" and query != MessageQuery())

    @router.post("/queues/{queueName:path}/pause", response_model=PauseResult, responses=_problems(404))
    async def pause_queue(ops: Ops, queueName: QueueName) -> PauseResult:
        return await ops.set_paused("queue", queueName, True)

    @router.post("/queues/{queueName:path}/resume", response_model=PauseResult, responses=_problems(404))
    async def resume_queue(ops: Ops, queueName: QueueName) -> PauseResult:
        return await ops.set_paused("queue", queueName, False)

    @router.post("/types/{type}/pause", response_model=PauseResult, responses=_problems(404))
    async def pause_type(ops: Ops, type: TypeName) -> PauseResult:
        return await ops.set_paused("type", type, True)

    @router.post("/types/{type}/resume", response_model=PauseResult, responses=_problems(404))
    async def resume_type(ops: Ops, type: TypeName) -> PauseResult:
        return await ops.set_paused("type", type, False)

    @router.get(
        "/metrics",
        response_class=PlainTextResponse,
        summary="Prometheus metrics: counts by queue and status (as stats), handled messages, lag",
        responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def metrics(ops: Ops) -> PlainTextResponse:
        return PlainTextResponse(await ops.prometheus(), media_type=CONTENT_TYPE)

    ScheduleName = Annotated[str, Path(pattern=SCHEDULE_NAME, description="a schedule name")]

    @router.get(
        "/schedules", response_model=list[ScheduleInfo], summary="Recurring schedules and their ticks"
    )
    async def schedules(ops: Ops) -> list[ScheduleInfo]:
        return await ops.schedules()

    @router.post("/schedules/{name}/pause", response_model=PauseResult, responses=_problems(404))
    async def pause_schedule(ops: Ops, name: ScheduleName) -> PauseResult:
        return await ops.set_schedule_paused(name, True)

    @router.post("/schedules/{name}/resume", response_model=PauseResult, responses=_problems(404))
    async def resume_schedule(ops: Ops, name: ScheduleName) -> PauseResult:
        return await ops.set_schedule_paused(name, False)

    @router.post("/types/{type}/circuit/reset", response_model=CircuitResetResult, responses=_problems(404))
    async def reset_circuit(ops: Ops, type: TypeName) -> CircuitResetResult:
        await ops.reset_circuit(type)
        return CircuitResetResult(type=type)

    @router.post(
        "/queues/{queueName:path}/status",
        response_model=StatusUpdateResult,
        responses=_problems(404, 409, 415),
        dependencies=[Depends(json_body)],
        summary="Set a status on the queue's messages whose body property compares to a value (SQL)",
    )
    async def update_status(ops: Ops, queueName: QueueName, change: StatusUpdate) -> StatusUpdateResult:
        return await ops.update_status_where(queueName, change)

    @router.post(
        "/queues/{queueName:path}/messages",
        response_model=EnqueueResult,
        status_code=201,
        responses=_problems(404, 413, 415),
        dependencies=[Depends(json_body)],
        summary="Enqueue one message or a list (validated against the model)",
    )
    async def enqueue(
        ops: Ops,
        queueName: QueueName,
        body: Annotated[Bodies, Body(description=f"a message body, or a list of 1 to {MAX_BATCH}")],
        delay_seconds: Annotated[float | None, Query(ge=0, le=366 * 86400)] = None,
        correlation_id: Annotated[Printable | None, Query()] = None,
    ) -> EnqueueResult:
        ops.queue(queueName)  # an unknown queue is a 404 whatever the body holds
        refuse_non_finite(body)
        items = await ops.enqueue(queueName, body, delay=delay_seconds, correlation_id=correlation_id)
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
    app.openapi_schema = schema  # app.openapi() is the document served
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            params = [p for p in operation.get("parameters", []) if p["in"] == "query"]
            declared[(method.upper(), path)] = (
                frozenset(p["name"] for p in params),
                frozenset(p["name"] for p in params if _is_array(p["schema"])),
            )
    declared[("GET", f"{prefix}/openapi.json")] = (frozenset(), frozenset())

    @app.exception_handler(QueueingError)
    async def kit_error(request: Request, exc: QueueingError) -> JSONResponse:
        return kit_problem(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = without_input(list(exc.errors()))
        first = errors[0] if errors else {}
        field = ".".join(str(p) for p in first.get("loc", []))
        return problem(
            422,
            "invalid-request",
            f"{field}: {first.get('msg', 'invalid')}",
            title="Invalid request",
            instance=request.url.path,
            errors=errors,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404/405 from routing (after the Guard), 415 from json_body, 400 for a body that fails to parse
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:  # Starlette names the methods of the first route matched only
            headers = {"Allow": ", ".join(_allowed(declared, request.url.path))}
        return problem(
            exc.status_code,
            {404: "not-found", 405: "method-not-allowed", 415: "unsupported-media-type"}.get(
                exc.status_code, "bad-request"
            ),
            str(exc.detail),
            instance=request.url.path,
            headers=headers,
        )

    from .ui import Dashboard  # imports this module's parameter types

    ui = Dashboard(service, api_key=api_key, local=local, prefix=prefix)
    ui.install(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    keys: tuple[Credential, ...] = (ApiKeyHeaders(api_key),) if api_key is not None else ()
    app.add_middleware(
        Guard,
        credentials=keys + ui.credentials + credentials,
        local=None if api_key is not None else local,
        public=ui.public,
        render=ui.render,
    )
    app.add_middleware(ErrorBoundary)
    return app


def _allowed(declared: Iterable[tuple[str, str]], path: str) -> list[str]:
    """Every method the document declares for this path (the ``Allow`` header of a 405)."""

    def pattern(template: str) -> str:  # `{id}` matches one path segment; the rest literally
        return "[^/]+".join(re.escape(part) for part in re.split(r"\{[^}]+\}", template))

    return sorted({method for method, template in declared if re.fullmatch(pattern(template), path)})


def _is_array(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "array" or any(_is_array(s) for s in schema.get("anyOf", []))
