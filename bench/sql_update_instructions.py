"""The PostgreSQL server's instructions per message for the kit's two row updates (claim, success),
counted by valgrind: a figure the machine's load does not move, for one part of the schema at a time.

Rates on this two-core shared machine move by ±25 % between runs, more than most single changes to the
schema are worth; instructions do not. So this runs PostgreSQL's own backend in single-user mode
(``postgres --single``: no postmaster, no client, no network) under ``valgrind --tool=callgrind`` on a
private cluster it makes with ``initdb`` in a temporary directory (the shared server is not touched):

1. the kit's schema at its latest migration, made by the kit itself (``SqlProvider``) on that cluster
   while it runs on a free port, and ``--rows`` Pending messages in one queue;
2. for each variant, a fresh copy of the stopped cluster, the variant's statements, then ``--batches``
   pairs of statements shaped as the kit's hot path changes a row: a claim (``--batch`` rows, 10 by
   default, Pending → Leased, with their lock, lease token and times) and a success (the same rows
   Leased → Succeeded);
3. the instructions of the whole run, less those of a run with no updates at all (start-up, the
   variant's own statements), per message.

The updates are two prepared statements of this script's (``PREPARE``/``EXECUTE``, as the kit prepares
its own), not the kit's claim: they write what the kit's claim and settlement write (the row, each
index entry, the triggers) without the claim's search. Each run is one transaction per statement, as
autocommit is; the WAL is written but not flushed (``fsync=off``: the flush is a wait, not
instructions).

Variants are diagnostics, never configurations: taking an index or a trigger away breaks what it serves.
Some bring statements of their own: the updates counting their own rows in a CTE while the counts
trigger skips its count, and ``pair`` variants that run a success and the next claim as one statement.

Usage: .venv/bin/python bench/sql_update_instructions.py [--rows 20000] [--batches 150] [--batch 10]
           [--only base,...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common

from queueing_core import QueueingApp
from queueing_core.providers.sql import SqlProvider
from queueing_core.providers.sql.schema import Tables, _count_function_sql, _done_notice_sql
from queueing_core.runtime import Runtime

M = "queueing_messages"
TABLES = Tables.build()

#: variant -> statements run on the copy before the updates
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "no count trigger on UPDATE": [f"DROP TRIGGER queueing_count_update ON {M}"],
    "count trigger doing nothing": [
        "CREATE OR REPLACE FUNCTION queueing_count_changes_update() RETURNS trigger LANGUAGE plpgsql "
        "AS $$ BEGIN RETURN NULL; END $$"
    ],
    # result waiters' NOTIFY: since migration 14 in the UPDATE counts trigger (base); taken out of it, and
    # as it was before (migration 10's row trigger beside migration 2's counts trigger)
    "no done notice": [_count_function_sql(TABLES, "UPDATE")],
    "done as a row trigger (before 14)": [
        _count_function_sql(TABLES, "UPDATE"),
        "CREATE FUNCTION queueing_notify_done() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "PERFORM pg_notify('bench', NEW.message_id::text); RETURN NULL; END $$",
        f"CREATE TRIGGER queueing_notify_done AFTER UPDATE ON {M} FOR EACH ROW WHEN (NEW.awaited AND "
        "NEW.status IN ('Cancelled', 'Expired', 'Succeeded', 'DeadLettered') AND "
        "OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION queueing_notify_done()",
    ],
    "no ix_created": ["DROP INDEX ix_queueing_messages_created"],
    # the listing index by time as it was before migration 16 (holding the rows running now)
    "ix_created before 16": [
        "DROP INDEX ix_queueing_messages_created",
        f"CREATE INDEX ix_queueing_messages_created ON {M} (created_at, id)",
    ],
    "no ix_tracking": ["DROP INDEX ix_queueing_messages_tracking"],
    "no unique message_id": [f"ALTER TABLE {M} DROP CONSTRAINT queueing_messages_message_id_key"],
    "no ix_status and ix_queue_status": [
        "DROP INDEX ix_queueing_messages_status",
        "DROP INDEX ix_queueing_messages_queue_status",
    ],
    # the indexes as they were before migration 15 (listings holding Leased rows, tracking every row)
    "indexes before 15": [
        "DROP INDEX ix_queueing_messages_created",
        f"CREATE INDEX ix_queueing_messages_created ON {M} (created_at, id)",
        "DROP INDEX ix_queueing_messages_status",
        "DROP INDEX ix_queueing_messages_queue_status",
        "DROP INDEX ix_queueing_messages_tracking",
        f"CREATE INDEX ix_queueing_messages_status ON {M} (status, created_at, id) "
        "WHERE status <> 'Succeeded'",
        f"CREATE INDEX ix_queueing_messages_queue_status ON {M} (queue, status, created_at, id) "
        "WHERE status <> 'Succeeded'",
        f"CREATE INDEX ix_queueing_messages_tracking ON {M} (tracking_id)",
    ],
}

#: the two updates, shaped as the kit's claim and success change a row
CLAIM = (
    f"UPDATE {M} SET status = 'Leased', locked_by = 'bench-worker', "
    "locked_until = now() + interval '30 seconds', lease_token = lease_token + 1, updated_at = now() "
    "WHERE id BETWEEN $1 AND $2"
)
SUCCESS = (
    f"UPDATE {M} SET status = 'Succeeded', attempt = attempt + 1, "
    "locked_by = NULL, locked_until = NULL, updated_at = now(), settled_at = now() "
    "WHERE id BETWEEN $1 AND $2"
)
#: prepared, as the kit's hot path prepares its statements (the server plans each once, not per call)
PREPARE = [f"PREPARE claim(bigint, bigint) AS {CLAIM}", f"PREPARE success(bigint, bigint) AS {SUCCESS}"]

# Counting some other way than the UPDATE counts trigger's query (diagnostics of 2026-12-03, not the
# kit's): the statement counts its own rows into the counts table in a CTE, and the trigger skips its
# count (not its wake-up of result waiters, which stays) when a setting says so. The setting here is a
# plain session one; a real guard would have to be one statement's alone.
C = "queueing_counts"
SKIPPING = (
    _count_function_sql(TABLES, "UPDATE", _done_notice_sql(TABLES))
    .replace(
        "INSERT INTO", "IF current_setting('bench.counted', true) IS DISTINCT FROM 'on' THEN INSERT INTO", 1
    )
    .replace("EXCLUDED.n;", "EXCLUDED.n; END IF;", 1)
)
UPSERT = f"ON CONFLICT (queue, status, archived, shard) DO UPDATE SET n = {C}.n + EXCLUDED.n"


def grouped(update: str, old: str, new: str) -> str:
    """``update`` counting its rows as the trigger does: a union of both sides, grouped."""
    return (
        f"WITH changed AS ({update} RETURNING queue), counted AS (INSERT INTO {C} (queue, status, "
        "archived, shard, n) SELECT queue, s, false, mod(pg_backend_pid(), 16), sum(d) FROM ("
        f"SELECT queue, '{old}' AS s, -1 AS d FROM changed UNION ALL SELECT queue, '{new}', 1 FROM changed"
        f") AS x GROUP BY queue, s ORDER BY queue, s {UPSERT}) SELECT count(*) FROM changed"
    )


def counted(update: str, old: str, new: str) -> str:
    """``update`` counting its rows once, the two counter rows from a VALUES list."""
    return (
        f"WITH changed AS ({update} RETURNING queue), k AS (SELECT min(queue) AS q, count(*) AS k "
        f"FROM changed), counted AS (INSERT INTO {C} (queue, status, archived, shard, n) "
        "SELECT k.q, v.s, false, mod(pg_backend_pid(), 16), v.d * k.k "
        f"FROM k, (VALUES ('{old}', -1), ('{new}', 1)) AS v(s, d) WHERE k.k > 0 ORDER BY 1, 2 {UPSERT}) "
        "SELECT k FROM k"
    )


def pair(count: bool) -> str:
    """One statement: the success of one batch ($1-$2) and the claim of the next ($3-$4), counted in
    it (``count``) or by the trigger, which fires once for both with both in its transition tables."""
    claim = CLAIM.replace("$1", "$3").replace("$2", "$4")
    head = (
        f"PREPARE pair(bigint, bigint, bigint, bigint) AS WITH s AS ({SUCCESS} RETURNING queue), "
        f"c AS ({claim} RETURNING queue), k AS (SELECT coalesce((SELECT min(queue) FROM c), "
        "(SELECT min(queue) FROM s)) AS q, (SELECT count(*) FROM s) AS s, (SELECT count(*) FROM c) AS c)"
    )
    if not count:
        return f"{head} SELECT s, c FROM k"
    return (
        f"{head}, counted AS (INSERT INTO {C} (queue, status, archived, shard, n) "
        "SELECT k.q, v.st, false, mod(pg_backend_pid(), 16), v.d FROM k, LATERAL (VALUES "
        "('Leased', k.c - k.s), ('Pending', -k.c), ('Succeeded', k.s)) AS v(st, d) WHERE v.d <> 0 "
        f"ORDER BY 1, 2 {UPSERT}) SELECT s, c FROM k"
    )


#: variant -> its own prepared statements instead of PREPARE (a ``pair`` variant runs a success and the
#: next claim together: see ``script``)
PREPARED: dict[str, list[str]] = {
    "counted in the statement (grouped)": [
        f"PREPARE claim(bigint, bigint) AS {grouped(CLAIM, 'Pending', 'Leased')}",
        f"PREPARE success(bigint, bigint) AS {grouped(SUCCESS, 'Leased', 'Succeeded')}",
    ],
    "counted in the statement (once)": [
        f"PREPARE claim(bigint, bigint) AS {counted(CLAIM, 'Pending', 'Leased')}",
        f"PREPARE success(bigint, bigint) AS {counted(SUCCESS, 'Leased', 'Succeeded')}",
    ],
    # (the first claim and the last success, run alone, count themselves as well)
    "pair counted in it": [
        pair(count=True),
        f"PREPARE claim(bigint, bigint) AS {counted(CLAIM, 'Pending', 'Leased')}",
        f"PREPARE success(bigint, bigint) AS {counted(SUCCESS, 'Leased', 'Succeeded')}",
    ],
    "pair counted by the trigger": [pair(count=False), *PREPARE],
    "pair uncounted": [pair(count=False), *PREPARE],
}
#: the trigger told to skip its count (the variants' statements count, or nothing does)
SKIPPED = [SKIPPING, "SET bench.counted = 'on'"]
VARIANTS |= {
    "counted in the statement (grouped)": SKIPPED,
    "counted in the statement (once)": SKIPPED,
    "count skipped (uncounted)": SKIPPED,
    "pair counted in it": SKIPPED,
    "pair counted by the trigger": [],
    "pair uncounted": SKIPPED,
}


class Options(argparse.Namespace):
    rows: int
    batches: int
    batch: int
    only: str
    jobs: int


def bindir() -> Path:
    out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
    found = Path(out.stdout.strip()) if out.returncode == 0 else None
    if found is None or not (found / "initdb").exists():
        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not candidates:
            raise SystemExit("no PostgreSQL server binaries (initdb, postgres) on this machine")
        found = candidates[-1]
    return found


def as_server_user(argv: Sequence[str]) -> list[str]:
    """PostgreSQL's binaries refuse to run as root: as the ``postgres`` user then."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else list(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def make_template(pg: Path, data: Path, rows: int) -> None:
    """initdb, the kit's schema made by the kit, ``rows`` Pending messages; the cluster left stopped."""
    subprocess.run(
        as_server_user([str(pg / "initdb"), "-D", str(data), "-A", "trust"]), check=True, capture_output=True
    )
    port = free_port()
    opts = f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off -c autovacuum=off"
    ctl = [str(pg / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(data / "log"), "-w"]
    subprocess.run(as_server_user([*ctl, "start"]), check=True, capture_output=True)
    try:
        url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        rt = Runtime(QueueingApp("bench"), SqlProvider(url))
        await rt.open()
        await rt.close()
        import psycopg

        with psycopg.connect(common.libpq_conninfo(url), autocommit=True) as conn:
            # the kit's own enqueue would do as well; rows straight in keep the template quick, and
            # ids made from the row's number (not random) lay the indexes out the same in every run;
            # a message's tracking id is its own message id, as the kit's enqueue makes it
            conn.execute(
                f"INSERT INTO {M} (message_id, tracking_id, queue, type, status, attempt, created_at, "
                "updated_at, available_at, headers, body) SELECT md5('m' || i)::uuid, md5('m' || i)::uuid, "
                "'bench', 'Noop', 'Pending', 0, now(), now(), now(), '{}', jsonb_build_object('n', i) "
                "FROM generate_series(1, %s) AS i",
                (rows,),
            )
            conn.execute("VACUUM ANALYZE")
    finally:
        subprocess.run(as_server_user([*ctl, "stop"]), check=True, capture_output=True)


def prepared(variant: str) -> list[str]:
    return [*VARIANTS[variant], *PREPARED.get(variant, PREPARE)]


def script(variant: str, batches: int, batch: int) -> str:
    lines = prepared(variant)
    if variant.startswith("pair"):
        # the first claim alone, then each success with the next claim, then the last success alone
        lines.append(f"EXECUTE claim(1, {batch})")
        for k in range(batches - 1):
            a, b = k * batch + 1, (k + 1) * batch
            lines.append(f"EXECUTE pair({a}, {b}, {a + batch}, {b + batch})")
        lines.append(f"EXECUTE success({(batches - 1) * batch + 1}, {batches * batch})")
        return statements(lines)
    for k in range(batches):
        a, b = k * batch + 1, (k + 1) * batch
        lines += [f"EXECUTE claim({a}, {b})", f"EXECUTE success({a}, {b})"]
    return statements(lines)


def statements(lines: Sequence[str]) -> str:
    """``lines`` as single-user mode reads them with ``-j``: each ends with a semicolon and a blank line
    (a function's body may span lines)."""
    return "".join(f"{line};\n\n" for line in lines)


def instructions(pg: Path, template: Path, work: Path, name: str, text: str) -> int:
    data = work / f"data_{re.sub(r'[^a-z0-9]+', '_', name.lower())}"
    shutil.copytree(template, data, symlinks=True)
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "postgres", str(data)], check=True)
    out = work / f"{data.name}.callgrind"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        str(pg / "postgres"),
        "--single",
        "-j",
        "-D",
        str(data),
        "-c",
        "fsync=off",
        "-c",
        "autovacuum=off",
        "postgres",
    ]
    done = subprocess.run(as_server_user(argv), input=text, capture_output=True, text=True, check=False)
    if "ERROR" in done.stdout or "ERROR" in done.stderr:
        errors = [line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line]
        raise SystemExit(f"{name}: {errors[:3]}")
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"{name}: no instruction count from valgrind:\n{done.stderr[-2000:]}")
    shutil.rmtree(data, ignore_errors=True)
    return int(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--batches", type=int, default=150)
    p.add_argument("--batch", type=int, default=10, help="rows a statement changes (a claim's size)")
    p.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    args = p.parse_args(namespace=Options())
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    names = [v.strip() for v in args.only.split(",")] if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"no such variant: {unknown} (the variants: {', '.join(VARIANTS)})")
    if "base" not in names:
        names.insert(0, "base")
    messages = args.batches * args.batch
    if messages > args.rows:
        raise SystemExit("--batches of --batch rows must fit in --rows")
    pg = bindir()
    print(f"== PostgreSQL instructions per message of a claim and a success ({pg})")
    shape = f"{args.batches} batches of {args.batch} ({messages:,} messages)"
    print(f"   {args.rows:,} rows, {shape}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_pg_instr_") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o777)  # the server's own user writes here
        template = work / "template"
        asyncio.run(make_template(pg, template, args.rows))
        # each variant's own statements with no updates: what start-up and the variant itself cost
        runs = {f"{n} (no updates)": statements(prepared(n)) for n in names}
        runs |= {n: script(n, args.batches, args.batch) for n in names}
        with ThreadPoolExecutor(args.jobs) as pool:
            counted = dict(
                zip(
                    runs,
                    pool.map(lambda kv: instructions(pg, template, work, *kv), runs.items()),
                    strict=True,
                )
            )
    per = {n: (counted[n] - counted[f"{n} (no updates)"]) / messages for n in names}
    rows = [
        [n, f"{per[n]:,.0f}", f"{per[n] - per['base']:+,.0f}", f"{per[n] / per['base'] - 1:+.1%}"]
        for n in names
    ]
    common.print_table(["variant", "instructions/msg", "vs base", "%"], rows)


if __name__ == "__main__":
    main()
