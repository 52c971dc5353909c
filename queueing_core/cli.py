"""``queueing``: the command line for people at a terminal.

Exit codes: 0 ok; 1 the app or an operation failed (a duplicate handler, a refused action);
2 bad configuration or usage (one line naming the setting and what it accepts).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar
from uuid import UUID

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from . import __version__
from .app import QueueingApp
from .bootstrap import bootstrap, sql_provider, use_queue_naming
from .errors import (
    ConfigurationError,
    InvalidArgument,
    InvalidOperation,
    MessageNotFound,
    MessageTooLarge,
    NotConfigured,
    ProviderError,
    RegistrationError,
)
from .loader import load_app
from .logs import configure_logging
from .messages import QueueMessage, read_body
from .naming import Transport
from .runtime import Runtime
from .settings import QueueingSettings, load_settings
from .wording import counted
from .worker import Worker

if TYPE_CHECKING:
    from .ops.models import MessageDetail, PurgeResult
    from .ops.service import OpsService
    from .producer import EnqueueReceipt

T = TypeVar("T")

cli = typer.Typer(
    name="queueing",
    help="Run, inspect and steer queueing-kit apps.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help: rich's help table labels every option with a Python type (``<bool>``, ``<str>``)
    rich_markup_mode=None,
)
# wide enough for the tables when output goes to a file or a pipe (rich assumes 80 columns then).
# No markup and no emoji codes: what is printed holds stored text (a handler's error, "unknown sku
# [abc-1]") and the operator's own arguments, whose brackets and colons are text, not styling; the
# deliberate styling is built as rich Text (``styled``), table cells included.
out = Console(width=None if sys.stdout.isatty() else 200, markup=False, emoji=False)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200, markup=False, emoji=False)

AppOption = Annotated[
    str | None,
    typer.Option(
        "--app",
        metavar="MODULE:ATTR",
        help="MODULE:ATTR of your QueueingApp (default: QUEUEING_APP or the example app)",
    ),
]
ScheduleOption = Annotated[
    str | None, typer.Option("--schedule", metavar="NAME", help="A schedule instead (see `schedules`)")
]


def styled(label: str, style: str, text: str = "") -> Text:
    """``label`` in ``style``, then ``text`` as it is (no markup is read in either)."""
    return Text.assemble((label, style), (" " + text) if text else "")


def fail(message: str, code: int) -> NoReturn:
    err.print(styled("error:", "bold red", message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settings() -> QueueingSettings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        fail(str(exc), 2)


def app_from(spec: str | None, cfg: QueueingSettings) -> QueueingApp:
    try:
        # an error names where the spec came from: the option, else the setting (or its default)
        return load_app(spec, setting="--app") if spec else load_app(cfg.app, setting="QUEUEING_APP")
    except ConfigurationError as exc:
        fail(str(exc), 2)
    except RegistrationError as exc:
        fail(str(exc), 1)


def _version(value: bool) -> None:
    if value:
        out.print(f"queueing-kit {__version__}")
        raise typer.Exit()


@cli.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run, inspect and steer queueing-kit apps."""


def _seconds(td: object) -> str:
    if td is None:
        return "-"
    assert isinstance(td, timedelta)
    s = td.total_seconds()
    return f"{s / 3600:g}h" if s >= 3600 and s % 360 == 0 else f"{s:g}s"


