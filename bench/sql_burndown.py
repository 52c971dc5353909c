"""Burn-down on PostgreSQL: the kit vs pgqueuer vs procrastinate, interleaved in one run.

Each contender gets a fresh schema (procrastinate, which has no schema setting: a fresh database),
N pre-enqueued no-op jobs, and one in-process worker with the same shape:

- 10 handlers running at once, at most 20 jobs claimed ("in hand") at once, claims of up to 10 rows:
  kit         max_concurrency=10, prefetch=2, batch_size=10 (poll_min 0.01 s, poll_max 0.1 s)
  pgqueuer    batch_size=10, max_concurrent_tasks=20, and a 10-slot semaphore in the handler
              (pgqueuer runs every picked job at once; its per-entrypoint concurrency_limit is a
              cross-worker limit in SQL, a different thing, so it stays 0)
  procrastin. concurrency=10: ten slots, each fetching one job when free (it has no batch knob)
- The same connection budget for every contender (--connections, default 3, LISTEN included):
  kit (durable claims)   LISTEN + a pool of budget-1 (no overflow); claims wait for the WAL flush; the
                         kit's defaults otherwise (QUEUEING_RECEIVES_IN_FLIGHT=auto: alone on the
                         server, the worker tries a second claim in flight and keeps it if it pays)
  kit (one claim)        as durable, with QUEUEING_RECEIVES_IN_FLIGHT=1: one claim at a time (the
                         default before `auto`)
  kit (settle with c.)   as durable, with QUEUEING_SETTLE_WITH_CLAIMS=true: a claim and the settlements
                         waiting for it in one transaction
  kit (relaxed claims)   LISTEN + a claims pool of 1 (synchronous_commit=off) + a pool of budget-2
                         (auto claims in flight, as the default)
  kit (two claims)       as durable, with QUEUEING_RECEIVES_IN_FLIGHT=2: a second claim in flight while
                         the first is on its way (same budget: two claims and a settlement share it)
  kit (relaxed two c.)   as relaxed, with QUEUEING_RECEIVES_IN_FLIGHT=2
  pgqueuer (asyncpg)     AsyncpgPoolDriver on a pool of `budget` (its listener holds one of them)
  pgqueuer (psycopg)     ONE connection: its psycopg driver takes a single connection, no pool
  procrastinate          its psycopg pool, max_size=budget (its listener holds one of them)
  pgqueuer runs at its default durability (`durable`: every table logged, every commit synchronous),
  so "kit (durable claims)" is the like-for-like row; "kit (relaxed claims)" is the kit with
  QUEUEING_DURABLE_CLAIMS=false.
- Every tool's queue table is ANALYZEd after the enqueue, as autovacuum would do in production soon
  after a bulk insert (without statistics a planner can pick a plan no real deployment sees).
- The clock runs from the call that starts the worker to the moment the N-th handler has run.
  Enqueue time is excluded. After the worker has stopped, the rows each tool keeps are counted.
- Rounds are interleaved (A, B, C, ... then again, rotated), the load average is printed with each
  round, and medians are reported.

With ``--cpu`` each kit and pgqueuer round also prints the CPU the worker's process used per message
during the burn-down (from the worker's start until it has stopped), its event loop's thread and the
whole process (the database server's CPU is not in it).

With ``--server-counters`` the run takes a database of its own, and each kit and pgqueuer round also
prints what the server did per message from the worker's start until its connections were closed
(``pg_counters``): commits and rollbacks of that database, transactions that wrote, WAL records,
full-page images, bytes, writes and syncs (the whole server's), and the rows the contender's tables
inserted, updated (how many HOT) and deleted; the medians follow the rates. Each such round waits
11 s before its burn-down and 1 s after it for the server's counters to be reported (outside the
clock).

Usage: .venv/bin/python bench/sql_burndown.py [--quick] [--messages 20000] [--rounds 5]
           [--connections 3] [--only kit,procrastinate] [--cpu] [--server-counters]
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import common
import pg_counters
from psycopg import sql
from sqlalchemy.engine import make_url

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime


@queue("bench_noop")
class Noop(QueueMessage):
    n: int


@dataclass
class Burn:
    messages: int
    elapsed: float  # worker start -> N-th handler has run
    startup: float  # worker start -> first handler has run
    kept: str  # what the tool left in the database afterwards
    server: dict[str, float] | None = None  # the server's counters per message (--server-counters)

    @property
    def rate(self) -> float:
        return self.messages / self.elapsed

    def __str__(self) -> str:
        first = self.startup * 1000
        line = f"{self.rate:8,.0f} msg/s  ({self.elapsed:.2f} s, first handler after {first:.0f} ms)"
        return line if self.server is None else f"{line}\n      {pg_counters.describe(self.server)}"


def print_cpu(who: str, thread_cpu: float, process_cpu: float, messages: int) -> None:
    """The CPU a contender's worker used per message during its burn-down (--cpu)."""
    per = 1e6 / messages
    print(
        f"    {who} CPU per message: event loop's thread {thread_cpu * per:.1f} µs, "
        f"process {process_cpu * per:.1f} µs",
        flush=True,
    )


