"""The dashboard's pages and actions. Every action calls the ops service the API's routes call."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any
from uuid import UUID

from fastapi import Path, Request
from fastapi.responses import Response

from ...errors import InvalidArgument, InvalidOperation, MessageNotFound, MessageTooLarge, ProviderError
from ...providers.dead_letters import whole_queue
from ...tracking import Activity, ActivitySource
from ..api import refuse_non_finite
from ..models import QUEUE_NAME, TYPE_NAME, ActionResult, MessageDetail, QueueSummary
from ..service import BodyInvalid, OpsService, PurgesWithHistory
from . import charts
from .activity import ActivityWindow
from .forms import Filters, one, read_filters, read_form

if TYPE_CHECKING:
    from .dashboard import Dashboard

log = logging.getLogger("queueing.api")

#: the kit's errors an operator can act on: shown on the page, as the API shows them as problems
SHOWN = (MessageNotFound, InvalidOperation, InvalidArgument, MessageTooLarge)
SLOTS, SLOT_SECONDS = 12, 300  # the last hour in five-minute slots
PAGE_SIZE = 50
#: a bulk action covers at most this many messages; more must be narrowed down (or use the API)
MAX_BULK = 10_000
QueueName = Annotated[str, Path(pattern=QUEUE_NAME)]
TypeName = Annotated[str, Path(pattern=TYPE_NAME)]


def span(seconds: float) -> str:
    """A duration as an operator reads it: 40 s, 3 min, 2.5 h, 4 d."""
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} d"


def queue_row(q: QueueSummary, activity: Activity | None, now: datetime) -> dict[str, Any]:
    row: dict[str, Any] = {"q": q, "activity": activity is not None}
    if activity is None:
        return row
    ok = activity.succeeded.get(q.queue, [0] * SLOTS)
    bad = activity.failed.get(q.queue, [0] * SLOTS)
    latency = activity.latency.get(q.queue, [None] * SLOTS)
    done, failed = sum(ok), sum(bad)
    row["throughput_text"] = f"{done} succeeded, {failed} ended otherwise in the last hour"
    row["throughput"] = charts.bars(ok, bad, row["throughput_text"])
    known = [v for v in latency if v is not None]
    last = next((v for v in reversed(latency) if v is not None), None)
    row["latency_text"] = (
        f"enqueue to settled: latest {span(last)}, at most {span(max(known))} in the last hour"
        if last is not None and known
        else "nothing settled in the last hour"
    )
    row["latency"] = charts.line(latency, row["latency_text"])
    due = activity.oldest_due.get(q.queue)
    row["waiting"] = span(max((now - due).total_seconds(), 0)) if due is not None else None
    return row


async def overview_context(ops: OpsService, window: ActivityWindow) -> dict[str, Any]:
    summary = await ops.summary()
    now = ops.clock()
    tracker = ops.runtime.tracker
    activity = None
    if isinstance(tracker, ActivitySource):
        activity = await window.read(tracker, [q.queue for q in summary.queues], now)
    return {"summary": summary, "rows": [queue_row(q, activity, now) for q in summary.queues]}


@dataclass(frozen=True)
class Selection:
    """What a bulk action's filters select: the messages' ids (None for a damaged row whose id does
    not read: counted, a purge deletes it too), whether there are more than MAX_BULK, and a digest of
    which messages they are and in what state, which the confirmation carries to the run."""

    ids: list[UUID | None]
    more: bool
    digest: str


async def matching(ops: OpsService, filters: Filters) -> Selection:
    """The messages the filters select now (at most MAX_BULK)."""
    ids: list[UUID | None] = []
    states: list[str] = []
    cursor = None
    while True:
        page = await ops.list_messages(filters.query(), limit=500, cursor=cursor)
        for m in page.items:
            ids.append(m.message_id)
            # a damaged row by its stored id text: two damaged rows are not the same row
            key = str(m.message_id) if m.message_id is not None else (m.stored or {}).get("message_id", "")
            # its state too: a message retried or archived since the confirmation is not the one
            # the operator confirmed (a retry refuses some states, a purge leaves held ones)
            states.append(f"{key}\x1f{m.status}\x1f{m.archived}")
        if len(ids) > MAX_BULK:
            return Selection(ids[:MAX_BULK], True, "")
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    digest = hashlib.sha256("\n".join(sorted(states)).encode()).hexdigest()
    return Selection(ids, False, digest)


def timeline(m: MessageDetail) -> list[tuple[datetime, str]]:
    """The times the message's record holds, in order: what happened to it and when."""
    events = [
        (m.created_at, "Enqueued"),
        (m.not_before, "Due (delayed until)"),
        (m.updated_at, f"Last change: {m.status}" + (f" ({m.reason})" if m.reason else "")),
        (m.locked_until, f"Lease held by {m.locked_by} until"),
        (m.expires_at, "Expires"),
        (m.archived_at, "Archived"),
    ]
    return sorted(((at, what) for at, what in events if at is not None), key=lambda e: e[0])