@cli.command()
def check(
    app: AppOption = None,
    transport: Annotated[
        Transport | None,
        typer.Option(
            metavar="TRANSPORT",
            help="Show physical queue names for this transport: "
            + ", ".join(t.value for t in Transport)
            + " (default: QUEUEING_PROVIDER)",
        ),
    ] = None,
) -> None:
    """Load an app and report its queues, handlers and options; exit 1 on an invalid registration."""
    from .infra import check_names
    from .ops.models import NAME_RULES, QUEUE_NAME, TYPE_NAME

    cfg = settings()
    the_app = app_from(app, cfg)
    use_queue_naming(the_app, cfg)  # the physical names the hosts use, prefix and suffix included
    target = transport or Transport(cfg.provider)
    table = Table(title=f"{the_app.name}: {counted(len(the_app.subscriptions()), 'queue')} on {target.value}")
    for col in (
        "type",
        "queue",
        f"{target.value} name",
        "handler",
        "attempts",
        "concurrency",
        "time limit",
        "expires",
        "lease",
        "breaker",
    ):
        table.add_column(col)
    problems: list[str] = []
    warnings: list[str] = []
    try:
        # the check the hosts run before they open the queues (and the Functions app at indexing):
        # two queues sharing a name, or one named like another's dead-letter or poison queue
        # (as a worker does: a Service Bus name with a '/' is the Bicep's to refuse, `infra params`)
        check_names(the_app, (target,), deployed=False)
    except ConfigurationError as exc:
        problems.append(str(exc))
    for sub in the_app.subscriptions():
        name = sub.physical_queue(the_app.naming, target)
        if name != the_app.naming.prefix + sub.queue + the_app.naming.suffix:
            warnings.append(f"queue {sub.queue!r} is named {name!r} on {target.value} (sanitized)")
        if sub.handler is None:
            warnings.append(
                f"type {sub.type_name!r} has no handler here: its messages wait (WaitingForHandler)"
            )
        # registration takes any name; the ops API and dashboard refuse some (whitespace, control
        # characters, ...): said here, not refused, so that an app running with such a name still loads
        for kind, value, pattern in (("queue", sub.queue, QUEUE_NAME), ("type", sub.type_name, TYPE_NAME)):
            if not re.fullmatch(pattern, value):
                warnings.append(f"{kind} {value!r} cannot be named in the ops API or dashboard: {NAME_RULES}")
        o = sub.options
        table.add_row(
            sub.type_name,
            sub.queue,
            name,
            sub.handler.origin.split(" (")[0] if sub.handler else Text("none", style="yellow"),
            str(o.max_attempts),
            "1 (ordered)" if o.ordered else str(o.max_concurrency),
            _seconds(o.time_limit),
            _seconds(o.expiration),
            _seconds(o.lease_duration),
            f"{o.circuit_breaker.failure_threshold} fails/{_seconds(o.circuit_breaker.cooldown)}"
            if o.circuit_breaker
            else "-",
        )
    out.print(table)
    for w in warnings:
        out.print(styled("note:", "yellow", w), highlight=False)
    if problems:
        for p in problems:
            err.print(styled("invalid:", "bold red", p), highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    out.print(styled("ok", "green"))


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; the kit's errors become one clear line and an exit code."""
    try:
        return asyncio.run(coro)
    except (ConfigurationError, InvalidArgument, MessageTooLarge) as exc:
        # (a message over the transport's limit is a refused argument: `enqueue --json` can reach it)
        fail(str(exc), 2)
    except (ProviderError, NotConfigured) as exc:  # unreachable, refused, no right to it, ...
        fail(str(exc), 1)


def _where(cfg: QueueingSettings) -> str:
    if cfg.provider != "sql":
        return cfg.provider
    from .providers.sql.engine import redact  # SQLAlchemy only when the SQL provider is used

    return redact(cfg.database_url)


def _runtime(app: str | None) -> tuple[QueueingSettings, QueueingApp, Runtime]:
    cfg = settings()
    configure_logging(cfg.log_level, cfg.log_format)
    the_app = app_from(app, cfg)
    try:
        return cfg, the_app, bootstrap(the_app, cfg)
    except ConfigurationError as exc:
        fail(str(exc), 2)


@cli.command()
def serve(
    app: AppOption = None,
    host: Annotated[str, typer.Option(metavar="HOST", help="Interface for the ops API")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="PORT", help="Port for the ops API")] = 8080,
    api: Annotated[bool, typer.Option("--api/--no-api", help="Serve the ops API beside the worker")] = True,
) -> None:
    """Run a worker for every queue of the app (and the ops API) until SIGTERM/SIGINT."""
    cfg, the_app, runtime = _runtime(app)
    worker = Worker(
        runtime,
        worker_id=cfg.worker_id,
        shutdown_timeout=cfg.shutdown_timeout,
        poll_min=cfg.poll_min,
        poll_max=cfg.poll_max,
        prefetch=cfg.prefetch,
        receives_in_flight=cfg.receives_in_flight,
        schedule_grace=timedelta(seconds=cfg.schedule_grace_seconds),
        cancel_poll=cfg.cancel_poll,
    )
    where = _where(cfg)
    queues = len(the_app.subscriptions())
    out.print(
        Text.assemble(
            f"queueing {__version__}: app ",
            (the_app.name, "bold"),
            f" ({counted(queues, 'queue')}) on {where}",
        ),
        highlight=False,
    )
    _run(_serve(worker, cfg, host if api else None, port))