def window(args: Options, schema: str) -> pg_counters.Window | None:
    """The server's counters around a round's burn-down, when asked for (--server-counters)."""
    return pg_counters.Window(args.url, schema) if getattr(args, "server_counters", False) else None


def finished(done: common.Done, started: float) -> tuple[float, float]:
    assert done.first_at is not None
    assert done.last_at is not None
    return done.last_at - started, done.first_at - started


def kit_provider(args: Options, schema: str, *, durable: bool, combined: bool = False) -> SqlProvider:
    """The kit inside the connection budget: LISTEN is one connection, the pools share the rest."""
    if durable:
        pools = {"pool_size": args.connections - 1, "max_overflow": 0}
    else:
        pools = {"pool_size": args.connections - 2, "max_overflow": 0, "claim_pool_size": 1}
    return SqlProvider(args.url, schema=schema, durable_claims=durable, settle_with_claims=combined, **pools)


async def kit_burn(
    args: Options,
    provider: SqlProvider,
    messages: int,
    *,
    receives: int | str | None = None,
    counters: pg_counters.Window | None = None,
) -> Burn:
    """Enqueue ``messages`` no-ops through ``provider`` (its schema may already hold rows), then time
    one worker of the benchmark's shape until the last of them has run; ``counters`` spans the worker
    from its start until the provider's connections are closed."""
    app = QueueingApp("bench")
    done = common.Done(messages)

    @app.handler(Noop, max_concurrency=args.concurrency)
    async def handle(msg: Noop) -> None:
        done.hit()

    rt = Runtime(app, provider)
    await rt.open()
    try:
        await common.enqueue_range(app, lambda j: Noop(n=j), messages)
        common.analyze(
            args.url, sql.Identifier(provider.tables.messages.schema or "public", "queueing_messages")
        )
        if counters is not None:
            await counters.start()
        thread_cpu, process_cpu = time.thread_time(), time.process_time()
        started = await common.kit_burn_down(rt, args, done, receives_in_flight=receives)
        thread_cpu, process_cpu = time.thread_time() - thread_cpu, time.process_time() - process_cpu
        elapsed, startup = finished(done, started)
        if getattr(args, "cpu", False):  # (bench/sql_history.py burns down through here too)
            print_cpu("kit", thread_cpu, process_cpu, messages)
    finally:
        await rt.close()
    if counters is None:
        return Burn(messages, elapsed, startup, "")
    await counters.stop()
    return Burn(messages, elapsed, startup, "", counters.per_message(messages))


async def kit(
    args: Options, *, durable: bool, combined: bool = False, receives: int | str | None = None
) -> Burn:
    with common.throwaway_schema(args.url, "bench_kit") as schema:
        provider = kit_provider(args, schema, durable=durable, combined=combined)
        burn = await kit_burn(args, provider, args.messages, receives=receives, counters=window(args, schema))
        kept = common.scalar(
            args.url,
            sql.SQL("SELECT count(*) FROM {}.queueing_messages WHERE status = 'Succeeded'").format(
                sql.Identifier(schema)
            ),
        )
        burn.kept = f"{kept} Succeeded rows"
        return burn


