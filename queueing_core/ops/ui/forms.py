"""What the dashboard's forms and links carry, read and checked like the API's own parameters."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, ValidationError
from starlette.requests import Request

from ...errors import InvalidArgument
from ...tracking import MessageQuery
from ..api import Printable, UtcTime
from ..models import QUEUE_NAME, STATUS_NAME, TYPE_NAME, distinct_statuses

#: a form body larger than this is not one of ours (the enqueue form is the largest)
MAX_FORM = 256 * 1024
MAX_FIELDS = 64
FILTERS = ("queue", "type", "status", "created_from", "created_to", "archived", "correlation_id")


class Filters(BaseModel):
    """The filters of ``GET messages``, from a query string or a form."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue: Annotated[str, StringConstraints(pattern=QUEUE_NAME)] | None = None
    type: Annotated[str, StringConstraints(pattern=TYPE_NAME)] | None = None
    status: Annotated[
        tuple[Annotated[str, StringConstraints(pattern=STATUS_NAME)], ...], AfterValidator(distinct_statuses)
    ] = ()
    created_from: UtcTime | None = None
    created_to: UtcTime | None = None
    archived: Literal["true", "false"] | None = None
    correlation_id: Printable | None = None

    def query(self) -> MessageQuery:
        return MessageQuery(
            queue=self.queue,
            type=self.type,
            status=self.status or None,
            created_from=self.created_from,
            created_to=self.created_to,
            archived=None if self.archived is None else self.archived == "true",
            correlation_id=self.correlation_id,
        )

    def pairs(self) -> list[tuple[str, str]]:
        """As query-string pairs (hidden fields, links to the next page)."""
        out: list[tuple[str, str]] = []
        for name in FILTERS:
            value = getattr(self, name)
            if name == "status":
                out += [("status", s) for s in value]
            elif isinstance(value, datetime):
                # whole: a filter carried on without its fraction of a second (to the bulk forms, the
                # next page) selects other messages than the list shown: a purge deletes more
                out.append((name, value.isoformat().replace("+00:00", "Z")))
            elif value is not None:
                out.append((name, value))
        return out

    def local_input(self, name: str) -> dict[str, str]:
        """``value`` and ``step`` of a time's datetime-local input (UTC, no offset). The input holds
        milliseconds at most, and only with a step under a second (else the browser refuses to send
        the form): a time with a fraction is shown to the millisecond, and carried on whole by
        :meth:`pairs`."""
        value = getattr(self, name)
        if not isinstance(value, datetime):
            return {"value": "", "step": "1"}
        if value.microsecond:
            return {"value": value.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3], "step": "0.001"}
        return {"value": value.strftime("%Y-%m-%dT%H:%M:%S"), "step": "1"}

    def describe(self) -> str:
        return ", ".join(f"{k} = {v}" for k, v in self.pairs()) or "no filter (every message)"

    def url(self, **extra: str) -> str:
        return urlencode([*self.pairs(), *extra.items()])


def read_filters(pairs: list[tuple[str, str]], *, allowed: frozenset[str] = frozenset()) -> Filters:
    """Filters from form or query pairs: empty fields are left out (a form sends them), unknown names
    and repeated single values are refused, as the API refuses them."""
    values: dict[str, Any] = {}
    for name, value in pairs:
        if name in allowed:
            continue
        if name not in FILTERS:
            raise InvalidArgument(name[:64], "unknown parameter")
        if value == "":
            continue
        if name == "status":
            values["status"] = (*values.get("status", ()), value)
        elif name in values:
            raise InvalidArgument(name, "given more than once")
        else:
            values[name] = value
    try:
        return Filters.model_validate(values)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        field = ".".join(str(p) for p in first["loc"][:1])
        raise InvalidArgument(field, first["msg"]) from None


async def read_form(request: Request) -> list[tuple[str, str]]:
    """A urlencoded form body as pairs (no multipart: nothing here uploads files)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise InvalidArgument("body", "send the form as application/x-www-form-urlencoded")
    body = await request.body()
    if len(body) > MAX_FORM:
        raise InvalidArgument("body", f"the form exceeds {MAX_FORM} bytes")
    try:
        return parse_qsl(
            body.decode("utf-8"), keep_blank_values=True, strict_parsing=False, max_num_fields=MAX_FIELDS
        )
    except (UnicodeDecodeError, ValueError):
        raise InvalidArgument("body", "not a form this page sends") from None


def one(pairs: list[tuple[str, str]], name: str, default: str = "") -> str:
    values = [v for k, v in pairs if k == name]
    if len(values) > 1:
        raise InvalidArgument(name, "given more than once")
    return values[0] if values else default
