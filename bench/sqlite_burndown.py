"""Burn-down on SQLite: the kit vs huey's SqliteHuey vs a bare sqlite3 loop, on the same disk, interleaved.

Each round uses a new temp file per contender (same directory, so the same disk), N pre-enqueued
no-op jobs, and the clock runs from the worker's start to the moment the N-th handler has run
(enqueue time excluded). Every contender writes with WAL and `synchronous=NORMAL` (the kit's setting;
huey's own default would be FULL, which would make it slower, so it is given the kit's); each round
reads both back from the contender's own connection and prints them with its concurrency:

  kit      10 handlers at once, up to 20 claimed, claims of up to 10 rows (max_concurrency=10,
           prefetch=2, batch_size=10: the defaults' shape; --batch 100 --in-hand 200 for larger claims)
  huey     SqliteHuey, a consumer of 10 worker threads (the same concurrency), polling from 1 ms; its
           dequeue takes one task per transaction and deletes it; results of None are not stored
  sqlite3  one loop, no framework: claim one row (UPDATE ... RETURNING in BEGIN IMMEDIATE), run the
           no-op, mark it done (a second transaction): a floor for "claim one, complete one"

Every contender keeps what it keeps: the kit a Succeeded row per message, the bare loop a 'done'
row, huey nothing (it deletes the task when it dequeues it).

huey's rate has two modes at 10 threads (about 5,000-11,000 and 14,000-19,000 msg/s here), and a run
can move from one to the other midway. Its 10 threads share one ``sqlite3`` connection under one
``threading.Lock`` (three passes per task: the quick check, the exclusive dequeue transaction, the
revocation read), and ``sqlite3`` lets go of the GIL inside every statement: either the threads hand
the lock and the GIL to each other at almost every pass (a convoy, each hand-off a sleep and a wake-up
in the kernel: about 5 voluntary context switches per task, about 110 µs of CPU per task) or one thread
keeps both for a run of tasks (about 0.5 switches and 50 µs per task). Each huey round prints its
voluntary context switches per task and the mode they show, so a ratio says which huey it beat.

With ``--cpu`` each kit round also prints the CPU its event loop's thread and the whole process
used per message during the burn-down (the rest of the process is aiosqlite's thread).

Usage: .venv/bin/python bench/sqlite_burndown.py [--quick] [--messages 20000] [--rounds 5]
       [--only kit,"bare sqlite3 loop"] [--cpu]
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import resource
import sqlite3
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.worker import Worker

TARGET = 2_000  # messages/s
TARGET_HUEY = 1.5  # kit / SqliteHuey
TARGET_BARE = 1.0  # kit / bare sqlite3 loop
#: above this many voluntary context switches per task, huey's threads were in their convoy (slow
#: mode: about 5 a task); below it, in their fast mode (about 0.5): see the module's docstring
CONVOY_SWITCHES = 2.0
PRAGMAS = ("journal_mode", "synchronous")
SYNCHRONOUS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def print_terms(who: str, journal_mode: object, synchronous: object, concurrency: str) -> None:
    """The durability and concurrency a contender ran with, read back from its own connection."""
    sync = SYNCHRONOUS.get(synchronous, synchronous) if isinstance(synchronous, int) else synchronous
    print(f"    {who}: journal_mode={journal_mode}, synchronous={sync}; {concurrency}", flush=True)


@queue("bench_noop")
class Noop(QueueMessage):
    n: int


class Options:
    rounds: int
    messages: int
    concurrency: int
    batch: int
    in_hand: int
    timeout: float
    quick: bool
    dir: str
    only: str
    cpu: bool


async def kit_round(args: Options, *, settle_with_claims: bool = False, receives: int = 1) -> float:
    with tempfile.TemporaryDirectory(prefix="bench_sqlite_", dir=args.dir) as tmp:
        path = Path(tmp) / "queue.db"
        app = QueueingApp("bench")
        done = common.Done(args.messages)

        @app.handler(Noop, max_concurrency=args.concurrency)
        async def handle(msg: Noop) -> None:
            done.hit()

        provider = SqlProvider(f"sqlite:///{path}", settle_with_claims=settle_with_claims)
        rt = Runtime(app, provider)
        await rt.open()
        try:
            async with provider.engine.connect() as conn:  # (the kit's one pooled connection)
                terms = [(await conn.exec_driver_sql(f"PRAGMA {p}")).scalar() for p in PRAGMAS]
            print_terms("kit", *terms, f"{args.concurrency} handlers at once, claims of {args.batch}")
            await common.enqueue_range(app, lambda j: Noop(n=j), args.messages)
            thread_cpu, process_cpu = time.thread_time(), time.process_time()
            started = await common.kit_burn_down(rt, args, done, receives_in_flight=receives)
            thread_cpu, process_cpu = time.thread_time() - thread_cpu, time.process_time() - process_cpu
            assert done.last_at is not None
            elapsed = done.last_at - started
            if args.cpu:
                per = 1e6 / args.messages
                print(
                    f"    kit CPU per message: event loop's thread {thread_cpu * per:.1f} µs, "
                    f"process {process_cpu * per:.1f} µs",
                    flush=True,
                )
        finally:
            await rt.close()
        with sqlite3.connect(path) as conn:
            (kept,) = conn.execute(
                "SELECT count(*) FROM queueing_messages WHERE status = 'Succeeded'"
            ).fetchone()
        assert kept == args.messages, f"{kept} of {args.messages} rows Succeeded after shutdown"
        return args.messages / elapsed


def huey_round(args: Options) -> float:
    from huey import SqliteHuey
    from huey.storage import SqliteStorage

    class NormalSync(SqliteStorage):  # type: ignore[misc]
        def _create_connection(self):  # type: ignore[no-untyped-def]
            conn = super()._create_connection()
            conn.execute("pragma synchronous=NORMAL")  # the kit's setting (huey offers FULL or OFF)
            return conn

    class Huey(SqliteHuey):  # type: ignore[misc]
        storage_class = NormalSync

    with tempfile.TemporaryDirectory(prefix="bench_huey_", dir=args.dir) as tmp:
        huey = Huey("bench", filename=str(Path(tmp) / "huey.db"), results=False)
        lock = threading.Lock()
        finished = threading.Event()
        count = 0
        marks: dict[str, float] = {}

        @huey.task()
        def noop(n: int) -> None:
            nonlocal count
            with lock:
                count += 1
                if count == args.messages:
                    marks["last"] = common.now()
                    finished.set()

        for i in range(args.messages):
            noop(i)
        terms = [huey.storage.conn.execute(f"PRAGMA {p}").fetchone()[0] for p in PRAGMAS]
        print_terms("huey", *terms, f"{args.concurrency} worker threads on one shared connection")
        consumer = huey.create_consumer(
            workers=args.concurrency,
            worker_type="thread",
            periodic=False,
            initial_delay=0.001,
            max_delay=0.1,
            check_worker_health=False,
        )
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = common.now()
        consumer.start()
        try:
            if not finished.wait(args.timeout):
                raise TimeoutError(f"huey handled {count} of {args.messages}")
            after = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            consumer.stop(graceful=True)
        switches = (after.ru_nvcsw - before.ru_nvcsw) / args.messages
        cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / args.messages * 1e6
        mode = "convoy (slow mode)" if switches > CONVOY_SWITCHES else "no convoy (fast mode)"
        print(f"    huey: {switches:.2f} voluntary context switches and {cpu:.0f} µs CPU per task: {mode}")
        return args.messages / (marks["last"] - started)


BARE_SCHEMA = """
CREATE TABLE jobs (id INTEGER PRIMARY KEY, status TEXT NOT NULL, body TEXT NOT NULL);
CREATE INDEX ix_jobs_pending ON jobs (id) WHERE status = 'pending';
"""


def bare_round(args: Options) -> float:
    with tempfile.TemporaryDirectory(prefix="bench_bare_", dir=args.dir) as tmp:
        conn = sqlite3.connect(Path(tmp) / "bare.db", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(BARE_SCHEMA)
        terms = [conn.execute(f"PRAGMA {p}").fetchone()[0] for p in PRAGMAS]
        print_terms("bare loop", *terms, "one loop, one row at a time")
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO jobs (status, body) VALUES ('pending', ?)",
            [(f'{{"n": {i}}}',) for i in range(args.messages)],
        )
        conn.execute("COMMIT")
        done = 0
        started = common.now()
        while True:
            conn.execute("BEGIN IMMEDIATE")
            row = conn.execute(
                "UPDATE jobs SET status = 'leased' WHERE id = "
                "(SELECT id FROM jobs WHERE status = 'pending' ORDER BY id LIMIT 1) RETURNING id, body"
            ).fetchone()
            conn.execute("COMMIT")
            if row is None:
                break
            done += 1  # the no-op handler
            conn.execute("UPDATE jobs SET status = 'done' WHERE id = ?", (row[0],))  # its own transaction
        elapsed = common.now() - started
        conn.close()
        assert done == args.messages
        return args.messages / elapsed


async def main() -> None:
    p = common.base_parser(__doc__.splitlines()[0], rounds=5, postgres=False)
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2,000 messages, 1 round")
    p.add_argument("--dir", default=None, help="where the database files go (default: the temp dir)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--in-hand", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--only", default="", help="comma-separated subset of contenders")
    p.add_argument("--cpu", action="store_true", help="print the kit's CPU per message in each round")
    args = p.parse_args(namespace=Options())
    if args.quick:
        args.messages, args.rounds = 2_000, 1
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("huey").setLevel(logging.ERROR)
    common.header("SQLite burn-down: kit vs SqliteHuey vs a bare sqlite3 loop (same disk)", args)
    print(f"   database files under {args.dir or tempfile.gettempdir()}")

    async def sync(run: Callable[[Options], float]) -> float:
        return run(args)

    contenders: list[tuple[str, Callable[[], Awaitable[float]]]] = [
        ("kit", lambda: kit_round(args)),
        # the option that settles a batch in the same transaction as the next claim
        ("kit (settle with claims)", lambda: kit_round(args, settle_with_claims=True)),
    ]
    if "receives_in_flight" in inspect.signature(Worker).parameters:  # not in older code (PYTHONPATH)
        # a second claim in flight while the first is on its way
        contenders.append(("kit (two claims)", lambda: kit_round(args, receives=2)))
    if importlib.util.find_spec("huey") is not None:
        contenders.append(("huey SqliteHuey", lambda: sync(huey_round)))
    contenders.append(("bare sqlite3 loop", lambda: sync(bare_round)))
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        contenders = [(name, run) for name, run in contenders if name in wanted]
    results = await common.interleaved(args.rounds, contenders)
    medians = {name: common.median(rs) for name, rs in results.items()}
    print()
    common.print_table(
        ["contender", "median msg/s", "per round"],
        [[n, m, ", ".join(f"{r:,.0f}" for r in results[n])] for n, m in medians.items()],
    )
    if "kit" in medians:  # (--only may leave it out)
        k = medians["kit"]
        short = f"NOT MET ({k / TARGET:.0%} of target, {TARGET - k:,.0f} msg/s short)"
        verdict = "MET" if k >= TARGET else short
        print(f"kit absolute: {k:,.0f} msg/s (>= {TARGET:,}: {verdict})")
        for name, target in (("huey SqliteHuey", TARGET_HUEY), ("bare sqlite3 loop", TARGET_BARE)):
            if name in medians:
                ratio = k / medians[name]
                met = "MET" if ratio >= target else f"NOT MET (gap {target - ratio:.2f})"
                print(f"ratio kit / {name}: {ratio:.2f} (target >= {target}: {met})")
    print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    common.run(main)