async def _serve(worker: Worker, cfg: QueueingSettings, host: str | None, port: int) -> None:
    from .serve import serve_worker_and_api

    await serve_worker_and_api(worker, cfg, host, port)


@cli.command()
def enqueue(
    type_name: Annotated[str, typer.Argument(metavar="TYPE", hidden=True)],
    json_body: Annotated[
        str | None, typer.Option("--json", metavar="JSON", help="The message as JSON")
    ] = None,
    example: Annotated[bool, typer.Option(help="Use the queue's example message")] = False,
    count: Annotated[
        int, typer.Option(min=1, max=10_000_000, metavar="N", help="How many copies (each a new message)")
    ] = 1,
    delay: Annotated[
        float | None, typer.Option(min=0, metavar="SECONDS", help="Seconds before the messages are due")
    ] = None,
    app: AppOption = None,
) -> None:
    """Enqueue messages of TYPE, a registered message type (see `queueing check`); a progress bar
    shows for large counts."""
    _, the_app, runtime = _runtime(app)
    sub = the_app.subscription(type_name)
    if sub is None:
        known = ", ".join(sorted(the_app.message_types)) or "none"
        fail(f"unknown message type {type_name!r}; known: {known}", 2)
    if (json_body is None) == (not example):
        fail("give the message with --json '{...}' or use --example", 2)
    if example:
        sample = sub.message_type.example()
        if sample is None:
            fail(f"{type_name} declares no example message", 2)
        body = sample.body()
    else:
        try:
            body = json.loads(json_body or "")
        except (ValueError, RecursionError) as exc:  # (nested deeper than the interpreter's stack goes)
            fail(f"--json is not JSON: {exc}", 2)
    try:
        read_body(sub.message_type, body)
    except ValidationError as exc:
        fail(f"the message does not match {type_name}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}", 2)
    if count > 1 and "message_id" in body:
        # every copy would carry that one id: one message at most, the others duplicates of it
        fail(
            "--json gives a message_id, so --count must be 1 (each copy is a new message with its own id)", 2
        )
    _run(_enqueue(runtime, sub.message_type, body, count, delay))


