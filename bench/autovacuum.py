"""What autovacuum would do to a schema's tables, for a server that runs with ``autovacuum = off``.

The shared PostgreSQL of this machine has autovacuum off (a test setting), so a churn benchmark on it
measures a queue that is never vacuumed: the worst case, and not what a deployment sees. This stand-in
makes autovacuum's decisions itself, on PostgreSQL's own rules, and only for the tables it is given:

- every ``naptime`` seconds, and whenever it is nudged (a churn cycle's simulated hour is a couple of
  real seconds, while autovacuum looks at a busy table hundreds of times an hour), it reads each
  table's statistics (``pg_stat_user_tables``) and its storage parameters (the kit's per-table
  autovacuum settings), falling back to the server's settings;
- it vacuums a table whose dead rows pass ``autovacuum_vacuum_threshold + scale_factor * reltuples``,
  or whose rows inserted since the last vacuum pass the insert threshold, and analyzes one whose rows
  changed since the last analyze pass the analyze threshold;
- with autovacuum's own cost settings (``autovacuum_vacuum_cost_delay`` and ``_limit``, which a manual
  VACUUM does not have), so it is throttled as autovacuum is;
- on a connection of its own, in a thread, beside the workers, as autovacuum's workers run.

On a server with autovacuum on it does nothing, and the table's ``autovacuum_count`` says what ran.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

#: PostgreSQL's settings behind each decision (a table's storage parameter of the same name overrides each)
_SETTINGS = (
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_analyze_threshold",
    "autovacuum_analyze_scale_factor",
)


@dataclass
class Ran:
    """What the stand-in ran on one table."""

    vacuums: int = 0
    analyzes: int = 0
    seconds: float = 0.0


@dataclass
class AutovacuumStandIn:
    conninfo: str
    schema: str
    tables: tuple[str, ...]
    naptime: float = 15.0
    ran: dict[str, Ran] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def server_runs_autovacuum(self) -> bool:
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT current_setting('autovacuum') = 'on'").fetchone()
        return bool(row and row[0])

    def start(self) -> bool:
        """Start deciding for the tables; False (and nothing started) when the server's autovacuum runs."""
        if self.server_runs_autovacuum():
            return False
        self.ran = {t: Ran() for t in self.tables}
        self._thread = threading.Thread(target=self._run, name="autovacuum stand-in", daemon=True)
        self._thread.start()
        return True

    def nudge(self) -> None:
        """Look at the tables now (it goes on beside the caller, as autovacuum does)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise RuntimeError("the autovacuum stand-in failed") from self.error

    def _run(self) -> None:
        try:
            with psycopg.connect(self.conninfo, autocommit=True) as conn:
                # autovacuum's throttle, not a manual VACUUM's (which has none)
                for knob in ("vacuum_cost_delay", "vacuum_cost_limit"):
                    # (-1 means "the manual VACUUM's value")
                    conn.execute(
                        "SELECT set_config(%(knob)s, CASE current_setting(%(auto)s) WHEN '-1' "
                        "THEN current_setting(%(knob)s) ELSE current_setting(%(auto)s) END, false)",
                        {"knob": knob, "auto": f"autovacuum_{knob}"},
                    )
                while True:
                    self._wake.wait(self.naptime)
                    self._wake.clear()
                    if self._stop.is_set():
                        return
                    for table in self.tables:
                        self._decide(conn, table)
        except BaseException as exc:  # (reported by stop)
            self.error = exc

    def _decide(self, conn: psycopg.Connection[tuple[object, ...]], table: str) -> None:
        row = conn.execute(
            """SELECT s.n_dead_tup, s.n_ins_since_vacuum, s.n_mod_since_analyze, greatest(c.reltuples, 0),
                      coalesce(c.reloptions, '{}')
               FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
               WHERE s.schemaname = %s AND s.relname = %s""",
            (self.schema, table),
        ).fetchone()
        if row is None:
            return
        dead, inserted, modified = (int(str(v)) for v in row[:3])
        reltuples = float(str(row[3]))
        # (the kit's per-table settings have the server settings' own names)
        options: list[str] = list(row[4])  # type: ignore[call-overload]
        per_table = dict(o.split("=", 1) for o in options)
        server = conn.execute(
            sql.SQL("SELECT {}").format(
                sql.SQL(", ").join(sql.SQL("current_setting({})").format(sql.Literal(s)) for s in _SETTINGS)
            )
        ).fetchone()
        assert server is not None
        setting = {
            name: float(per_table.get(name, str(value)))
            for name, value in zip(_SETTINGS, server, strict=True)
        }

        def over(count: int, kind: str) -> bool:
            return (
                count
                > setting[f"autovacuum_{kind}_threshold"]
                + setting[f"autovacuum_{kind}_scale_factor"] * reltuples
            )

        vacuum = over(dead, "vacuum") or over(inserted, "vacuum_insert")
        analyze = over(modified, "analyze")
        if not (vacuum or analyze):
            return
        name = sql.Identifier(self.schema, table)
        started = time.perf_counter()
        if vacuum:
            conn.execute(
                sql.SQL("VACUUM (ANALYZE {}) {}").format(sql.SQL("true" if analyze else "false"), name)
            )
        else:
            conn.execute(sql.SQL("ANALYZE {}").format(name))
        ran = self.ran[table]
        ran.seconds += time.perf_counter() - started
        ran.vacuums += vacuum
        ran.analyzes += analyze
