"""Shared helpers for the benchmarks: clock, RSS, medians, throwaway schemas/databases, tables.

Every benchmark isolates itself in a schema (or database) named after its process id, so it never
sees another run's rows or NOTIFYs on a shared server, and drops it again afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

DEFAULT_PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")

T = TypeVar("T")

now = time.perf_counter  # monotonic, sub-microsecond: the only clock used for durations


def rss_mib() -> float:
    """Resident set size of this process from /proc (current, not peak like ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


_counter = 0


def unique_name(prefix: str) -> str:
    """A schema/database name no other run uses: prefix, pid and a per-process counter."""
    global _counter
    _counter += 1
    return f"{prefix}_{os.getpid()}_{_counter}"


def libpq_conninfo(url: str, *, dbname: str | None = None) -> str:
    """The SQLAlchemy-style URL as a libpq URL (psycopg, asyncpg), optionally for another database."""
    u = make_url(url).set(drivername="postgresql")
    if dbname is not None:
        u = u.set(database=dbname)
    return u.render_as_string(hide_password=False)


def admin_execute(url: str, statement: sql.Composable) -> None:
    # autocommit: CREATE/DROP DATABASE cannot run inside a transaction block
    with psycopg.connect(libpq_conninfo(url), autocommit=True) as conn:
        conn.execute(statement)


def drop_schema(url: str, schema: str) -> None:
    admin_execute(url, sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def create_database(url: str, name: str) -> None:
    admin_execute(url, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(url: str, name: str) -> None:
    admin_execute(url, sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def analyze(url: str, table: sql.Composable, *, dbname: str | None = None) -> None:
    """Give the planner statistics for the freshly filled table before the clock starts, as autovacuum
    would within a minute in production: without them a tool may get a plan it never sees for real."""
    with psycopg.connect(libpq_conninfo(url, dbname=dbname), autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}").format(table))


def scalar(url: str, query: sql.Composable, *, dbname: str | None = None) -> Any:
    with psycopg.connect(libpq_conninfo(url, dbname=dbname), autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    return row[0] if row else None


@contextmanager
def throwaway_schema(url: str, prefix: str) -> Iterator[str]:
    schema = unique_name(prefix)
    drop_schema(url, schema)
    try:
        yield schema
    finally:
        drop_schema(url, schema)


@contextmanager
def throwaway_database(url: str, prefix: str) -> Iterator[str]:
    name = unique_name(prefix)
    create_database(url, name)
    try:
        yield name
    finally:
        drop_database(url, name)


@dataclass
class Done:
    """Counts handler runs and notes the clock when the n-th one has run."""

    target: int
    count: int = 0
    first_at: float | None = None
    last_at: float | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def hit(self) -> None:
        self.count += 1
        if self.first_at is None:
            self.first_at = now()
        if self.count == self.target:
            self.last_at = now()
            self.event.set()

    async def wait(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            raise TimeoutError(f"only {self.count} of {self.target} handled after {timeout:.0f}s") from None


async def enqueue_range(app: Any, make: Callable[[int], Any], end: int, *, start: int = 0) -> None:
    """Enqueue ``make(i)`` for ``i`` in ``range(start, end)`` in calls of 1,000 (how every burn-down
    fills its queue before its clock starts)."""
    for i in range(start, end, 1000):
        await app.enqueue_many([make(j) for j in range(i, min(i + 1000, end))])


async def kit_burn_down(
    rt: Any, args: argparse.Namespace, done: Done, *, receives_in_flight: int | str | None = None
) -> float:
    """Run a kit ``Worker`` over an enqueued burn-down until ``done``, shaped by the burn-down options
    every kit contender shares (fast polls, claims of ``--batch``, ``--in-hand`` claimed at most);
    returns the clock at its start. ``receives_in_flight`` is the worker's own default when None, and
    passed on only when given, so the script runs against older code (PYTHONPATH) that does not know it."""
    from queueing_core.worker import Worker

    extra: dict[str, Any] = {} if receives_in_flight is None else {"receives_in_flight": receives_in_flight}
    worker = Worker(
        rt,
        poll_min=0.01,
        poll_max=0.1,
        prefetch=args.in_hand // args.concurrency,
        batch_size=args.batch,
        **extra,
    )
    started = now()
    await worker.start()
    try:
        await done.wait(args.timeout)
    finally:
        await worker.shutdown()
    return started


async def interleaved(
    rounds: int, contenders: Sequence[tuple[str, Callable[[], Awaitable[T]]]]
) -> dict[str, list[T]]:
    """Run every contender once per round, rotating the order so none always goes first."""
    results: dict[str, list[T]] = {name: [] for name, _ in contenders}
    for r in range(rounds):
        shift = r % len(contenders)
        print(f"  round {r + 1}/{rounds}  load average {load()}", flush=True)
        for name, run in [*contenders[shift:], *contenders[:shift]]:
            result = await run()
            results[name].append(result)
            shown = f"{result:8,.0f} msg/s" if isinstance(result, float) else str(result)
            print(f"  round {r + 1}/{rounds}  {name:<24} {shown}  (load {load(1)})", flush=True)
    return results


def load(n: int = 3) -> str:
    """The machine's load average (1, 5, 15 minutes; the first ``n``): the context of every figure."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()[:n])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(h) for h in headers], *[[_fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "  ".join("-" * w for w in widths)
    print(line)
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            print(line)
    print(line)


def _numeric(cell: str) -> bool:
    return bool(cell) and cell.replace(",", "").replace(".", "").replace("-", "").isdigit()


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def kit_source() -> str:
    """Where queueing_core was imported from, and at which commit (dirty or not) if it is a checkout."""
    import queueing_core

    here = Path(queueing_core.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--", "."], capture_output=True, text=True
        ).stdout.strip()
        return f"{here} @ {rev}{' (+uncommitted changes)' if dirty else ''}"
    except (subprocess.CalledProcessError, FileNotFoundError):
        return f"{here} (not a git checkout)"


def header(title: str, args: argparse.Namespace) -> None:
    print(f"== {title}")
    print(
        f"   {time.strftime('%Y-%m-%d %H:%M:%S')}  python {platform.python_version()}  cores {os.cpu_count()}"
    )
    print(f"   load average at start: {load()} on {os.cpu_count()} cores (read ratios, not absolutes)")
    print(f"   queueing_core: {kit_source()}")
    print(f"   event loop: {running_loop()} (every contender of the run on it)")
    print(f"   options: {vars(args)}")


def running_loop() -> str:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "none (a synchronous benchmark)"
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


#: ``--loop``: the event loop a benchmark's process runs on, for every contender in it alike: asyncio's own
#: (what the results are measured on), or uvloop (pgqueuer's own runner's choice; a dependency of
#: pgqueuer, so installed with the bench extra). See "Tried, not landed: uvloop" in RESULTS.md
LOOPS = ("asyncio", "uvloop")


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``asyncio.run(main())`` on the loop ``--loop`` names (read here, before ``main`` parses the rest)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--loop", choices=LOOPS, default="asyncio")
    factory = asyncio.new_event_loop
    if pre.parse_known_args()[0].loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def base_parser(description: str, *, rounds: int | None, postgres: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--loop",
        choices=LOOPS,
        default="asyncio",
        help="the event loop, for every contender alike: asyncio's own (the results' loop), or uvloop "
        "(pgqueuer's runner's)",
    )
    if postgres:
        p.add_argument("--url", default=DEFAULT_PG_URL, help="PostgreSQL URL (env BENCH_PG_URL)")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help="rounds; the median is reported")
    return p