async def _enqueue(
    runtime: Runtime, mtype: type[QueueMessage], body: dict[str, Any], count: int, delay: float | None
) -> None:
    batch = 1000
    waiting = 0
    async with runtime:
        with Progress(
            TextColumn("{task.description}", style="progress.description", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            console=err,
            disable=count < batch,
            transient=False,
        ) as progress:
            task = progress.add_task(f"enqueue {mtype.type_name()}", total=count)
            done = 0
            outcomes: Counter[str] = Counter()
            while done < count:
                n = min(batch, count - done)
                msgs = [read_body(mtype, body) for _ in range(n)]
                receipts = await runtime.producer.enqueue_many(msgs, delay=delay)
                outcomes.update(r.outcome for r in receipts)
                done += n
                progress.update(task, advance=n)
            # the messages are sent; history the store did not take is written before exit or, failing
            # that, by the next process that opens this store (it is kept on disk): no reason to fail
            waiting = runtime.history.backlog
            if waiting:
                await runtime.history.settle(timeout=10.0)
                waiting = runtime.history.backlog
    if waiting:
        where = runtime.history.journal_path
        err.print(
            f"warning: every message was sent, but the history store did not take "
            f"{counted(waiting, 'record')}; "
            + (
                f"kept in {where} and written by the next queueing process on this machine"
                if where
                else "not kept"
            ),
            highlight=False,
        )
    out.print(
        _receipt_line(mtype.type_name(), receipts[0])
        if count == 1
        else _outcomes_line(mtype.type_name(), outcomes),
        highlight=False,
    )


#: what an enqueue did instead of writing a new message (the producer's outcomes): an idempotent
#: type's, or, on SQL, one whose message id is stored already
_NOT_NEW = {
    "discarded": "discarded: a message of the same identity and content was waiting; nothing was written",
    "replaced": "replaced: the waiting message of the same identity took this body",
    "duplicate": "duplicate: a message with this id is stored already; nothing was written",
}


def _receipt_line(type_name: str, receipt: EnqueueReceipt) -> str:
    """One enqueue, as the producer's receipt says it went: an idempotent type's enqueue may write
    nothing (discarded) or change the waiting message (replaced), and must not read as a new one."""
    if receipt.outcome == "discarded":  # the id is the waiting message's; the status is not read back
        return f"{type_name} {_NOT_NEW['discarded']} (waiting: {receipt.message_id})"
    if receipt.outcome == "replaced":
        superseded = f"; it supersedes {receipt.supersedes}" if receipt.supersedes else ""
        return f"{type_name} {receipt.message_id} {_NOT_NEW['replaced']}{superseded}"
    if receipt.outcome == "duplicate":
        return f"{type_name} {receipt.message_id} {_NOT_NEW['duplicate']}"
    return f"enqueued {type_name} {receipt.message_id} ({receipt.status})"


def _outcomes_line(type_name: str, outcomes: Counter[str]) -> str:
    """Many enqueues: how many wrote a new message, and how many an idempotent type discarded or
    replaced (``--count 3`` of one identity is one message, not three)."""
    line = f"enqueued {counted(outcomes['enqueued'], type_name + ' message')}"
    for outcome in ("discarded", "replaced", "duplicate"):
        if outcomes[outcome]:
            line += f"; {outcomes[outcome]:,} {_NOT_NEW[outcome]}"
    return line


@cli.command()
def stats(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    app: AppOption = None,
) -> None:
    """Messages per queue and status: every registered queue (empty ones too), then any others."""
    summary = _ops_call(app, lambda ops: ops.summary())
    counts: dict[str, dict[str, int]] = {}
    for q in summary.queues:  # two types may share a queue
        counts.setdefault(q.queue, {}).update(q.counts)
    counts.update(summary.other_queues)
    if json_out:
        out.print_json(data=counts)  # the counts of HTTP `GET stats`, by queue
        return
    statuses = sorted({st for c in counts.values() for st in c})
    table = Table(title="messages by queue and status")
    table.add_column("queue")
    for st in statuses:
        table.add_column(st, justify="right")
    for name, c in counts.items():
        table.add_row(name, *(str(c.get(st, 0)) for st in statuses))
    out.print(table)


def _ops_call(app: str | None, action: Callable[[OpsService], Awaitable[T]]) -> T:
    """Run one ops action through the same service the HTTP API uses; refusals exit 1, arguments the
    service refuses exit 2."""
    from .ops.service import OpsService

    _, _, runtime = _runtime(app)

    async def go() -> T:
        async with runtime:
            return await action(OpsService(runtime))

    try:
        return _run(go())
    except (MessageNotFound, InvalidOperation) as exc:
        fail(str(exc), 1)


def _set_paused(
    queue_name: str | None, type_name: str | None, schedule: str | None, app: str | None, paused: bool
) -> None:
    given = [(k, n) for k, n in (("queue", queue_name), ("type", type_name), ("schedule", schedule)) if n]
    if len(given) != 1:
        fail("name a queue (QUEUE), a type (--type TYPE) or a schedule (--schedule NAME)", 2)
    kind, name = given[0]
    if kind == "schedule":
        _ops_call(app, lambda ops: ops.set_schedule_paused(name, paused))
    else:
        _ops_call(app, lambda ops: ops.set_paused(kind, name, paused))
    out.print(f"{'paused' if paused else 'resumed'} {kind} {name}", highlight=False)


@cli.command()
def pause(
    queue_name: Annotated[str | None, typer.Argument(metavar="QUEUE", hidden=True)] = None,
    type_name: Annotated[
        str | None, typer.Option("--type", metavar="TYPE", help="Pause a message type instead")
    ] = None,
    schedule: ScheduleOption = None,
    app: AppOption = None,
) -> None:
    """Pause QUEUE, or a type with --type, on every host: its messages stay and wait, attempts are
    not used. A schedule (--schedule) enqueues nothing while paused, and resuming does not replay
    the ticks it passed."""
    _set_paused(queue_name, type_name, schedule, app, True)


@cli.command()
def resume(
    queue_name: Annotated[str | None, typer.Argument(metavar="QUEUE", hidden=True)] = None,
    type_name: Annotated[
        str | None, typer.Option("--type", metavar="TYPE", help="Resume a message type instead")
    ] = None,
    schedule: ScheduleOption = None,
    app: AppOption = None,
) -> None:
    """Resume QUEUE, or a type with --type, or a schedule with --schedule."""
    _set_paused(queue_name, type_name, schedule, app, False)


@cli.command()
def schedules(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    app: AppOption = None,
) -> None:
    """The app's recurring schedules: expression, time zone, catch-up, paused, last and next tick."""
    found = _ops_call(app, lambda ops: ops.schedules())
    if json_out:
        out.print_json(data=[s.model_dump(mode="json") for s in found])  # as HTTP `GET schedules`
        return
    table = Table(title="schedules")
    for column in ("name", "expression", "timezone", "catch-up", "paused", "last tick", "next tick"):
        table.add_column(column)
    for s in found:
        last = s.last_tick.isoformat() if s.last_tick else "-"
        row = (s.name, s.expression, s.timezone, s.catch_up, "yes" if s.paused else "no", last)
        table.add_row(*row, s.next_tick.isoformat())
    out.print(table)


@cli.command()
def retry(
    message_id: Annotated[UUID, typer.Argument(metavar="MESSAGE_ID", hidden=True)],
    app: AppOption = None,
) -> None:
    """Process message MESSAGE_ID again now, with fresh attempts: a dead-lettered, failed, expired,
    abandoned or cancelled message, one sleeping until a later time, or one held in a custom status
    (see set-status). A message that succeeded, is running or is waiting to run is refused."""
    result = _ops_call(app, lambda ops: ops.retry(message_id))
    out.print(f"{result.message_id}: {result.detail}", highlight=False)


@cli.command()
def cancel(
    message_id: Annotated[UUID, typer.Argument(metavar="ID", hidden=True)],
    app: AppOption = None,
) -> None:
    """Cancel the message whose message id is ID (else the newest whose tracking id is ID): if it has
    not started it never runs; if it is running, its handler is told to stop. A finished message
    cannot be cancelled."""
    result = _ops_call(app, lambda ops: ops.cancel(message_id))
    out.print(f"{result.message_id}: {result.status}: {result.detail}", highlight=False)


@cli.command("set-status")
def set_status(
    queue_name: Annotated[str, typer.Argument(metavar="QUEUE", hidden=True)],
    path: Annotated[
        str, typer.Option("--where", metavar="PATH", help="Body property, e.g. customer.country")
    ],
    value: Annotated[
        str,
        typer.Option("--value", metavar="JSON", help='Value to compare: JSON ("NO", 5, true, null) or text'),
    ],
    to: Annotated[str, typer.Option("--to", metavar="STATUS", help="The status to set")],
    op: Annotated[str, typer.Option("--op", help="eq, ne, lt, le, gt or ge")] = "eq",
    only: Annotated[
        list[str] | None, typer.Option("--status", metavar="STATUS", help="Only messages in this status")
    ] = None,
    app: AppOption = None,
) -> None:
    """Set STATUS on QUEUE's messages whose body property PATH compares to VALUE (SQL provider only):
    a custom status holds them out of processing, Pending puts them back, Cancelled ends them."""
    from .ops.models import StatusUpdate

    try:
        parsed: Any = json.loads(value)
    except (ValueError, RecursionError):
        parsed = value  # plain text, unquoted (the value is then refused as too long or kept as text)
    try:
        change = StatusUpdate.model_validate(
            {"where": {"path": path, "op": op, "value": parsed}, "set": to, "status": only or None}
        )
    except ValidationError as exc:
        fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()), 2)
    try:
        result = _ops_call(app, lambda ops: ops.update_status_where(queue_name, change))
    except InvalidArgument as exc:
        fail(str(exc), 2)
    out.print(
        f"{counted(result.updated, 'message')} on {result.queue} set to {result.status}", highlight=False
    )


