"""Tables of the SQL provider and their versioned migrations.

Every statement the provider runs is built from these SQLAlchemy Core tables, so one definition
serves SQLite and PostgreSQL. Migrations are a numbered list applied in order under a lock
(PostgreSQL advisory lock; SQLite's single writer), recorded in ``queueing_schema``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement
from sqlalchemy.types import NullType

from ...errors import ConfigurationError, ProviderUnavailable
from ...messages import MessageStatus

log = logging.getLogger("queueing.sql")

#: a schema name the kit accepts: it is written into DDL, triggers and LISTEN unquoted, where PostgreSQL
#: folds it to lower case, while the names SQLAlchemy quotes keep their case; an upper-case letter made
#: the two name different schemas (the count triggers' functions failed at migration 2, and LISTEN and
#: NOTIFY used different channels), so only lower case is accepted
SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
Json = sa.JSON().with_variant(JSONB(), "postgresql")
Timestamp = sa.DateTime(timezone=True)

#: statuses a worker may claim (custom statuses, Leased, Abandoned and terminal ones are never claimed)
CLAIMABLE = (
    MessageStatus.PENDING.value,
    MessageStatus.FAILED.value,
    MessageStatus.SLEEPING.value,
    MessageStatus.WAITING_FOR_HANDLER.value,
    MessageStatus.PAUSED.value,
)


#: ids bound in one statement's ``IN (...)`` list, at most (SQLite takes at most 32,766 bound values)
IN_LIST_BATCH = 500

#: the claim index's predicate, as text. Queries must repeat it word for word: a planner uses a
#: partial index only when it can prove the query implies the predicate, and bound parameters or
#: ``archived = 0`` (SQLAlchemy's SQLite rendering of ``NOT archived``) defeat that proof.
CLAIMABLE_SQL = "status IN ({}) AND NOT archived".format(", ".join(f"'{s}'" for s in CLAIMABLE))


#: the lease sweeper's index's predicate (the rows running now)
LEASED_SQL = f"status = '{MessageStatus.LEASED.value}'"

#: the listing indexes' predicate (v15): every row but the bulk of the table (Succeeded, listed through
#: ix_..._created) and the few running now (Leased, listed through the lease sweeper's index)
LISTED_SQL = f"status NOT IN ('{MessageStatus.SUCCEEDED.value}', '{MessageStatus.LEASED.value}')"

#: the predicate of the listing index by time (v16, PostgreSQL): every row but the few running now,
#: listed through the lease sweeper's index (``SqlTracker.query`` adds them)
UNLEASED_SQL = f"status <> '{MessageStatus.LEASED.value}'"

#: the tracking index's predicate (v15): a message's tracking id is its own message id unless its sender
#: gave one (the tracking id of a message sent before, for the same work) or it was sent before v15
COPIES_SQL = "tracking_id <> message_id"


def tracked_by(table: sa.Table, tracking_id: Any) -> sa.ColumnElement[bool]:
    """``tracking_id = :tracking_id``, said so that each half of it has an index: the rows whose
    tracking id is their own message id through the unique message id, the others through the tracking
    index, which holds only them (the planner must find the index's predicate in the query)."""
    c = table.c
    return sa.or_(
        sa.and_(c.message_id == tracking_id, c.tracking_id == tracking_id),
        sa.and_(c.tracking_id == tracking_id, c.tracking_id != c.message_id),  # (COPIES_SQL)
    )


def claimable() -> sa.TextClause:
    return sa.text(CLAIMABLE_SQL)


class _Bare(FunctionElement[Any]):
    """A boolean column said bare: ``archived`` and ``NOT archived`` on every dialect."""

    inherit_cache = True
    type = NullType()  # (a Boolean type would be written ``= 1`` again on SQLite)


@compiles(_Bare)
def _bare(element: _Bare, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.clauses, **kw)


def archived(table: sa.FromClause, flag: bool = True) -> sa.ColumnElement[bool]:
    """``archived`` (or ``NOT archived``) as the partial indexes' predicates say it. SQLAlchemy writes a
    boolean column as ``archived = 1`` / ``archived = 0`` on SQLite, from which SQLite's planner cannot
    prove an index's ``WHERE archived`` / ``WHERE NOT archived``: it reads the whole table instead
    (every retention batch did, on every upkeep pass, under SQLite's one write lock)."""
    said: sa.ColumnElement[bool] = _Bare(table.c.archived)
    return said if flag else sa.not_(said)


def by_id(table: sa.Table, ids: sa.Select[Any], backend: str) -> sa.ColumnElement[bool]:
    """The rows whose ``id`` ``ids`` selects, fetched by primary key. PostgreSQL is given the ids as one
    array: with ``id IN (subquery)`` (or a join) it may hash a scan of the whole table to match them,
    and a prepared statement's generic plan, planned for a LIMIT of unknown size, always does."""
    if backend == "postgresql":
        return table.c.id == sa.any_(sa.func.array(ids.scalar_subquery()))
    return table.c.id.in_(ids.scalar_subquery())


def first_rows(
    table: sa.Table, where: Sequence[sa.ColumnElement[bool]], limit: int, backend: str
) -> list[sa.ColumnElement[bool]]:
    """The WHERE of an UPDATE or DELETE of the first ``limit`` rows ``where`` selects (a batch of
    retention): the rows fetched by primary key, and ``where`` said again. A row another transaction
    changed while this one waited for its lock is then left alone: PostgreSQL checks only the
    statement's own WHERE against the row's new version, so an operator's retry of a Succeeded message,
    committed meanwhile, would otherwise be deleted (or a retried dead letter archived, never to run)."""
    ids = sa.select(table.c.id).where(*where).limit(limit)
    return [by_id(table, ids, backend), *where]


def partial_index(name: str, *columns: str, where: str | sa.TextClause) -> sa.Index:
    """An index over the rows ``where`` matches, with the same predicate on PostgreSQL and SQLite."""
    clause = sa.text(where) if isinstance(where, str) else where
    return sa.Index(name, *columns, postgresql_where=clause, sqlite_where=clause)


#: the listing indexes by status (PostgreSQL only)
LISTING_INDEXES = ("ix_queueing_messages_status", "ix_queueing_messages_queue_status")
#: indexes of queueing_messages that SQLite's planner never uses for the kit's queries (migration 11)
SQLITE_UNUSED_INDEXES = LISTING_INDEXES


def _postgresql_only(*indexes: sa.Index) -> tuple[sa.Index, ...]:
    """Indexes created on PostgreSQL only (``CREATE INDEX`` skipped on other dialects)."""
    for index in indexes:
        index.ddl_if(dialect="postgresql")
    return indexes


def message_columns() -> list[sa.Column[Any]]:
    """The leading columns of one message's row: in the SQL provider's messages and in the history."""
    return [
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True
        ),
        sa.Column("message_id", sa.Uuid(), nullable=False, unique=True),
        sa.Column("tracking_id", sa.Uuid(), nullable=False),
        sa.Column("queue", sa.String(200), nullable=False),
        sa.Column("type", sa.String(256), nullable=False),
        sa.Column("status", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("correlation_id", sa.String(256)),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("not_before", Timestamp),
    ]


def build_metadata(schema: str | None = None) -> sa.MetaData:
    md = sa.MetaData(schema=schema)
    sa.Table(
        "queueing_messages",
        md,
        *message_columns(),
        # when the message may next be claimed: not_before, a retry time, a deferral, or creation
        sa.Column("available_at", Timestamp, nullable=False),
        sa.Column("expires_at", Timestamp),
        sa.Column("locked_by", sa.String(128)),
        sa.Column("locked_until", Timestamp),
        # the claim fence: every claim adds one, and a settlement, renewal or release must name the
        # value its claim set, so a run whose lease was released or swept cannot touch the row again
        sa.Column("lease_token", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text()),
        sa.Column("reason", sa.String(128)),
        sa.Column("description", sa.Text()),
        sa.Column("headers", Json, nullable=False),
        sa.Column("body", Json),
        sa.Column("raw", sa.Text()),  # the stored text of a body that no longer decodes
        sa.Column("result", Json),
        # v6: what a running handler last reported ({"step", "total", "text", "at"})
        sa.Column("progress", Json),
        # v6: an idempotent type's identity key (the enqueue of an identical pending copy is discarded)
        sa.Column("identity", sa.String(256)),
        sa.Column("settled_at", Timestamp),
        sa.Column("archived", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("archived_at", Timestamp),
        # v10: someone waits for this message's outcome (``app.result``): on PostgreSQL the counts
        # trigger NOTIFYs when such a row reaches a final status (see ``_v14``); a statement without
        # such a row costs one look over its rows
        sa.Column("awaited", sa.Boolean(), nullable=False, server_default=sa.false()),
        # v17: an idempotent type's newer version, enqueued while this one was running (a row of its
        # own): this one, if it comes back to run (its retry), is settled superseded by it. Cleared by
        # an operator's retry or put-back, which asks for it to run
        sa.Column("superseded_by", sa.Uuid()),
        # the claim: queue + due time, only over claimable, unarchived rows (a small partial index)
        partial_index("ix_queueing_messages_claim", "queue", "available_at", "id", where=claimable()),
        # the lease sweeper: only leased rows, by queue (v13). Not by ``locked_until``: a renewal changes
        # that column alone, and with no index holding it a renewal is a HOT update on PostgreSQL (no
        # new index entries; the new version on the same page) and writes no index on SQLite. The
        # sweep then reads a queue's leased rows, which are only the messages running now
        partial_index("ix_queueing_messages_leased", "queue", where=LEASED_SQL),
        # Ops listings, newest first. Every status change is a non-HOT update that re-inserts the row
        # into each index whose predicate it matches, so the listing indexes leave out Succeeded (the
        # bulk of the table): settling a success touches few indexes, and a page of Succeeded rows is
        # found quickly through ix_..._created anyway. They leave out Leased as well (v15): a claim
        # then writes neither (about 12 % of the server's instructions for a claim and a success), and the
        # rows running now, a handful a worker, are listed through ix_..._leased.
        # PostgreSQL only (v11 drops them from SQLite databases made before): SQLite's planner uses a
        # partial index only for a query that repeats its predicate, and no query repeats theirs
        # (a listing by status reads ix_..._created there), yet a claim and
        # a settlement each rewrote the row's entries in both, 6 of a message's 10 index writes
        *_postgresql_only(
            partial_index("ix_queueing_messages_status", "status", "created_at", "id", where=LISTED_SQL),
            partial_index(
                "ix_queueing_messages_queue_status",
                "queue",
                "status",
                "created_at",
                "id",
                where=LISTED_SQL,
            ),
        ),
        # every listing not by status alone, newest first. Without the rows running now on PostgreSQL
        # (v16), so a claim writes no entry here (8 % of the server's instructions for a claim and a
        # success at claims of 10); a listing that may hold them reads those through ix_..._leased
        # (``SqlTracker.query``). SQLite keeps them: its planner would use the index only for a query
        # that repeats the predicate, and its claims cost no more for it
        sa.Index("ix_queueing_messages_created", "created_at", "id", postgresql_where=sa.text(UNLEASED_SQL)),
        partial_index(
            "ix_queueing_messages_correlation", "correlation_id", where="correlation_id IS NOT NULL"
        ),
        # retention: settled, not yet archived / archived
        partial_index(
            "ix_queueing_messages_settled", "settled_at", where="settled_at IS NOT NULL AND NOT archived"
        ),
        partial_index("ix_queueing_messages_archived", "archived_at", where="archived"),
        # v6: job control looks messages up by tracking id (see ``tracked_by``), and idempotent types
        # by identity. Only the rows whose tracking id is not their own message id (v15): a message's
        # first run, nearly every row, is found by its unique message id, and no claim or settlement
        # of it writes this index (9 % of the server's instructions for a claim and a success)
        partial_index("ix_queueing_messages_tracking", "tracking_id", where=COPIES_SQL),
        partial_index("ix_queueing_messages_identity", "type", "identity", where="identity IS NOT NULL"),
        # SQLite: ids never reused (v12). Without AUTOINCREMENT a new row takes the highest id left
        # plus one, so deleting the newest row hands its id to the next message, whose first claim
        # could get the same lease token as the deleted row's (with tokens counted from 0, it always
        # did): the fence on (id, token) then let a run of the deleted message settle or renew the
        # new one. PostgreSQL's sequence never gives an id twice.
        sqlite_autoincrement=True,
    )
    sa.Table(
        "queueing_pauses",
        md,
        sa.Column("kind", sa.String(8), primary_key=True),  # 'queue' | 'type'
        sa.Column("name", sa.String(256), primary_key=True),
        sa.Column("paused_at", Timestamp, nullable=False),
    )
    sa.Table(
        "queueing_circuits",
        md,
        sa.Column("type", sa.String(256), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("consecutive_failures", sa.Integer(), nullable=False),
        sa.Column("opened_at", Timestamp),
        sa.Column("open_until", Timestamp),
        sa.Column("probe_until", Timestamp),
        sa.Column("version", sa.Integer(), nullable=False),  # optimistic concurrency
    )
    sa.Table(
        "queueing_counts",
        md,
        sa.Column("queue", sa.String(200), primary_key=True),
        sa.Column("status", sa.String(64), primary_key=True),
        sa.Column("archived", sa.Boolean(), primary_key=True),
        sa.Column("shard", sa.SmallInteger(), primary_key=True),
        sa.Column("n", sa.BigInteger(), nullable=False),
    )
    # v3: side stores for transports that keep neither history nor long delays themselves (RabbitMQ,
    # SQS). Not used by the SQL provider, whose messages table is its own history.
    sa.Table(
        "queueing_history",
        md,
        *message_columns(),
        sa.Column("expires_at", Timestamp),
        sa.Column("locked_by", sa.String(128)),
        sa.Column("locked_until", Timestamp),
        sa.Column("last_error", sa.Text()),
        sa.Column("reason", sa.String(128)),
        sa.Column("description", sa.Text()),
        # JSON as text: history is read whole, never queried inside, and text keeps SQL NULL ("not
        # known") apart from JSON null on both databases (what the merge of partial records relies on)
        sa.Column("headers", sa.Text(), nullable=False),
        sa.Column("body", sa.Text()),
        sa.Column("raw", sa.Text()),
        sa.Column("result", sa.Text()),
        sa.Column("archived", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("archived_at", Timestamp),
        sa.Column("progress", sa.Text()),  # v6
        # v9: deliveries completed as known duplicates (a repeated forward whose outcome was recorded)
        sa.Column("duplicates", sa.Integer()),
        # listings, newest first (keyset on created_at, id), by status and by queue + status
        sa.Index("ix_queueing_history_created", "created_at", "id"),
        sa.Index("ix_queueing_history_status", "status", "created_at", "id"),
        sa.Index("ix_queueing_history_queue_status", "queue", "status", "created_at", "id"),
        # counts per (queue, status) of unarchived records: an index-only scan
        partial_index("ix_queueing_history_counts", "queue", "status", where="NOT archived"),
        # retention: finished records by last update
        sa.Index("ix_queueing_history_updated", "updated_at"),
        # v6: job control looks records up by tracking id
        sa.Index("ix_queueing_history_tracking", "tracking_id"),
    )
    sa.Table(
        "queueing_delayed",
        md,
        sa.Column("id", sa.Uuid(), primary_key=True),
        sa.Column("message_id", sa.Uuid(), nullable=False, index=True),
        # which transport forwards it (one database may serve several), and its physical queue there
        sa.Column("transport", sa.String(32), nullable=False),
        sa.Column("destination", sa.String(260), nullable=False),
        sa.Column("due_at", Timestamp, nullable=False),
        sa.Column("envelope", sa.Text(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text()),
        sa.Column("created_at", Timestamp, nullable=False),
        # v8: fetches that did not report back (a forward of it may have reached the transport)
        sa.Column("claims", sa.Integer(), nullable=False, server_default="0"),
        sa.Index("ix_queueing_delayed_due", "transport", "due_at"),
    )
    # v4: the lease of each message a transport holds that cannot fence a settlement by itself (SQS:
    # a stale receipt handle may still delete). Written at receive, checked and removed at settlement.
    sa.Table(
        "queueing_leases",
        md,
        sa.Column("transport", sa.String(32), primary_key=True),
        sa.Column("message_key", sa.String(128), primary_key=True),  # the transport's own message id
        sa.Column("token", sa.Uuid(), nullable=False),
        sa.Column("until", Timestamp, nullable=False),
        sa.Index("ix_queueing_leases_until", "until"),
    )
    # v5: one row per schedule tick, unique per (schedule, tick): claiming a tick and writing its
    # messages happen in one transaction on the SQL transport; RabbitMQ and SQS claim, send, confirm
    sa.Table(
        "queueing_schedule_ticks",
        md,
        sa.Column("schedule", sa.String(200), primary_key=True),
        sa.Column("tick_at", Timestamp, primary_key=True),
        sa.Column("state", sa.String(8), nullable=False),  # 'sent' | 'claimed'
        sa.Column("claimed_until", Timestamp),
        sa.Column("messages", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("fired_at", Timestamp, nullable=False),
    )
    # v6: cancellation requests for running messages (and, on transports that cannot take a message
    # back, for waiting ones): every host checks them while its handlers run
    sa.Table(
        "queueing_cancels",
        md,
        sa.Column("message_id", sa.Uuid(), primary_key=True),
        sa.Column("requested_at", Timestamp, nullable=False),
        sa.Index("ix_queueing_cancels_requested", "requested_at"),
    )
    # v10: per idempotent identity on transports without a messages table (RabbitMQ, SQS): the newest
    # version sent, the versions it superseded, the last that succeeded; one JSON document per row,
    # changed by compare-and-set on ``version`` (see queueing_core.idempotency)
    sa.Table(
        "queueing_identities",
        md,
        sa.Column("type", sa.String(256), primary_key=True),
        sa.Column("identity", sa.String(256), primary_key=True),
        sa.Column("doc", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
    )
    sa.Table(
        "queueing_schema",
        md,
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("description", sa.String(200), nullable=False),
        sa.Column("applied_at", Timestamp, nullable=False),
    )
    return md


@dataclass(frozen=True)
class Tables:
    metadata: sa.MetaData
    messages: sa.Table
    pauses: sa.Table
    circuits: sa.Table
    schema_versions: sa.Table
    counts: sa.Table
    history: sa.Table
    delayed: sa.Table
    leases: sa.Table
    ticks: sa.Table
    cancels: sa.Table
    identities: sa.Table

    @classmethod
    def build(cls, schema: str | None = None) -> Tables:
        if schema is not None and not SCHEMA_NAME.fullmatch(schema):
            # it is spliced into DDL as an identifier: lower-case letters, digits and underscores only
            raise ConfigurationError(
                "QUEUEING_DATABASE_SCHEMA",
                f"{schema!r} is not a plain lower-case identifier",
                "lower-case letters, digits and _, starting with a letter or _, at most 63 "
                "(PostgreSQL folds unquoted names to lower case)",
            )
        md = build_metadata(schema)
        t = md.tables
        key = (lambda n: f"{schema}.{n}") if schema else (lambda n: n)
        return cls(
            md,
            t[key("queueing_messages")],
            t[key("queueing_pauses")],
            t[key("queueing_circuits")],
            t[key("queueing_schema")],
            t[key("queueing_counts")],
            t[key("queueing_history")],
            t[key("queueing_delayed")],
            t[key("queueing_leases")],
            t[key("queueing_schedule_ticks")],
            t[key("queueing_cancels")],
            t[key("queueing_identities")],
        )


Migration = Callable[[sa.Connection, Tables], None]


def _v1(conn: sa.Connection, tables: Tables) -> None:
    tables.metadata.create_all(conn, tables=[tables.messages, tables.pauses, tables.circuits])


def _function(tables: Tables, name: str) -> str:
    """A function of the kit's, in the tables' schema (the search path's when there is none)."""
    schema = tables.metadata.schema
    return f"{schema}.{name}" if schema else name


def _count_function(tables: Tables, op: str) -> str:
    """The name of the counts trigger's function for ``op`` (INSERT, UPDATE or DELETE)."""
    return _function(tables, f"queueing_count_changes_{op.lower()}")


def _count_function_sql(tables: Tables, op: str, then: str = "") -> str:
    """``CREATE OR REPLACE`` of the counts trigger's function for ``op`` (see ``_v2``), with ``then``
    run after the counts (``_v14``'s wake-up of result waiters). Without ``then`` this is ``_v2``'s
    function exactly, and must stay so: a released migration never changes."""
    c = tables.counts.fullname
    delta = "SELECT queue, status, archived, 1 AS d FROM new_rows"
    minus = "SELECT queue, status, archived, -1 AS d FROM old_rows"
    source = {"INSERT": delta, "UPDATE": f"{delta} UNION ALL {minus}", "DELETE": minus}[op]
    # identifiers only, from the table metadata (the schema name is validated by Tables.build)
    return f"""
            CREATE OR REPLACE FUNCTION {_count_function(tables, op)}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {c} (queue, status, archived, shard, n)
                SELECT queue, status, archived, mod(pg_backend_pid(), 16), sum(d)
                FROM ({source}) AS changes
                GROUP BY queue, status, archived
                HAVING sum(d) <> 0
                ORDER BY queue, status, archived  -- one lock order for every writer: no deadlocks
                ON CONFLICT (queue, status, archived, shard) DO UPDATE SET n = {c}.n + EXCLUDED.n;{then}
                RETURN NULL;
            END $$"""


def _v2(conn: sa.Connection, tables: Tables) -> None:
    """Message counts per (queue, status, archived) kept by statement-level triggers (PostgreSQL).

    ``GET stats`` must stay fast on a table of millions of rows without counting them. Each INSERT,
    UPDATE or DELETE statement adds its net change per group in one upsert (a 100-row claim is one
    statement, so one upsert), spread over 16 shard rows chosen by backend pid so concurrent workers
    rarely wait on the same counter row; readers sum the shards. SQLite counts with GROUP BY instead
    (it serves one host and smaller tables).
    """
    tables.counts.create(conn, checkfirst=True)
    if conn.dialect.name != "postgresql":
        return
    m, c = tables.messages.fullname, tables.counts.fullname
    for op in ("INSERT", "UPDATE", "DELETE"):
        name = _count_function(tables, op)
        conn.exec_driver_sql(_count_function_sql(tables, op))
        refs = {
            "INSERT": "NEW TABLE AS new_rows",
            "UPDATE": "OLD TABLE AS old_rows NEW TABLE AS new_rows",
            "DELETE": "OLD TABLE AS old_rows",
        }[op]
        trigger = f"queueing_count_{op.lower()}"
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {trigger} ON {m}")
        conn.exec_driver_sql(
            f"CREATE TRIGGER {trigger} AFTER {op} ON {m} REFERENCING {refs} FOR EACH STATEMENT "
            f"EXECUTE FUNCTION {name}()"
        )
    # rows that existed before the triggers
    conn.exec_driver_sql(f"""
        INSERT INTO {c} (queue, status, archived, shard, n)
        SELECT queue, status, archived, 0, count(*) FROM {m} GROUP BY queue, status, archived
        ON CONFLICT (queue, status, archived, shard) DO UPDATE SET n = {c}.n + EXCLUDED.n""")


def _v3(conn: sa.Connection, tables: Tables) -> None:
    """Message history and the delayed-message store for RabbitMQ and SQS."""
    tables.metadata.create_all(conn, tables=[tables.history, tables.delayed])


def _v4(conn: sa.Connection, tables: Tables) -> None:
    """The per-claim lease token on messages, and the lease table for transports that cannot fence
    settlements themselves. Existing rows start at token 0; a row leased by a worker of an older
    version is still settled by that worker's own guard (its id), or swept when its lease lapses."""
    tables.metadata.create_all(conn, tables=[tables.leases])
    m = tables.messages
    have = {c["name"] for c in sa.inspect(conn).get_columns(m.name, schema=m.schema)}
    if "lease_token" not in have:  # a database created at this version has it from v1 already
        # identifiers only, from the table metadata (the schema name is validated by Tables.build)
        conn.exec_driver_sql(f"ALTER TABLE {m.fullname} ADD COLUMN lease_token INTEGER NOT NULL DEFAULT 0")


def _v5(conn: sa.Connection, tables: Tables) -> None:
    """Schedule ticks, claimed once across hosts."""
    tables.metadata.create_all(conn, tables=[tables.ticks])


def _v6(conn: sa.Connection, tables: Tables) -> None:
    """Job control: cancellation requests, progress, identity of idempotent messages, and lookups by
    tracking id. Columns are added only where missing (a database created at this version has them)."""
    tables.metadata.create_all(conn, tables=[tables.cancels])
    for table, columns in (
        (tables.messages, {"progress": tables.messages.c.progress, "identity": tables.messages.c.identity}),
        (tables.history, {"progress": tables.history.c.progress}),
    ):
        if not sa.inspect(conn).has_table(table.name, schema=table.schema):
            continue
        have = {c["name"] for c in sa.inspect(conn).get_columns(table.name, schema=table.schema)}
        for name, column in columns.items():
            if name not in have:
                kind = column.type.compile(dialect=conn.dialect)
                # identifiers only, from the table metadata (the schema name is validated by Tables.build)
                conn.exec_driver_sql(f"ALTER TABLE {table.fullname} ADD COLUMN {name} {kind}")
    added = ("ix_queueing_messages_tracking", "ix_queueing_messages_identity", "ix_queueing_history_tracking")
    for index in (*tables.messages.indexes, *tables.history.indexes):
        if index.name in added:
            index.create(conn, checkfirst=True)


#: storage parameters of the hot tables (PostgreSQL), set by migration 7. A claim, a renewal and a
#: settlement each write a new version of the row; leaving 15 % of each page free lets that version
#: stay on the row's page. The counters table is a few hundred rows rewritten on every statement.
#: Vacuum runs after 1 % of the table changed (plus a floor), not PostgreSQL's 20 %, so dead versions
#: in the claim index are cleared long before history of millions of rows would let them pile up.
#: Released with migration 7: a different value is a new migration, not an edit here.
HOT_TABLE_SETTINGS = {
    "queueing_messages": {
        "fillfactor": 85,
        "autovacuum_vacuum_scale_factor": 0.01,
        "autovacuum_vacuum_threshold": 1000,
        "autovacuum_vacuum_insert_scale_factor": 0.02,
        "autovacuum_analyze_scale_factor": 0.02,
        "autovacuum_analyze_threshold": 1000,
    },
    "queueing_counts": {
        "fillfactor": 50,
        "autovacuum_vacuum_scale_factor": 0.0,
        "autovacuum_vacuum_threshold": 5000,
    },
}


def _v7(conn: sa.Connection, tables: Tables) -> None:
    """Room on each page for the next version of a row, and vacuum that keeps up with a queue whose
    history is much larger than its backlog (PostgreSQL; SQLite has no such parameters)."""
    if conn.dialect.name != "postgresql":
        return
    for table in (tables.messages, tables.counts):
        params = ", ".join(f"{k} = {v}" for k, v in HOT_TABLE_SETTINGS[table.name].items())
        # identifiers from the table metadata, numbers from the constant above: nothing from input
        conn.exec_driver_sql(f"ALTER TABLE {table.fullname} SET ({params})")


def _v8(conn: sa.Connection, tables: Tables) -> None:
    """The delayed store counts fetches that did not report back, so a forward that may already have
    reached the transport is marked when it is sent again."""
    d = tables.delayed
    have = {c["name"] for c in sa.inspect(conn).get_columns(d.name, schema=d.schema)}
    if "claims" not in have:  # a database created at this version has it from v3 already
        # identifiers only, from the table metadata (the schema name is validated by Tables.build)
        conn.exec_driver_sql(f"ALTER TABLE {d.fullname} ADD COLUMN claims INTEGER NOT NULL DEFAULT 0")


def _v9(conn: sa.Connection, tables: Tables) -> None:
    """History counts the deliveries completed as known duplicates."""
    h = tables.history
    if not sa.inspect(conn).has_table(h.name, schema=h.schema):
        return
    have = {c["name"] for c in sa.inspect(conn).get_columns(h.name, schema=h.schema)}
    if "duplicates" not in have:  # a database created at this version has it from v3 already
        # identifiers only, from the table metadata (the schema name is validated by Tables.build)
        conn.exec_driver_sql(f"ALTER TABLE {h.fullname} ADD COLUMN duplicates INTEGER")


#: NOTIFY payload prefix of a message that reached a final status while someone waited for it
DONE_PREFIX = "\x1fdone\x1f"


def done_channel_for(schema: str | None) -> str:
    """The NOTIFY channel of those payloads: not the queue wake-up channel, which hosts of an older
    version hear and would keep a wake-up event for, one per awaited message, never removed."""
    from .listener import channel_name

    return channel_name("queueing_done", schema)


def _v10(conn: sa.Connection, tables: Tables) -> None:
    """Idempotent identities for the brokers that keep their history here, and result waiters woken by
    NOTIFY (PostgreSQL).

    A waiter (``app.result``) sets ``awaited`` on its message's row, then waits. The trigger below
    fires only for rows whose ``awaited`` is set and whose status just became final: its WHEN clause is
    tested on the row in C, without calling the function, so the settlements nobody waits for (nearly
    all of them) pay one boolean test and send no NOTIFY. The waiter keeps polling at a slow interval,
    so a NOTIFY lost to a dropped LISTEN connection only delays it.
    """
    tables.metadata.create_all(conn, tables=[tables.identities])
    m = tables.messages
    if not sa.inspect(conn).has_table(m.name, schema=m.schema):
        return
    have = {c["name"] for c in sa.inspect(conn).get_columns(m.name, schema=m.schema)}
    if "awaited" not in have:  # a database created at this version has it from v1 already
        # identifiers only, from the table metadata (the schema name is validated by Tables.build)
        conn.exec_driver_sql(f"ALTER TABLE {m.fullname} ADD COLUMN awaited BOOLEAN NOT NULL DEFAULT false")
    if conn.dialect.name != "postgresql":
        return
    schema = tables.metadata.schema
    fn = _function(tables, "queueing_notify_done")
    channel = done_channel_for(schema).replace("'", "''")
    final = ", ".join(f"'{s.value}'" for s in MessageStatus.terminal())
    # identifiers from the table metadata, the channel from the validated schema name, statuses from
    # the enum: nothing from input
    conn.exec_driver_sql(f"""
        CREATE OR REPLACE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{channel}', chr(31) || 'done' || chr(31) || NEW.message_id::text);
            RETURN NULL;
        END $$""")
    conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS queueing_notify_done ON {m.fullname}")
    conn.exec_driver_sql(
        f"CREATE TRIGGER queueing_notify_done AFTER UPDATE ON {m.fullname} FOR EACH ROW "
        f"WHEN (NEW.awaited AND NEW.status IN ({final}) AND OLD.status IS DISTINCT FROM NEW.status) "
        f"EXECUTE FUNCTION {fn}()"
    )


def _v11(conn: sa.Connection, tables: Tables) -> None:
    """SQLite: the two listing indexes by status go (see :data:`SQLITE_UNUSED_INDEXES`).

    SQLite uses a partial index only for a query that repeats its predicate, and no query of the kit
    repeats ``status <> 'Succeeded'``: the listings by status walk ix_..._created there, before and
    after. Yet every claim and every settlement rewrote the row's entries in both (a claim deletes
    and inserts its entry in each, a success deletes it): 6 of the 10 index writes of a message's
    claim and success, about a quarter of SQLite's time for those statements
    (``bench/sqlite_statements.py``). PostgreSQL proves that ``status = 'DeadLettered'`` implies the
    predicate and reads them: nothing changes there. A database made at this version never had them
    on SQLite (``_postgresql_only``)."""
    if conn.dialect.name != "sqlite":
        return
    prefix = f"{tables.metadata.schema}." if tables.metadata.schema else ""
    for name in SQLITE_UNUSED_INDEXES:
        # names from the constant above, the schema name validated by Tables.build: nothing from input
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {prefix}{name}")


def _v12(conn: sa.Connection, tables: Tables) -> None:
    """SQLite: message ids are never given twice (``AUTOINCREMENT``; see the table's definition).

    SQLite cannot add AUTOINCREMENT to a table, so the table is made again, in SQLite's documented
    order: the new table is created beside the old one, the rows copied with their ids, the old table
    dropped and the new one renamed into its place (the legacy rename, so that views naming the table
    keep working), then the kit's indexes made, and the triggers and indexes of the user's own on the
    table made again from their stored SQL. One transaction: a failure leaves the table as it was. The copy
    takes about 13 seconds a million rows, under the write lock. The next id is then above every id in
    the table; an id deleted before this migration above the highest left may still be given once.
    A database made at this version has the keyword from v1 and is left alone."""
    if conn.dialect.name != "sqlite":
        return
    m = tables.messages  # (SQLite takes no schema name: the provider refuses one)
    # names from the metadata: nothing from input
    ddl = conn.exec_driver_sql(
        f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{m.name}'"
    ).scalar()
    if ddl is None or "AUTOINCREMENT" in ddl.upper():
        return
    ours = {i.name for i in m.indexes}
    # a try that failed part-way on an engine whose driver commits DDL as it goes (one a caller made;
    # the kit's own begins every transaction itself) left the new table behind: start again
    conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{m.name}_v12"')
    # (a trigger's tbl_name is the name as its ON clause spelled it, in any case)
    theirs = conn.exec_driver_sql(
        f"SELECT type, name, sql FROM sqlite_master WHERE lower(tbl_name) = '{m.name}' AND sql IS NOT NULL "
        "AND type IN ('index', 'trigger')"
    ).all()
    for kind, name, _ in theirs:
        if kind == "index":  # the new table's indexes take these names
            conn.exec_driver_sql(f'DROP INDEX "{name}"')
    new = m.to_metadata(sa.MetaData(), name=f"{m.name}_v12")
    conn.execute(sa.schema.CreateTable(new))  # its indexes once it has its name (and its rows)
    columns = ", ".join(f'"{c.name}"' for c in m.columns)
    conn.exec_driver_sql(f'INSERT INTO "{new.name}" ({columns}) SELECT {columns} FROM "{m.name}"')
    conn.exec_driver_sql(f'DROP TABLE "{m.name}"')
    legacy = conn.exec_driver_sql("PRAGMA legacy_alter_table").scalar()
    conn.exec_driver_sql("PRAGMA legacy_alter_table = ON")  # views naming the table are left as written
    try:
        conn.exec_driver_sql(f'ALTER TABLE "{new.name}" RENAME TO "{m.name}"')
    finally:
        conn.exec_driver_sql(f"PRAGMA legacy_alter_table = {'ON' if legacy else 'OFF'}")
    for index in m.indexes:
        index.create(conn)  # (not those made on PostgreSQL only)
    for kind, name, sql in theirs:
        if kind == "trigger" or name not in ours:
            conn.exec_driver_sql(sql)


def _v13(conn: sa.Connection, tables: Tables) -> None:
    """The lease sweeper's index keyed by queue, not by the lease's end (see the table's definition): a
    renewal then changes no indexed column. A database made at this version has it so already.

    On PostgreSQL the new index is built under another name first (the build reads the table once,
    about a second a million rows, while writes wait and reads go on), then the old one is dropped and
    the new one takes its name: the drop's exclusive lock is held only from there to the commit. SQLite
    cannot rename an index: the old one is dropped and the new one made, under its one write lock."""
    m = tables.messages
    name = "ix_queueing_messages_leased"
    [leased] = [i for i in m.indexes if i.name == name]
    have = {i["name"]: i["column_names"] for i in sa.inspect(conn).get_indexes(m.name, schema=m.schema)}
    if have.get(name) == ["queue"]:
        return
    if conn.dialect.name != "postgresql":
        if name in have:
            conn.execute(sa.schema.DropIndex(leased))
        leased.create(conn)
        return
    # (as text: an Index object would join the table's metadata, and every later create_all with it)
    quote = conn.dialect.identifier_preparer
    schema = f"{quote.quote_schema(m.schema)}." if m.schema else ""
    building = quote.quote(f"{name}_v13")
    # (a try that failed part-way on an engine that commits DDL as it goes)
    conn.exec_driver_sql(f"DROP INDEX IF EXISTS {schema}{building}")
    conn.exec_driver_sql(f"CREATE INDEX {building} ON {quote.format_table(m)} (queue) WHERE {LEASED_SQL}")
    if name in have:
        conn.execute(sa.schema.DropIndex(leased))
    conn.exec_driver_sql(f"ALTER INDEX {schema}{building} RENAME TO {quote.quote(name)}")


def _done_notice_sql(tables: Tables) -> str:
    """What ``_v14`` adds to the UPDATE counts trigger's function after the counts: the wake-up of
    result waiters (``bench/sql_update_instructions.py`` builds its variants of the function on it)."""
    channel = done_channel_for(tables.metadata.schema).replace("'", "''")
    final = ", ".join(f"'{s.value}'" for s in MessageStatus.terminal())
    # the channel from the validated schema name, statuses from the enum: nothing from input
    return f"""
                -- result waiters (app.result): flagged rows that just reached a final status (a row's
                -- old and new versions paired by id, which no statement of the kit changes)
                IF EXISTS (SELECT FROM new_rows WHERE awaited) THEN
                    PERFORM pg_notify('{channel}', chr(31) || 'done' || chr(31) || n.message_id::text)
                    FROM new_rows AS n JOIN old_rows AS o USING (id)
                    WHERE n.awaited AND n.status IN ({final}) AND o.status IS DISTINCT FROM n.status;
                END IF;"""


def _v14(conn: sa.Connection, tables: Tables) -> None:
    """Result waiters woken by the counts trigger of UPDATE statements, not by a row trigger (PostgreSQL).

    ``_v10``'s row trigger cost every UPDATE statement on the messages table about 80,000 of the
    server's instructions, whatever its WHEN clause found, as a fixed cost per statement: 5 % of the
    server's instructions for a claim and a success at claims of 10, 15 % at claims of one
    (``bench/sql_update_instructions.py``). The counts trigger already runs once per UPDATE statement
    with the statement's rows in hand: it now sends the same NOTIFY for the rows flagged ``awaited``
    that just reached a final status, after one look for any flagged row (2 % and 3 %; settlements
    nobody waits for, nearly all of them, send nothing and run no second query).
    """
    if conn.dialect.name != "postgresql":
        return
    then = _done_notice_sql(tables)
    conn.exec_driver_sql(_count_function_sql(tables, "UPDATE", then))
    conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS queueing_notify_done ON {tables.messages.fullname}")
    conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {_function(tables, 'queueing_notify_done')}()")


def _index_sql(conn: sa.Connection, table: sa.Table, name: str) -> str | None:
    """How the database stores the definition of ``table``'s index ``name`` (None: there is none)."""
    if conn.dialect.name == "postgresql":
        # (no schema name: the search path's first, where the kit's tables are then made)
        query = (
            "SELECT indexdef FROM pg_indexes "
            "WHERE schemaname = coalesce(%(s)s, current_schema()) AND indexname = %(n)s"
        )
        values: Any = {"s": table.schema, "n": name}
    else:
        query, values = "SELECT sql FROM sqlite_master WHERE type = 'index' AND name = ?", (name,)
    found: str | None = conn.exec_driver_sql(query, values).scalar()
    return found


def _replace_indexes(conn: sa.Connection, table: sa.Table, made: dict[str, str], version: int) -> None:
    """The indexes named in ``made`` made again, each as ``CREATE INDEX <name> ON <table> <its text>``.

    On PostgreSQL every new index is built under another name first (each build reads the table once
    while writes wait and reads go on), and only then are the old ones dropped and the new ones renamed:
    the drops' exclusive lock, which stops reads as well, is held from there to the commit, not across
    a build. (``_v13`` does the same for its one index, as it was released.) SQLite cannot rename an
    index: each is dropped and made, under its one write lock."""
    quote = conn.dialect.identifier_preparer
    on = quote.format_table(table)
    if conn.dialect.name != "postgresql":
        for name, text in made.items():
            conn.exec_driver_sql(f"DROP INDEX IF EXISTS {quote.quote(name)}")
            conn.exec_driver_sql(f"CREATE INDEX {quote.quote(name)} ON {on} {text}")
        return
    schema = f"{quote.quote_schema(table.schema)}." if table.schema else ""
    for name, text in made.items():
        building = quote.quote(f"{name}_v{version}")
        # (a try that failed part-way on an engine that commits DDL as it goes)
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {schema}{building}")
        conn.exec_driver_sql(f"CREATE INDEX {building} ON {on} {text}")
    for name in made:
        conn.exec_driver_sql(f"DROP INDEX IF EXISTS {schema}{quote.quote(name)}")
        conn.exec_driver_sql(
            f"ALTER INDEX {schema}{quote.quote(f'{name}_v{version}')} RENAME TO {quote.quote(name)}"
        )


def _v15(conn: sa.Connection, tables: Tables) -> None:
    """A claim and a success write fewer index entries (PostgreSQL; the tracking index on SQLite as well,
    where it costs nothing on the hot path and only shrinks).

    A change of status is never a HOT update: it writes an entry for the row's new version in every
    index whose predicate that version meets. The listing indexes by status now leave out Leased (the
    rows running now are listed through the lease sweeper's index), so a claim writes neither, and the
    tracking index holds only the rows whose tracking id is not their own message id, which since this
    version is the default (``tracked_by``), so neither a claim nor a success writes it: about 12 % and
    9 % of the server's instructions for a claim and a success at claims of 10, 21 % together
    (``bench/sql_update_instructions.py``). The indexes are made again as ``_replace_indexes`` does,
    from this migration's own text (a released migration never changes): the listing indexes hold only
    the unsettled rows (a quick build), the tracking index every row sent before this version until
    retention removes them. A database made at this version has them so already."""
    m = tables.messages
    listed = "WHERE status NOT IN ('Succeeded', 'Leased')"
    made = {}
    stored = _index_sql(conn, m, "ix_queueing_messages_tracking")
    if stored is None or "WHERE" not in stored.upper():
        made["ix_queueing_messages_tracking"] = "(tracking_id) WHERE tracking_id <> message_id"
    if conn.dialect.name == "postgresql":
        for name, columns in (
            ("ix_queueing_messages_status", "(status, created_at, id)"),
            ("ix_queueing_messages_queue_status", "(queue, status, created_at, id)"),
        ):
            stored = _index_sql(conn, m, name)
            if stored is None or "'Leased'" not in stored:
                made[name] = f"{columns} {listed}"
    if made:
        _replace_indexes(conn, m, made, 15)


def _v16(conn: sa.Connection, tables: Tables) -> None:
    """The listing index by time leaves out the rows running now (PostgreSQL): a claim writes no entry
    in it, 8 % of the server's instructions for a claim and a success at claims of 10
    (``bench/sql_update_instructions.py``). It is made again as ``_replace_indexes`` does, from this
    migration's own text; it holds every row of the history (about half a second a million rows on a
    2-core machine, while writes wait and reads go on). A database made at this version has it so already."""
    if conn.dialect.name != "postgresql":
        return
    m = tables.messages
    stored = _index_sql(conn, m, "ix_queueing_messages_created")
    if stored is None or "'Leased'" not in stored:
        _replace_indexes(
            conn, m, {"ix_queueing_messages_created": "(created_at, id) WHERE status <> 'Leased'"}, 16
        )


def _v17(conn: sa.Connection, tables: Tables) -> None:
    """An idempotent type's version that a newer one superseded while it ran (the newer one a row of its
    own) says by which, so its retry is settled superseded however the newer row fares (retention may
    delete it first). A nullable column: no row is rewritten, and none is marked: a version superseded
    before the upgrade runs if it comes back, as it did (a mark guessed from the rows could cancel a
    version an operator retried, which the earlier kit did not record)."""
    m = tables.messages
    if "superseded_by" not in {c["name"] for c in sa.inspect(conn).get_columns(m.name, schema=m.schema)}:
        kind = "UUID" if conn.dialect.name == "postgresql" else "CHAR(32)"
        conn.exec_driver_sql(f"ALTER TABLE {m.fullname} ADD COLUMN superseded_by {kind}")


#: (version, description, migration). Append only: a released migration never changes. Each commits
#: on its own (``migrate``), so the hosts still running may work on the schema any one of them leaves:
#: a migration must leave a schema that every earlier kit still runs on, and a change that holds only
#: together with another (a column and the trigger that fills it) belongs in one migration.
MIGRATIONS: list[tuple[int, str, Migration]] = [
    (1, "messages, pauses, circuits", _v1),
    (2, "message counts kept by triggers (PostgreSQL)", _v2),
    (3, "history and delayed messages for RabbitMQ and SQS", _v3),
    (4, "a lease token per claim: on messages, and a lease table for SQS", _v4),
    (5, "schedule ticks", _v5),
    (6, "job control: cancellation requests, progress, identity, lookup by tracking id", _v6),
    (7, "fillfactor and autovacuum settings on the hot tables (PostgreSQL)", _v7),
    (8, "delayed messages count their unreported fetches", _v8),
    (9, "history counts the duplicates completed without running", _v9),
    (10, "idempotent identities for the brokers; result waiters woken by NOTIFY (PostgreSQL)", _v10),
    (11, "SQLite: no listing indexes by status, which its planner never used", _v11),
    (12, "SQLite: message ids never given twice (AUTOINCREMENT)", _v12),
    (13, "lease renewals change no indexed column (the sweeper's index by queue)", _v13),
    (14, "result waiters woken by the counts trigger, not a row trigger (PostgreSQL)", _v14),
    (
        15,
        "claims and successes write fewer index entries (listings without Leased; tracking by copies)",
        _v15,
    ),
    (16, "a claim writes no entry in the listing index by time (PostgreSQL)", _v16),
    (17, "an idempotent type's version superseded while it ran says by which", _v17),
]
LATEST = MIGRATIONS[-1][0]


async def current_version(conn: AsyncConnection, tables: Tables) -> int:
    def read(sync: sa.Connection) -> int:
        if not sa.inspect(sync).has_table(tables.schema_versions.name, schema=tables.schema_versions.schema):
            return 0
        return int(
            sync.execute(
                sa.select(sa.func.coalesce(sa.func.max(tables.schema_versions.c.version), 0))
            ).scalar_one()
        )

    return await conn.run_sync(read)


async def _schema_exists(conn: Any, schema: str) -> bool:
    found = await conn.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema})
    return found.first() is not None


#: how long one migration statement may wait for a table lock on PostgreSQL before it gives up and
#: the migration is tried again. While an ALTER waits for its lock every other statement on that table
#: queues behind it, so this bounds how long the hosts still running can be held up by an upgrade.
MIGRATION_LOCK_TIMEOUT = 5.0
#: tries, in all, before an upgrade that keeps meeting a busy table gives up (with a clear error): one
#: budget for the whole upgrade, not one a migration, so a host waits at most about 9 minutes
MIGRATION_LOCK_TRIES = 30
#: the pause between two tries, doubling from the first, at most the last
MIGRATION_RETRY_PAUSE = (1.0, 15.0)
_LOCK_NOT_AVAILABLE = "55P03"


def _lock_timed_out(exc: sa.exc.DBAPIError) -> bool:
    orig = exc.orig
    return getattr(orig, "sqlstate", None) == _LOCK_NOT_AVAILABLE or getattr(orig, "pgcode", None) == (
        _LOCK_NOT_AVAILABLE
    )


async def migrate(engine: AsyncEngine, tables: Tables, *, now: Callable[[], object]) -> list[int]:
    """Apply pending migrations; returns the versions applied (empty when up to date).

    Each migration is its own transaction, committed before the next begins: the locks one takes are
    held only while it runs. (Run together, a lock an earlier migration took, such as the exclusive
    lock of a DROP TRIGGER, which stops reads as well, would be held across a later one's index builds,
    which otherwise let reads go on.) A failure rolls back only the migration that failed; the next
    start, or ``queueing migrate``, goes on from there.

    On PostgreSQL a statement that cannot get its table lock within :data:`MIGRATION_LOCK_TIMEOUT`
    (a long transaction of a running host on that table) rolls its migration back, and it is tried
    again after a pause, at most :data:`MIGRATION_LOCK_TRIES` times in all: the hosts still running
    wait at most that long behind it, never for as long as the other transaction lasts."""
    applied: list[int] = []
    pause, longest = MIGRATION_RETRY_PAUSE
    attempt = 1
    while True:
        try:
            version = await _migrate_next(engine, tables, now=now)
        except sa.exc.DBAPIError as exc:
            if not _lock_timed_out(exc):
                raise
            if attempt >= MIGRATION_LOCK_TRIES:
                reached = f"version {applied[-1]}" if applied else "the version it was at"
                raise ProviderUnavailable(
                    f"the queueing schema migration could not lock a table in use after "
                    f"{MIGRATION_LOCK_TRIES} tries of {MIGRATION_LOCK_TIMEOUT:g}s each (the schema "
                    f"stays at {reached}): end the long transaction holding it, or migrate at a "
                    "quieter moment"
                ) from exc
            log.warning(
                "queueing schema migration waited %gs for a table in use and was rolled back; "
                "trying again in %gs (try %d of %d)",
                MIGRATION_LOCK_TIMEOUT,
                pause,
                attempt,
                MIGRATION_LOCK_TRIES,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, longest)
            attempt += 1
            continue
        if version is None:
            return applied
        applied.append(version)


async def _migrate_next(engine: AsyncEngine, tables: Tables, *, now: Callable[[], object]) -> int | None:
    """The first pending migration applied and committed, in one transaction; its version (None: none
    was pending)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # one migrator at a time across every host; released at commit. The schema is created
            # under the lock too: two CREATE SCHEMA IF NOT EXISTS at once can both find it missing,
            # and the second then fails on the catalog's unique index.
            await conn.execute(sa.text("SELECT pg_advisory_xact_lock(hashtext('queueing-kit-migrate'))"))
            # after the advisory lock (waiting for another migrator is fine): from here a table lock
            # is waited for at most this long, then the try is rolled back (see ``migrate``)
            ms = int(MIGRATION_LOCK_TIMEOUT * 1000)
            await conn.execute(sa.text(f"SET LOCAL lock_timeout = {ms}"))
            schema = tables.metadata.schema
            # only when missing: CREATE SCHEMA needs CREATE on the database even with IF NOT EXISTS,
            # and a least-privilege role (USAGE and CREATE on just its schema, infra/postgres) lacks it
            if schema and not await _schema_exists(conn, schema):
                await conn.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))

        def run(sync: sa.Connection) -> int | None:
            tables.schema_versions.create(sync, checkfirst=True)
            # read under the lock: another host may have applied some since this one last looked
            done = set(sync.execute(sa.select(tables.schema_versions.c.version)).scalars())
            for version, description, step in MIGRATIONS:
                if version in done:
                    continue
                log.info("applying queueing schema migration %d: %s", version, description)
                step(sync, tables)
                sync.execute(
                    tables.schema_versions.insert().values(
                        version=version, description=description, applied_at=now()
                    )
                )
                return version
            return None

        return await conn.run_sync(run)