def add_pages(ui: Dashboard) -> None:
    r, base, page = ui.router, ui.base, ui.page
    window = ActivityWindow(SLOTS, SLOT_SECONDS)

    async def ops() -> OpsService:
        return await ui.service()

    def actions_of(service: OpsService) -> dict[str, Callable[[UUID], Awaitable[ActionResult]]]:
        return {
            "retry": service.retry,
            "archive": service.archive,
            "release": service.release_lease,
            "cancel": service.cancel,
        }

    # -- overview ------------------------------------------------------------------------------------
    @r.get(f"{base}/")
    async def overview(request: Request) -> Response:
        return page(request, "overview.html", **await overview_context(await ops(), window))

    @r.get(f"{base}/overview")
    async def overview_part(request: Request) -> Response:
        return page(request, "_overview.html", **await overview_context(await ops(), window))

    async def control(request: Request, act: Callable[[OpsService], Awaitable[Any]], done: str) -> Response:
        service = await ops()
        flash: str | None = done
        error: str | None = None
        try:
            await act(service)
        except SHOWN as exc:
            flash, error = None, str(exc)
        context = await overview_context(service, window)
        return page(request, "_overview.html", flash=flash, error=error, **context)

    @r.post(f"{base}/queues/{{name:path}}/pause")
    async def pause_queue(request: Request, name: QueueName) -> Response:
        return await control(request, lambda o: o.set_paused("queue", name, True), f"Queue {name} paused")

    @r.post(f"{base}/queues/{{name:path}}/resume")
    async def resume_queue(request: Request, name: QueueName) -> Response:
        return await control(request, lambda o: o.set_paused("queue", name, False), f"Queue {name} resumed")

    @r.post(f"{base}/types/{{name}}/pause")
    async def pause_type(request: Request, name: TypeName) -> Response:
        return await control(request, lambda o: o.set_paused("type", name, True), f"Type {name} paused")

    @r.post(f"{base}/types/{{name}}/resume")
    async def resume_type(request: Request, name: TypeName) -> Response:
        return await control(request, lambda o: o.set_paused("type", name, False), f"Type {name} resumed")

    @r.post(f"{base}/types/{{name}}/circuit/reset")
    async def reset_circuit(request: Request, name: TypeName) -> Response:
        return await control(request, lambda o: o.reset_circuit(name), f"Circuit of {name} closed")

    # -- messages ------------------------------------------------------------------------------------
    @r.get(f"{base}/messages")
    async def messages(request: Request) -> Response:
        service = await ops()
        pairs = list(request.query_params.multi_items())
        context: dict[str, Any] = {
            "queues": [s.queue for s in service.app.subscriptions()],
            "types": [s.type_name for s in service.app.subscriptions()],
            "statuses": sorted(service.known_statuses()),
            "filters": Filters(),
            "items": [],
            "next": None,
            "error": None,
        }
        try:
            filters = read_filters(pairs, allowed=frozenset({"cursor"}))
            context["filters"] = filters
            cursor = one(pairs, "cursor") or None
            if cursor is not None and len(cursor) > 512:
                raise InvalidArgument("cursor", "not a cursor from a previous page")
            found = await service.list_messages(filters.query(), limit=PAGE_SIZE, cursor=cursor)
        except SHOWN as exc:
            context["error"] = str(exc)
            return page(request, "messages.html", 422, **context)
        context["items"] = found.items
        context["next"] = filters.url(cursor=found.next_cursor) if found.next_cursor else None
        context["first_page"] = cursor is None
        return page(request, "messages.html", **context)

    async def detail_context(service: OpsService, message_id: UUID) -> dict[str, Any]:
        m = await service.message(message_id)
        content = await service.content(message_id)
        return {
            "m": m,
            "body": _pretty(content.body),
            "raw": content.raw,
            "result": _pretty(m.result),
            "timeline": timeline(m),
            "actions": list(actions_of(service)),
        }

    @r.get(f"{base}/messages/{{message_id}}")
    async def detail(request: Request, message_id: str) -> Response:
        service = await ops()
        try:
            context = await detail_context(service, UUID(message_id))
        except (ValueError, MessageNotFound):
            return page(request, "not_found.html", 404, what=f"message {message_id[:64]}")
        return page(request, "detail.html", **context)

    @r.post(f"{base}/messages/{{message_id}}/{{action}}")
    async def act(request: Request, message_id: UUID, action: str) -> Response:
        service = await ops()
        run = actions_of(service).get(action)
        if run is None:
            return page(request, "not_found.html", 404, what=f"action {action[:32]}")
        flash, error = None, None
        try:
            flash = (await run(message_id)).detail
        except SHOWN as exc:
            error = str(exc)
        try:
            context = await detail_context(service, message_id)
        except MessageNotFound:
            return page(request, "not_found.html", 404, what=f"message {message_id}")
        return page(request, "_detail.html", flash=flash, error=error, **context)

    # -- bulk ----------------------------------------------------------------------------------------
    @r.post(f"{base}/bulk")
    async def bulk(request: Request) -> Response:
        service = await ops()
        try:
            form = await read_form(request)
            filters = read_filters(
                form, allowed=frozenset({"action", "step", "expected", "selection", "whole"})
            )
            action, step = one(form, "action"), one(form, "step", "confirm")
            if action not in ("retry", "purge") or step not in ("confirm", "run"):
                raise InvalidArgument("action", "retry or purge, to confirm or run")
            if action == "purge" and not filters.pairs():
                raise InvalidArgument("filters", "choose at least one filter before purging")
            # emptying the queue whole is its own button, offered for a queue alone: a purge of a queue
            # goes message by message otherwise, and leaves what a worker holds, as the page says
            whole = action == "purge" and one(form, "whole") == "true"
            if whole:
                whole_queue(filters.query())
            selection = await matching(service, filters)
        except SHOWN as exc:
            return page(request, "_bulk.html", 422, error=str(exc))
        ids = selection.ids
        context: dict[str, Any] = {
            "filters": filters,
            "action": action,
            "count": len(ids),
            "more": selection.more,
            "selection": selection.digest,
        }
        if action == "purge" and not isinstance(service.actions, PurgesWithHistory):
            # (on SQL every message is a row the purge takes by its id: emptying it whole is the same)
            with contextlib.suppress(InvalidArgument):
                context["empties"] = whole_queue(filters.query()).queue
                context["takes_held"] = service.runtime.provider.capabilities.purge_takes_held
        if selection.more:
            context["error"] = f"more than {MAX_BULK:,} messages match: narrow the filters"
            return page(request, "_bulk.html", 422, **context)
        expected = one(form, "expected")
        if step == "confirm" or one(form, "selection") != selection.digest:
            # what was confirmed is what is acted on: the same messages in the same states, not only
            # as many (one archived and another dead-lettered meanwhile kept the count, and the run
            # deleted a message the operator never saw). A selection that changed is confirmed again
            if step == "run":
                context["changed"] = True
                context["before"] = expected if expected.isascii() and expected.isdigit() else None
            return page(request, "_bulk.html", **context)
        if action == "purge":
            # (by the filters again: the service deletes by a query, not by a list of ids. The check
            # above leaves only the moment between it and the purge's own listing)
            purged = await service.purge(filters.query(), whole=whole)
            emptied = f"Emptied queue {filters.queue}: deleted" if whole else "Deleted"
            done = [f"{emptied} {purged.deleted} message(s)"]
            if purged.skipped_leased:
                done.append(f"{purged.skipped_leased} held by a worker were left alone")
            if purged.left_waiting:
                done.append(f"{purged.left_waiting} the transport could not remove stay (waiting ones run)")
            context["done"] = "; ".join(done)
            return page(request, "_bulk.html", **context)
        retried, refused = 0, []
        for message_id in ids:
            if message_id is None:
                refused.append("a damaged row whose message id does not read cannot be retried: purge it")
                continue
            try:
                await service.retry(message_id)
                retried += 1
            except SHOWN as exc:
                refused.append(str(exc))
            except ProviderError as exc:
                # the store or transport went away part-way: say how far it got (a problem page lost
                # the count of those retried); a repeat goes on, the retried ones being refused then
                left = len(ids) - retried - len(refused)
                stopped = f"; stopped with {left} not tried ({exc}): run it again for the rest"
                break
            except Exception:
                # a fault of this one message's (the newest first: stopping there would leave every
                # older one untried, on each repeat): the rest still go; the log has the details, the
                # page only its id (an error's text may quote the body's values)
                log.exception("dashboard bulk retry of message %s failed", message_id)
                refused.append(f"message {message_id}: failed unexpectedly (the server logged the details)")
        else:
            stopped = ""
        context["done"] = (
            f"Retried {retried} message(s)" + (f"; {len(refused)} refused" if refused else "") + stopped
        )
        context["refused"] = refused[:20]
        return page(request, "_bulk.html", **context)

    # -- enqueue -------------------------------------------------------------------------------------
    @r.get(f"{base}/enqueue")
    async def enqueue_index(request: Request) -> Response:
        return page(request, "enqueue_index.html", subs=(await ops()).subscriptions())

    def enqueue_context(service: OpsService, queue: str) -> dict[str, Any] | None:
        info = next((s for s in service.subscriptions() if s.queue == queue), None)
        if info is None:
            return None
        return {
            "info": info,
            "schema": json.dumps(info.json_schema, indent=2),
            "body": json.dumps(info.example if info.example is not None else {}, indent=2),
            "correlation_id": "",
            "delay": "",
        }

    @r.get(f"{base}/enqueue/{{queue:path}}")
    async def enqueue_form(request: Request, queue: QueueName) -> Response:
        context = enqueue_context(await ops(), queue)
        if context is None:
            return page(request, "not_found.html", 404, what=f"queue {queue}")
        return page(request, "enqueue.html", **context)

    @r.post(f"{base}/enqueue/{{queue:path}}")
    async def enqueue(request: Request, queue: QueueName) -> Response:
        service = await ops()
        context = enqueue_context(service, queue)
        if context is None:
            return page(request, "not_found.html", 404, what=f"queue {queue}")
        errors: list[str] = []
        try:
            form = await read_form(request)
            text, correlation, delay = one(form, "body"), one(form, "correlation_id"), one(form, "delay")
            context.update(body=text, correlation_id=correlation, delay=delay)
            bodies = _bodies(text)
            refuse_non_finite(bodies)
            seconds = _delay(delay)
            if correlation and (len(correlation) > 256 or not correlation.isprintable()):
                raise InvalidArgument("correlation_id", "at most 256 printable characters")
            sent = await service.enqueue(queue, bodies, delay=seconds, correlation_id=correlation or None)
        except BodyInvalid as exc:
            errors = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors[:50]]
        except SHOWN as exc:
            errors = [str(exc)]
        else:
            return page(request, "_enqueued.html", sent=sent, **context)
        return page(request, "_enqueue_form.html", 422, errors=errors, **context)


def _pretty(value: Any) -> str | None:
    return None if value is None else json.dumps(value, indent=2, ensure_ascii=False)


def _bodies(text: str) -> list[dict[str, Any]]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (nested deeper than the interpreter's stack goes)
        raise InvalidArgument("body", f"not JSON: {exc}") from None
    items = value if isinstance(value, list) else [value]
    if not items or len(items) > 1000 or not all(isinstance(i, dict) for i in items):
        raise InvalidArgument("body", "a JSON object, or a list of 1 to 1000 objects")
    return items


def _delay(text: str) -> float | None:
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise InvalidArgument("delay", "a number of seconds") from None
    if not 0 <= seconds <= 366 * 86400:
        raise InvalidArgument("delay", "between 0 and 366 days in seconds")
    return seconds