@cli.command()
def show(
    message_id: Annotated[UUID, typer.Argument(metavar="ID", hidden=True)],
    app: AppOption = None,
) -> None:
    """Show the message whose message id is ID (else the newest whose tracking id is ID): status,
    attempts, progress, result."""
    from . import jobs

    async def look(ops: OpsService) -> MessageDetail:
        return ops.detail_of(await jobs.find(ops.runtime, message_id, newest=False))

    d = _ops_call(app, look)
    unreadable = "does not read (see stored)"  # a row damaged outside the kit
    out.print(
        f"message   {d.message_id or unreadable}\ntracking  {d.tracking_id or unreadable}", highlight=False
    )
    out.print(
        f"type      {d.type} on queue {d.queue}\nstatus    {d.status} (attempt {d.attempt})", highlight=False
    )
    if d.progress:
        p = d.progress
        of = f" of {p['total']}" if p.get("total") is not None else ""
        text = f": {p['text']}" if p.get("text") else ""
        out.print(f"progress  {p.get('step')}{of}{text}", highlight=False)
    if d.malformed:  # a row damaged outside the kit: what does not read, and its stored text
        out.print(f"malformed {d.malformed}", highlight=False)
        for name, text in sorted((d.stored or {}).items()):
            out.print(f"stored    {name}: {text[:200]}", highlight=False)
    for label, value in (("reason", d.reason), ("error", d.last_error), ("detail", d.description)):
        if value:
            out.print(f"{label:<9} {value.splitlines()[0]}", highlight=False)
    if d.result is not None:
        out.print(f"result    {json.dumps(d.result)}", highlight=False)