async def pgqueuer(args: Options, driver: str) -> Burn:
    from pgqueuer import QueueManager
    from pgqueuer.adapters.persistence import qb
    from pgqueuer.adapters.persistence.queries import Queries
    from pgqueuer.domain.settings import DBSettings
    from pgqueuer.domain.types import Channel
    from pgqueuer.models import Job
    from pgqueuer.ports.driver import Driver

    with common.throwaway_schema(args.url, "bench_pgq") as schema:
        # its own NOTIFY channel too: channels are database-wide, schemas are not
        settings = DBSettings(db_schema=schema, channel=f"ch_{schema}")
        dsn = common.libpq_conninfo(args.url)
        close: Callable[[], Awaitable[None]]
        pgq_driver: Driver
        if driver == "asyncpg":
            import asyncpg
            from pgqueuer.db import AsyncpgPoolDriver

            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=args.connections)
            pgq_driver, close = AsyncpgPoolDriver(pool), pool.close
        else:
            import psycopg
            from pgqueuer.db import PsycopgDriver

            pconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            pgq_driver, close = PsycopgDriver(pconn), pconn.close
        try:
            queries = Queries(
                pgq_driver,
                qbe=qb.QueryBuilderEnvironment(settings),
                qbq=qb.QueryQueueBuilder(settings),
                qbs=qb.QuerySchedulerBuilder(settings),
            )
            await queries.install()
            for i in range(0, args.messages, 1000):
                count = min(1000, args.messages - i)
                payloads: list[bytes | None] = [json.dumps({"n": j}).encode() for j in range(i, i + count)]
                await queries.enqueue(["noop"] * count, payloads, [0] * count)
            common.analyze(args.url, sql.Identifier(schema, "pgqueuer"))
            counters = window(args, schema)
            if counters is not None:
                await counters.start()
            qm = QueueManager(queries, channel=Channel(settings.channel))
            done = common.Done(args.messages)
            slots = asyncio.Semaphore(args.concurrency)

            @qm.entrypoint("noop", accepts_context=False)
            async def noop(job: Job) -> None:
                async with slots:
                    done.hit()

            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            started = common.now()
            run = asyncio.create_task(
                qm.run(
                    batch_size=args.batch,
                    max_concurrent_tasks=args.in_hand,
                    dequeue_timeout=timedelta(seconds=1),
                )
            )
            try:
                await done.wait(args.timeout)
            finally:
                qm.shutdown.set()
                await run
            elapsed, startup = finished(done, started)
            if getattr(args, "cpu", False):  # (its worker runs in this process and thread, as the kit's does)
                print_cpu(
                    f"pgqueuer ({driver})",
                    time.thread_time() - thread_cpu,
                    time.process_time() - process_cpu,
                    args.messages,
                )
        finally:
            await close()
        server = None
        if counters is not None:
            await counters.stop()
            server = counters.per_message(args.messages)
        left = common.scalar(
            args.url, sql.SQL("SELECT count(*) FROM {}.pgqueuer").format(sql.Identifier(schema))
        )
        logged = common.scalar(
            args.url,
            sql.SQL("SELECT count(*) FROM {}.pgqueuer_log").format(sql.Identifier(schema)),
        )
        return Burn(args.messages, elapsed, startup, f"{left} job rows left; {logged} log rows", server)


