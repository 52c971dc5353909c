"""``queueing``: the command line for people at a terminal.

Exit codes: 0 ok; 1 the app or an operation failed (a duplicate handler, a refused action);
2 bad configuration or usage (one line naming the setting and what it accepts).
"""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .app import QueueingApp
from .errors import ConfigurationError, RegistrationError
from .loader import load_app
from .naming import Transport
from .settings import QueueingSettings, load_settings

cli = typer.Typer(
    name="queueing",
    help="Run, inspect and steer queueing-kit apps.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# wide enough for the tables when output goes to a file or a pipe (rich assumes 80 columns then)
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

AppOption = Annotated[
    str | None,
    typer.Option("--app", help="MODULE:ATTR of your QueueingApp (default: QUEUEING_APP or the example app)"),
]


def fail(message: str, code: int) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def settings() -> QueueingSettings:
    try:
        return load_settings()
    except ConfigurationError as exc:
        fail(str(exc), 2)


def app_from(spec: str | None, cfg: QueueingSettings) -> QueueingApp:
    try:
        return load_app(spec or cfg.app)
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
    from datetime import timedelta

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
        typer.Option(help="Show physical queue names for this transport (default: QUEUEING_PROVIDER)"),
    ] = None,
) -> None:
    """Load an app and report its queues, handlers and options; exit 1 on an invalid registration."""
    cfg = settings()
    the_app = app_from(app, cfg)
    target = transport or Transport(cfg.provider)
    table = Table(title=f"{the_app.name}: {len(the_app.subscriptions())} queue(s) on {target.value}")
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
    physical: dict[str, str] = {}
    for sub in the_app.subscriptions():
        name = sub.physical_queue(the_app.naming, target)
        if name in physical:
            problems.append(
                f"queues {physical[name]!r} and {sub.queue!r} both map to {name!r} on {target.value}"
            )
        physical[name] = sub.queue
        if name != sub.queue:
            warnings.append(f"queue {sub.queue!r} is named {name!r} on {target.value} (sanitized)")
        if sub.handler is None:
            warnings.append(
                f"type {sub.type_name!r} has no handler here: its messages wait (WaitingForHandler)"
            )
        o = sub.options
        table.add_row(
            sub.type_name,
            sub.queue,
            name,
            sub.handler.origin.split(" (")[0] if sub.handler else "[yellow]none[/]",
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
        out.print(f"[yellow]note:[/] {w}", highlight=False)
    if problems:
        for p in problems:
            err.print(f"[bold red]invalid:[/] {p}", highlight=False)
        raise typer.Exit(1)
    out.print("[green]ok[/]")


def main() -> None:
    try:
        cli()
    except ConfigurationError as exc:  # raised below a command; same one-line contract
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