@cli.command()
def purge(
    queue_name: Annotated[
        str | None, typer.Option("--queue", metavar="QUEUE", help="Only this queue")
    ] = None,
    type_name: Annotated[str | None, typer.Option("--type", metavar="TYPE", help="Only this type")] = None,
    status: Annotated[
        list[str] | None, typer.Option(metavar="STATUS", help="Only these statuses (repeat)")
    ] = None,
    older_than: Annotated[
        float | None,
        typer.Option(
            min=0, max=1_000_000, metavar="HOURS", help="Only messages created at least this many hours ago"
        ),
    ] = None,
    purge_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Without filters: purge every message. With --queue alone: empty that queue whole on "
            "its transport (messages without history too, and those a worker holds where its purge "
            "takes them)",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation")] = False,
    app: AppOption = None,
) -> None:
    """Delete messages that match the filters (never the ones a worker holds, unless --all empties a
    whole queue whose transport's purge takes them)."""
    from datetime import timedelta

    from .clock import utcnow
    from .providers.dead_letters import whole_queue
    from .tracking import MessageQuery

    query = MessageQuery(
        queue=queue_name,
        type=type_name,
        status=tuple(status) if status else None,
        created_to=utcnow() - timedelta(hours=older_than) if older_than is not None else None,
    )
    if query == MessageQuery() and not purge_all:
        fail("give at least one filter, or --all", 2)
    # --all with a filter asks for the queue emptied whole: only what it says (a queue alone without
    # it is purged message by message, as every other filter is)
    whole = purge_all and query != MessageQuery()
    if whole:
        try:
            whole_queue(query)
        except InvalidArgument:
            fail("--all with a filter empties one whole queue: give it with --queue alone", 2)
    what = f"the messages with {query.describe()}" if query != MessageQuery() else "every message"

    async def confirmed_purge(ops: OpsService) -> PurgeResult:
        await ops.check_filters(query, purging=True)  # a misspelt status fails before the question
        if whole:
            held = (
                "and those a worker holds (their runs' outcomes are then refused)"
                if ops.runtime.provider.capabilities.purge_takes_held
                else "but never those a worker holds"
            )
            question = (
                f"empty queue {query.queue} whole: every message in it, its dead letters and delayed "
                f"ones, those with no history too, {held}?"
            )
        else:
            question = f"delete {what} (never those a worker holds)?"
        if not yes and not typer.confirm(question):
            raise typer.Exit(1)
        return await ops.purge(query, whole=whole)

    result = _ops_call(app, confirmed_purge)
    out.print(
        f"deleted {counted(result.deleted, 'message')}; left {result.skipped_leased} held by workers"
        + (
            f" and {result.left_waiting} the transport could not remove (waiting ones run)"
            if result.left_waiting
            else ""
        ),
        highlight=False,
    )