async def procrastinate(args: Options) -> Burn:
    """On a quarter of the messages (--procrastinate-messages): at a tenth of the others' rate, the
    full count would make every round last minutes longer; its rate does not depend on the count."""
    import procrastinate as pc

    messages = args.procrastinate_messages or max(1, args.messages // 4)

    with common.throwaway_database(args.url, "bench_proc") as db:
        # the same budget as everyone: its listener holds one pooled connection, slots share the rest
        connector = pc.PsycopgConnector(
            conninfo=common.libpq_conninfo(args.url, dbname=db),
            min_size=1,
            max_size=args.connections,
        )
        app = pc.App(connector=connector)
        done = common.Done(messages)

        @app.task(name="noop", queue="bench")
        async def noop(n: int) -> None:
            done.hit()

        async with app.open_async():
            await app.schema_manager.apply_schema_async()
            for i in range(0, messages, 1000):
                await noop.batch_defer_async(*[{"n": j} for j in range(i, min(i + 1000, messages))])
            common.analyze(args.url, sql.Identifier("procrastinate_jobs"), dbname=db)
            started = common.now()
            run = asyncio.create_task(
                app.run_worker_async(
                    queues=None,  # its default: all queues (the database holds only this one)
                    concurrency=args.concurrency,
                    wait=True,
                    listen_notify=True,
                    fetch_job_polling_interval=1.0,
                    delete_jobs="never",
                    install_signal_handlers=False,
                )
            )
            try:
                await done.wait(args.timeout)
            finally:
                run.cancel()  # procrastinate stops gracefully on cancel
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            elapsed, startup = finished(done, started)
        kept = common.scalar(
            args.url, sql.SQL("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"), dbname=db
        )
        events = common.scalar(args.url, sql.SQL("SELECT count(*) FROM procrastinate_events"), dbname=db)
        return Burn(messages, elapsed, startup, f"{kept} succeeded job rows; {events} event rows")


class Options:
    url: str
    rounds: int
    messages: int
    concurrency: int
    batch: int
    in_hand: int
    timeout: float
    only: str
    connections: int
    quick: bool
    procrastinate_messages: int
    cpu: bool
    server_counters: bool


RETAINED = {
    "kit": "keeps every message row, updated to Succeeded (durable history); nothing else per job",
    "pgqueuer": "deletes the job row; appends pgqueuer_log rows (queued, picked, successful) that its "
    "periodic task folds into per-second pgqueuer_statistics counts (log rows stay, marked aggregated)",
    "procrastinate": "keeps the job row as 'succeeded' (delete_jobs=never, its default) plus one "
    "procrastinate_events row per status change (deferred, started, succeeded)",
}


#: the server's per-message figures in the summary, and the decimals each is shown with
SERVER_COLUMNS = {
    "commits": 3,
    "xids": 3,
    "rollbacks": 3,
    "wal_sync": 3,
    "wal_write": 3,
    "wal_records": 1,
    "wal_fpi": 2,
    "wal_bytes": 0,
    "ins": 2,
    "upd": 2,
    "hot_upd": 2,
    "del": 2,
    "server_cpu": 0,
    "background_cpu": 0,
    "client_cpu": 0,
}


def server_table(results: dict[str, list[Burn]]) -> None:
    """The medians of the server's per-message figures, for the contenders that measured them."""
    rows = []
    for name, burns in results.items():
        measured = [b.server for b in burns if b.server is not None]
        if measured:
            medians = [common.median([m[k] for m in measured]) for k in SERVER_COLUMNS]
            others = common.median([m["other_commits"] for m in measured])
            rows.append(
                [
                    name,
                    *[f"{v:,.{d}f}" for v, d in zip(medians, SERVER_COLUMNS.values(), strict=True)],
                    f"{others:,.0f}",
                ]
            )
    if rows:
        print("\nThe server per message, medians of the rounds (WAL is the whole server's; others' commits")
        print("are every other database's in the same windows, the noise in it; CPU in µs: the backends of")
        print("the run's database, the server's background processes, this process):")
        common.print_table(["contender", *SERVER_COLUMNS, "others' commits"], rows)


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=5)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2,000 messages, 1 round")
    p.add_argument("--procrastinate-messages", type=int, default=0, help="its own count (default: a quarter)")
    p.add_argument(
        "--connections", type=int, default=3, help="database connections per contender, LISTEN included"
    )
    p.add_argument("--concurrency", type=int, default=10, help="handlers running at once")
    p.add_argument("--batch", type=int, default=10, help="most jobs claimed by one query")
    p.add_argument("--in-hand", type=int, default=20, help="most jobs claimed but not finished")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--only", default="", help="comma-separated subset of contenders")
    p.add_argument("--cpu", action="store_true", help="print the workers' CPU per message in each round")
    p.add_argument(
        "--server-counters",
        action="store_true",
        help="in a database of its own: the server's commits, WAL and row writes per message, per round",
    )
    args = p.parse_args(namespace=Options())
    if args.quick:
        args.messages, args.rounds = 2_000, 1
    if args.connections < 3:
        p.error("--connections must be at least 3 (the relaxed kit: LISTEN, a claims pool and a pool)")
    if args.in_hand % args.concurrency or args.in_hand < 2 * args.batch:
        p.error("--in-hand must be a multiple of --concurrency (kit prefetch) and >= 2x --batch (pgqueuer)")
    if args.server_counters:
        # commits are counted per database: this run's alone, not the other sessions' on the shared one
        with common.throwaway_database(args.url, "bench_counters") as db:
            args.url = make_url(args.url).set(database=db).render_as_string(hide_password=False)
            await run(args)
    else:
        await run(args)


