"""History does not slow the queue, on SQLite: one pass of the periodic upkeep, and the burn-down, on a
file with 1.2M rows of history against an empty one.

1. Two files in one temp directory (the same disk). One stays empty. The other gets the steady state
   of a queue under the default retention (archive after 7 days, delete 30 days after that), where an
   upkeep pass has nothing to do but look: 1,000,000 rows of the benchmark's queue settled over the
   last 5 days (not yet due for the archive; one in 11 dead-lettered, the rest Succeeded) and 200,000
   archived 10 days ago (not yet due for deletion), filled by one INSERT ... SELECT through ``sqlite3``.
2. Upkeep: ``--passes`` passes of the worker's upkeep (lease sweep, expiry, retention) on each file,
   timed. A pass's statements take SQLite's one write lock in turn, so its wall time is about how long
   it keeps the worker's claims and settlements waiting, every ``maintenance_interval`` (5 s).
3. Burn-down rounds, interleaved: ``--messages`` no-ops enqueued into each file, one worker of
   ``sqlite_burndown.py``'s shape (10 handlers, claims of 10, 20 in hand), its upkeep every 5 s as in
   production. Target: rate with history / rate on the empty file >= 0.8 (PostgreSQL's target). Each
   round also gives the longest time between two handler runs: how long the worker stood still.

Usage: .venv/bin/python bench/sqlite_history.py [--quick] [--history 1000000] [--messages 50000]
           [--rounds 3] [--passes 5]
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import tempfile
from pathlib import Path

import common

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime

TARGET = 0.8


@queue("bench_history")
class Noop(QueueMessage):
    n: int


def fill(path: Path, succeeded: int) -> float:
    """The history: ``succeeded`` rows (one in 11 DeadLettered, the rest Succeeded) settled over the last
    5 days, and a fifth as many again settled 17 days ago and archived 10 days ago; returns the seconds
    it took."""
    started = common.now()
    with sqlite3.connect(path) as conn:
        conn.execute(
            """
            WITH RECURSIVE i(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM i WHERE n < :rows),
                 t(n, at) AS (SELECT n, strftime('%Y-%m-%d %H:%M:%S', 'now', CASE WHEN n > :live
                              THEN '-17 days' ELSE '-' || (n % 432000) || ' seconds' END) || '.000000' FROM i)
            INSERT INTO queueing_messages (message_id, tracking_id, queue, type, status, attempt,
                created_at, updated_at, available_at, settled_at, headers, body, archived, archived_at,
                awaited, lease_token)
            SELECT lower(hex(randomblob(16))), lower(hex(randomblob(16))), 'bench_history', 'Noop',
                   CASE WHEN n % 11 = 0 THEN 'DeadLettered' ELSE 'Succeeded' END, 1, at, at, at, at,
                   '{}', '{"n": 0}', n > :live,
                   CASE WHEN n > :live THEN strftime('%Y-%m-%d %H:%M:%S', 'now', '-10 days') || '.000000' END,
                   0, 1
            FROM t""",
            {"rows": succeeded + succeeded // 5, "live": succeeded},
        )
    return common.now() - started


class Gaps(common.Done):
    """:class:`common.Done` that also keeps the longest wait between two handler runs: how long the
    worker stood still (an upkeep statement holding SQLite's write lock shows here)."""

    previous: float | None = None
    longest: float = 0.0

    def hit(self) -> None:
        at = common.now()
        if self.previous is not None:
            self.longest = max(self.longest, at - self.previous)
        self.previous = at
        super().hit()


async def opened(path: Path) -> tuple[QueueingApp, SqlProvider, Runtime, Gaps]:
    app = QueueingApp("bench")
    done = Gaps(0)

    @app.handler(Noop, max_concurrency=10)
    async def handle(msg: Noop) -> None:
        done.hit()

    provider = SqlProvider(f"sqlite:///{path}")
    rt = Runtime(app, provider)
    await rt.open()
    return app, provider, rt, done


async def upkeep(path: Path, passes: int) -> list[float]:
    """The wall time of each of ``passes`` upkeep passes, in milliseconds."""
    app, provider, rt, _ = await opened(path)
    times = []
    try:
        for _ in range(passes):
            started = common.now()
            await provider.maintain(app)
            times.append((common.now() - started) * 1000)
    finally:
        await rt.close()
    return times


async def burn(path: Path, args: argparse.Namespace, longest: list[float]) -> float:
    app, _, rt, done = await opened(path)
    done.target = args.messages
    try:
        await common.enqueue_range(app, lambda j: Noop(n=j), args.messages)
        started = await common.kit_burn_down(rt, args, done)
    finally:
        await rt.close()
    assert done.last_at is not None
    longest.append(done.longest * 1000)
    return args.messages / (done.last_at - started)


async def main() -> None:
    p = common.base_parser(__doc__ or "", rounds=3, postgres=False)
    p.add_argument("--quick", action="store_true", help="a smoke run: 100k history rows, 5,000 messages")
    p.add_argument("--history", type=int, default=1_000_000, help="Succeeded rows x")
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the database files go (default: the temp dir)")
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--in-hand", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if args.quick:
        args.history, args.messages, args.rounds = 100_000, 5_000, 1
    logging.basicConfig(level=logging.WARNING)
    common.header("SQLite: history does not slow the queue", args)
    with tempfile.TemporaryDirectory(prefix="bench_sqlite_history_", dir=args.dir) as tmp:
        empty, history = Path(tmp) / "empty.db", Path(tmp) / "history.db"
        for path in (empty, history):
            _, _, rt, _ = await opened(path)  # the kit's schema, as a worker creates it
            await rt.close()
        seconds = fill(history, args.history)
        with sqlite3.connect(history) as conn:
            (rows,) = conn.execute("SELECT count(*) FROM queueing_messages").fetchone()
        print(f"   history: {rows:,} rows in {seconds:.1f} s, {history.stat().st_size / 2**20:,.0f} MiB")

        print("-- upkeep: one pass of the lease sweep, expiry and retention (ms)")
        passes = {
            name: await upkeep(path, args.passes) for name, path in (("empty", empty), ("history", history))
        }
        common.print_table(
            ["file", "median ms", "each pass"],
            [[n, common.median(t), ", ".join(f"{x:.1f}" for x in t)] for n, t in passes.items()],
        )

        print(f"-- burn-down: {args.messages:,} no-ops, interleaved rounds, upkeep every 5 s")
        stood: dict[str, list[float]] = {"empty": [], "history": []}
        rates = await common.interleaved(
            args.rounds,
            [
                ("empty", lambda: burn(empty, args, stood["empty"])),
                ("history", lambda: burn(history, args, stood["history"])),
            ],
        )
        common.print_table(
            ["file", "median msg/s", "per round", "longest stand-still ms, per round"],
            [
                [
                    n,
                    common.median(r),
                    ", ".join(f"{x:,.0f}" for x in r),
                    ", ".join(f"{x:.0f}" for x in stood[n]),
                ]
                for n, r in rates.items()
            ],
        )
        ratio = common.median(rates["history"]) / common.median(rates["empty"])
        verdict = "MET" if ratio >= TARGET else f"NOT MET (gap {TARGET - ratio:.2f})"
        print(f"ratio history / empty: {ratio:.2f} (target >= {TARGET}: {verdict})")
        print(f"load average at the end: {common.load()}")


if __name__ == "__main__":
    common.run(main)