def _has_database(cfg: QueueingSettings) -> bool:
    """Whether this deployment keeps anything in ``QUEUEING_DATABASE_URL``: the SQL provider's
    messages, or the side stores of RabbitMQ and SQS (history, pauses, circuits, delayed messages),
    or the Storage Queues delayed store when it is on."""
    return cfg.provider in ("sql", "rabbitmq", "sqs") or (
        cfg.provider == "storage_queue" and cfg.storage_delayed_store
    )


@cli.command()
def migrate(app: AppOption = None) -> None:
    """Create or upgrade the database schema (also done at start unless QUEUEING_AUTO_MIGRATE=false)."""
    cfg = settings()
    if not _has_database(cfg):
        fail(f"QUEUEING_PROVIDER is {cfg.provider!r}: it keeps nothing in a database to migrate", 2)
    from .providers.sql import LATEST
    from .providers.sql.engine import redact

    async def go() -> None:
        # built as the hosts build it: their sign-in (QUEUEING_DATABASE_AUTH, _CLIENT_ID) and
        # prepared statements too, or the schema would be made by another identity than theirs
        provider = sql_provider(cfg, auto_migrate=True, listen=False)
        await provider.open()
        await provider.close()

    _run(go())
    out.print(f"schema at version {LATEST} on {redact(cfg.database_url)}", highlight=False)


infra = typer.Typer(help="Keep infra/ in step with the code.", no_args_is_help=True)
cli.add_typer(infra, name="infra")


@infra.command("params")
def infra_params(
    app: AppOption = None,
    file: Annotated[
        Path, typer.Option(metavar="FILE", help="The .bicepparam file holding the generated block")
    ] = Path("infra/main.bicepparam"),
    check: Annotated[
        bool, typer.Option("--check", help="Only report drift (exit 1), change nothing")
    ] = False,
) -> None:
    """Write the queues of the app (names, delivery count, lock, TTL) into the Bicep parameters."""
    from .infra import current, render, update

    cfg = settings()
    the_app = app_from(app, cfg)
    use_queue_naming(the_app, cfg)
    if not file.exists():
        fail(f"{file} does not exist", 2)
    try:
        block = render(the_app, cfg.ttl_grace)
        if check:
            if current(file) != block:
                fail(f"{file} is out of date: run `queueing infra params`", 1)
            out.print(f"{file} matches the code", highlight=False)
            return
        changed = update(file, block)
    except ConfigurationError as exc:
        fail(str(exc), 2)
    out.print(
        f"{'updated' if changed else 'unchanged'}: {file} ({counted(len(the_app.subscriptions()), 'queue')})",
        highlight=False,
    )


def main() -> None:
    try:
        cli()
    except ConfigurationError as exc:  # raised below a command; same one-line contract
        err.print(styled("error:", "bold red", str(exc)), highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