async def run(args: Options) -> None:
    logging.basicConfig(level=logging.WARNING)
    # it warns that the App lives in __main__ (only matters for its CLI's task discovery)
    logging.getLogger("procrastinate.blueprints").setLevel(logging.ERROR)
    common.header("SQL burn-down: kit vs pgqueuer vs procrastinate (PostgreSQL)", args)
    print(
        f"   versions: pgqueuer {version('pgqueuer')}, procrastinate {version('procrastinate')}, "
        f"asyncpg {version('asyncpg')}, psycopg {version('psycopg')}, sqlalchemy {version('sqlalchemy')}"
    )

    contenders: list[tuple[str, Callable[[], Awaitable[Burn]]]] = [
        ("kit (durable claims)", lambda: kit(args, durable=True)),
        ("kit (settle with claims)", lambda: kit(args, durable=True, combined=True)),
        ("kit (relaxed claims)", lambda: kit(args, durable=False)),
        ("kit (one claim)", lambda: kit(args, durable=True, receives=1)),
        ("kit (two claims)", lambda: kit(args, durable=True, receives=2)),
        ("kit (relaxed two claims)", lambda: kit(args, durable=False, receives=2)),
        ("pgqueuer (psycopg)", lambda: pgqueuer(args, "psycopg")),
    ]
    if importlib.util.find_spec("asyncpg") is not None:
        contenders.append(("pgqueuer (asyncpg)", lambda: pgqueuer(args, "asyncpg")))
    contenders.append(("procrastinate", lambda: procrastinate(args)))
    if args.only:
        wanted = {w.strip() for w in args.only.split(",")}
        contenders = [c for c in contenders if c[0] in wanted or c[0].split()[0] in wanted]

    results = await common.interleaved(args.rounds, contenders)
    medians = {name: common.median([r.rate for r in rs]) for name, rs in results.items()}
    rows = []
    for name, rs in results.items():
        rates = ", ".join(f"{r.rate:,.0f}" for r in rs)
        startup = common.median([r.startup for r in rs]) * 1000
        rows.append([name, medians[name], rates, f"{startup:.0f}", rs[-1].kept])
    print()
    common.print_table(
        ["contender", "median msg/s", "per round", "first handler ms", "rows afterwards"], rows
    )
    server_table(results)
    for mine in [n for n in medians if n.startswith("kit")]:
        for name, m in medians.items():
            if not name.startswith("kit"):
                print(f"ratio {mine} / {name}: {medians[mine] / m:.2f}")
    if "kit (durable claims)" in medians and "pgqueuer (asyncpg)" in medians:
        ratio = medians["kit (durable claims)"] / medians["pgqueuer (asyncpg)"]
        print(
            f"like-for-like (durable claims vs pgqueuer/asyncpg, both durable): {ratio:.2f} "
            f"(targets: >= 1.5 quiet, >= 1.2 busy; load now {common.load()})"
        )
    print()
    print("What each tool keeps per finished job:")
    for tool, text in RETAINED.items():
        print(f"  {tool:<13} {text}")


if __name__ == "__main__":
    common.run(main)
