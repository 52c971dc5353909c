"""Every statement on the SQL provider's hot path, built once per provider with bind parameters.

Building a SQLAlchemy statement costs about a millisecond; building one per claim or per settle
batch was a third of the worker's CPU. These objects are reused with new parameter values only.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from ...decisions import DeadLetterReason
from ...messages import MessageStatus
from .rows import stored_text
from .schema import CLAIMABLE, LEASED_SQL, Tables, archived, by_id, claimable

LEASED = MessageStatus.LEASED.value


def P(name: str, **kw: Any) -> sa.BindParameter[Any]:
    """A bind parameter; prefixed, because UPDATE reserves the plain column names for itself."""
    return sa.bindparam(f"b_{name}", **kw)


def bind(**values: Any) -> dict[str, Any]:
    """Parameters for statements built with :func:`P`."""
    return {f"b_{k}": v for k, v in values.items()}


#: lease tokens are kept in [0, TOKENS): a token fits the INTEGER column; every claim moves a row's
#: token by a step drawn per claim from STEPS, never a multiple of TOKENS, so it always changes
TOKENS = 2**31 - 1
#: (from 2**15: psycopg sends every such step as an ``int4``, so the prepared claim's parameter types,
#: part of its key, are the same on every call)
STEPS = (2**15, TOKENS - 1)


def claim_step() -> int:
    """A claim's token step: random, so a claim's token says nothing of the claims before it. A
    counter (the token plus one) gave a claim whose commit was lost (a relaxed claim in a database
    crash, a failover to an asynchronous standby) and the next claim of the row from the same stored
    token the same token: the lost claim's run, still going, and the live run were one lease to the
    fence, and the stale run's outcome could win over the live one's. Now two claims from one stored
    token share a token with a probability of about one in 2**31."""
    low, high = STEPS
    return low + secrets.randbelow(high - low + 1)


def claim_params(queue: str, limit: int, now: datetime, lease_until: datetime) -> dict[str, Any]:
    """The bound values of a claim (:attr:`Statements.claim`, :attr:`Statements.claim_head`): the one
    place a claim's token step is drawn."""
    return bind(queue=queue, now=now, lease_until=lease_until, limit=limit, step=claim_step())


def claim_columns(m: sa.Table, backend: str) -> list[sa.ColumnElement[Any]]:
    """What a claim returns: enough to rebuild the envelope; JSON as text (bytes on SQLite), parsed per
    row (``rows.delivery_from_row``)."""
    return [
        m.c.id,
        m.c.message_id,
        m.c.tracking_id,
        m.c.queue,
        m.c.type,
        m.c.attempt,
        m.c.correlation_id,
        m.c.created_at,
        m.c.not_before,
        m.c.expires_at,
        m.c.locked_until,
        m.c.lease_token,
        stored_text(m.c.raw, backend, "raw"),
        stored_text(m.c.body, backend, "body_text"),
        stored_text(m.c.headers, backend, "headers_text"),
    ]


def leases_of(backend: str, rows: Sequence[int], tokens: Sequence[int]) -> dict[str, Any]:
    """The bound values of a many-row fence (:attr:`Statements.complete_many`, :attr:`Statements.renew`)
    for ``backend``: two arrays on PostgreSQL, the (id, token) pairs as one JSON text on SQLite."""
    if backend == "postgresql":
        return bind(ids=list(rows), tokens=list(tokens))
    return bind(leases=json.dumps([[r, t] for r, t in zip(rows, tokens, strict=True)]))


def constants(values: Sequence[str]) -> list[sa.ColumnElement[str]]:
    """The kit's own constants as SQL literals: an ``IN`` of them is part of the statement's one text
    (a bound list would be expanded per execution, and the hot path compiles each statement once)."""
    return [sa.literal_column(f"'{v}'") for v in values]


def notify_statement(channel: Any, queue: Any) -> sa.Select[Any]:
    """``pg_notify`` of a queue's wake-up (values, or bind parameters for a reusable statement)."""
    return sa.select(sa.func.pg_notify(channel, queue))


class Statements:
    def __init__(self, tables: Tables, worker_id: str, backend: str = "sqlite") -> None:
        m, p, c = tables.messages, tables.pauses, tables.circuits
        now = P("now")
        # the database's own clock (db_clock.py): SQLite's is the host's, to the millisecond
        self.database_now: sa.Select[Any] = (
            sa.select(sa.func.clock_timestamp())
            if backend == "postgresql"
            else sa.select(sa.func.strftime("%Y-%m-%d %H:%M:%f", "now"))
        )
        self.not_paused = ~sa.exists().where(
            sa.or_(
                sa.and_(p.c.kind == "queue", p.c.name == m.c.queue),
                sa.and_(p.c.kind == "type", p.c.name == m.c.type),
            )
        )
        # circuit.admission's HOLD in SQL: open and cooling down, or half-open with its probe out.
        # Once the cooldown ends the rows are claimable again and the pipeline lets one probe run.
        self.not_held = ~sa.exists().where(
            c.c.type == m.c.type,
            sa.or_(
                sa.and_(c.c.state == "open", sa.or_(c.c.open_until.is_(None), c.c.open_until > now)),
                sa.and_(c.c.state == "half_open", sa.or_(c.c.probe_until.is_(None), c.c.probe_until > now)),
            ),
        )
        # every claim takes a new lease token: the fence that every later statement on the row names.
        # Not the token plus one: moved by a random step (``claim_step``, bound: one statement text),
        # so a claim whose commit was lost and the row's next claim never share a token but by chance
        # (one in 2**31); the token always changes, and stays in the INTEGER column's range
        # (PostgreSQL's ``mod()``, not ``%``, which psycopg's text spells ``%%``; SQLite has no ``mod()``)
        moved = sa.cast(m.c.lease_token, sa.BigInteger()) + P("step", type_=sa.BigInteger())
        modulus = sa.literal_column(str(TOKENS), sa.BigInteger())
        token = (
            sa.func.mod(moved, modulus, type_=sa.BigInteger()) if backend == "postgresql" else moved % modulus
        )
        take = {
            "status": LEASED,
            "locked_by": worker_id,
            "locked_until": P("lease_until"),
            "lease_token": token,
            "updated_at": now,
        }

        # PostgreSQL keeps one generic plan for a prepared statement only while that plan is estimated
        # no dearer than one planned for the call's values; a bare LIMIT parameter is read as its value
        # there (10 rows) and as a tenth of the due rows in the generic plan, which therefore always lost,
        # and the claim was planned again on every call (with the settlement's, a quarter of the server's
        # CPU per message). Behind a subquery the planner reads no value in either plan; the generic one
        # is then kept unless a call's values make the queue's due rows look fewer than its default
        # guess (a third), e.g. a small queue among large ones: that call is planned, as before
        limit: Any = P("limit", type_=sa.Integer())
        if backend == "postgresql":
            limit = sa.select(limit).scalar_subquery()
        # the batch claim: on ix_queueing_messages_claim (its predicate repeated as literal text)
        due = (
            sa.select(m.c.id)
            .where(
                m.c.queue == P("queue"), claimable(), m.c.available_at <= now, self.not_paused, self.not_held
            )
            .order_by(m.c.available_at, m.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
            .cte("due")
        )
        # PostgreSQL: the claimed ids as one array, so the plan the server keeps for the prepared claim
        # (a generic plan, with no values) fetches those rows by primary key; a join with the CTE is
        # planned for a LIMIT of unknown size and hashes a scan of the whole table
        taken = by_id(m, sa.select(due.c.id), backend) if backend == "postgresql" else m.c.id == due.c.id
        self.claim = sa.update(m).where(taken).values(**take).returning(*claim_columns(m, backend))

        # ordered queues: the oldest message that holds the line (one running, or one claimable that is
        # due, was tried already, or is not merely scheduled for later), and only if it is due. Its two
        # kinds are looked for apart, each on its own small partial index (the predicates repeated as
        # literal text): the running ones on the lease sweeper's, the claimable ones on the claim's. One
        # lookup of either kind in id order walked the queue's history from its oldest row on SQLite,
        # whose planner reads neither index for it (53 ms a claim over 200,000 rows, 0.4 ms without)
        run = m.alias("leased")
        waiting = m.alias("waiting")
        running = sa.select(sa.func.min(run.c.id).label("id")).where(
            # (the literal predicates name no table: inside these subqueries their one table is meant)
            run.c.queue == P("queue"),
            sa.text(LEASED_SQL),
            archived(run, False),
        )
        holding = sa.select(sa.func.min(waiting.c.id).label("id")).where(
            waiting.c.queue == P("queue"),
            claimable(),
            sa.or_(
                waiting.c.available_at <= now,
                waiting.c.attempt > 0,
                waiting.c.status != MessageStatus.SLEEPING.value,
            ),
        )
        heads = sa.union_all(running, holding).subquery("heads")
        head = sa.select(sa.func.min(heads.c.id)).scalar_subquery()
        self.claim_head = (
            sa.update(m)
            .where(
                m.c.id == head,
                m.c.status.in_(constants(CLAIMABLE)),
                m.c.available_at <= now,
                self.not_paused,
                self.not_held,
            )
            .values(**take)
            .returning(*claim_columns(m, backend))
        )

        self.mark_waiting = (
            sa.update(m)
            .where(
                m.c.queue == P("queue"),
                claimable(),  # (the claim index's predicate: its rows are found there)
                m.c.status == MessageStatus.PENDING.value,
                m.c.available_at <= now,
            )
            .values(status=MessageStatus.WAITING_FOR_HANDLER.value, updated_at=now)
        )

        # Settlement, renewal and release are guarded by the claim's token (the worker id as well, so
        # a row claimed by a worker of an older version, which leaves the token alone, stays fenced):
        # a run whose lease was released or swept never writes over the run that holds it now, even
        # in the same process. Many rows at once: ``id IN (...)`` finds them on the primary key and
        # the (id, token) pairs fence them.
        # (``Leased`` as a literal, not a bound value: a settlement's generic plan then sees the status
        # its call's plan sees, and PostgreSQL keeps the generic plan rather than planning every call.
        # There the status is compared as ``status || ''``, which no index matches: a generic plan made
        # while the statistics saw no Leased row would otherwise walk an index of every leased row, of
        # every worker, and filter by id, for as long as the connection lives; the rows are found by
        # id, on the primary key. Exact: status is NOT NULL.)
        leased = constants([LEASED])[0]
        status: sa.ColumnElement[str] = m.c.status
        if backend == "postgresql":
            status = m.c.status.concat(sa.literal_column("''"))
        owned = sa.and_(
            m.c.id == P("id"), m.c.lease_token == P("token"), m.c.locked_by == worker_id, status == leased
        )
        # On PostgreSQL the rows and tokens are two arrays: the statement's text is the same for any
        # number of rows, so the server keeps one prepared plan for it (an expanded ``IN (...)`` would be
        # a new statement for every batch size)
        fence: sa.ColumnElement[bool]
        if backend == "postgresql":
            ids = P("ids", type_=ARRAY(sa.BigInteger()))
            tokens = P("tokens", type_=ARRAY(sa.Integer()))
            pairs = sa.func.unnest(ids, tokens).table_valued("id", "token").render_derived(name="lease")
            fence = sa.and_(
                m.c.id == sa.any_(ids),
                sa.tuple_(m.c.id, m.c.lease_token).in_(sa.select(pairs.c.id, pairs.c.token)),
            )
        else:
            # SQLite: the pairs as one JSON array read by ``json_each``, so that here too the text is
            # the same for any number of rows (the hot path compiles it once, see ``sqlite_driver``);
            # ``id IN (...)`` still finds the rows on the primary key
            pairs = sa.func.json_each(P("leases", type_=sa.Text())).table_valued("value").alias("lease")
            lease_id = sa.func.json_extract(pairs.c.value, sa.literal_column("'$[0]'"))
            lease_token = sa.func.json_extract(pairs.c.value, sa.literal_column("'$[1]'"))
            fence = sa.and_(
                m.c.id.in_(sa.select(lease_id)),
                sa.tuple_(m.c.id, m.c.lease_token).in_(sa.select(lease_id, lease_token)),
            )
        owned_many = sa.and_(fence, m.c.locked_by == worker_id, status == leased)
        released: dict[str, Any] = {"locked_by": None, "locked_until": None, "updated_at": now}
        settled = {**released, "settled_at": now}
        self.complete_many = (
            sa.update(m)
            .where(owned_many)
            # (a success leaves no reason: an earlier wait's, "retried by an operator" or "circuit
            # ... is open", stayed on the succeeded message)
            .values(
                status=MessageStatus.SUCCEEDED.value, attempt=m.c.attempt + 1, reason=sa.null(), **settled
            )
            # the leases it settled, (id, token): one process may hold two runs of a row (a release, a
            # sweep), and only the pair tells the live run's lease from the stale one's in one batch
            .returning(m.c.id, m.c.lease_token)
        )
        # A run that leaves its message waiting (a retry, a delay, a release) while its cancellation
        # stands ends it Cancelled instead: the request was made while it ran (a cancel of a leased row
        # only writes one), and the run ended before its worker heard. Left waiting, the message would
        # run again once the request lapsed (kept a day, ``CANCEL_KEPT``) or be discarded against by an
        # identical idempotent enqueue. Looked up in the settlement's own statement, so no request can
        # fall between the look and the write; fenced by the lease as every settlement is. Only these
        # rare shapes look (on the requests' primary key): a success's statement is unchanged.
        x = tables.cancels
        requested = sa.exists().where(
            x.c.message_id == m.c.message_id, x.c.requested_at > P("since", type_=x.c.requested_at.type)
        )

        def unless_cancelled(value: Any, cancelled: Any) -> Any:
            """``value``, or ``cancelled`` where a cancellation of the row stands."""
            return sa.case((requested, cancelled), else_=value)

        def waits(status: Any, reason: Any) -> dict[str, Any]:
            """A waiting settlement's status and reason, and its settlement time: those of a cancelled
            message (as the pipeline's, no reason) where a cancellation stands."""
            return {
                "status": unless_cancelled(status, constants([MessageStatus.CANCELLED.value])[0]),
                "reason": unless_cancelled(reason, sa.null()),
                # (typed: the bare ``now`` in a CASE would be bound untyped)
                "settled_at": unless_cancelled(m.c.settled_at, P("now", type_=m.c.settled_at.type)),
            }

        # one row each: the provider sends a kind's rows as one batch, and row by row only when the
        # batch shows that some were refused, to learn which
        self.settle: dict[str, sa.Update] = {
            "complete": sa.update(m)
            .where(owned)
            .values(
                status=P("status"),
                attempt=P("attempt"),
                result=P("result", type_=m.c.result.type),
                reason=P("reason"),  # (a version superseded by a newer one says by which)
                **settled,
            ),
            "retry": sa.update(m)
            .where(owned)
            .values(
                attempt=P("attempt"),
                available_at=P("available_at"),
                last_error=P("last_error"),
                **waits(constants([MessageStatus.FAILED.value])[0], m.c.reason),
                **released,
            ),
            "dead": sa.update(m)
            .where(owned)
            .values(
                status=MessageStatus.DEAD_LETTERED.value,
                attempt=P("attempt"),
                reason=P("reason"),
                description=P("description"),
                raw=sa.func.coalesce(P("raw", type_=sa.Text()), m.c.raw),
                **settled,
            ),
            "defer": sa.update(m)
            .where(owned)
            .values(
                attempt=P("attempt"),
                available_at=P("available_at"),
                not_before=sa.func.coalesce(P("not_before", type_=m.c.not_before.type), m.c.not_before),
                # a run asked for later expires from its own time (``Defer.expires_at``), maybe never
                expires_at=sa.case(
                    (P("renew", type_=sa.Boolean()), P("expires_at", type_=m.c.expires_at.type)),
                    else_=m.c.expires_at,
                ),
                **waits(P("status", type_=m.c.status.type), P("reason", type_=m.c.reason.type)),
                **released,
            ),
            "release": sa.update(m)
            .where(owned)
            .values(
                attempt=P("attempt"),
                available_at=now,
                **waits(constants([MessageStatus.PENDING.value])[0], m.c.reason),
                **released,
            ),
            "expire": sa.update(m)
            .where(owned)
            .values(status=MessageStatus.EXPIRED.value, reason=DeadLetterReason.EXPIRED.value, **settled),
        }

        # (as ``complete_many``: the leases it renewed, by (id, token))
        self.renew = (
            sa.update(m).where(owned_many).values(locked_until=P("until")).returning(m.c.id, m.c.lease_token)
        )
        # another worker holds a lease (any queue): on the lease sweeper's index, whose predicate this
        # repeats; it stops at the first such row, and otherwise reads this worker's own leased rows only
        self.other_claimer = sa.select(sa.exists().where(sa.text(LEASED_SQL), m.c.locked_by != worker_id))
        self.notify = notify_statement(P("channel", type_=sa.Text()), P("queue", type_=sa.Text()))

        # PostgreSQL enqueue: the whole batch as arrays in one statement, with its wake-ups; per queue
        # woken, the ids that went in (a message id already stored is skipped: its enqueue is told so)
        self.insert_unnest = sa.text(f"""
            WITH added AS (
                INSERT INTO {m.fullname} (message_id, tracking_id, queue, type, status, attempt,
                    correlation_id, created_at, updated_at, not_before, available_at, expires_at,
                    headers, body)
                SELECT * FROM unnest(
                    CAST(:message_id AS uuid[]), CAST(:tracking_id AS uuid[]), CAST(:queue AS text[]),
                    CAST(:type AS text[]), CAST(:status AS text[]), CAST(:attempt AS integer[]),
                    CAST(:correlation_id AS text[]), CAST(:created_at AS timestamptz[]),
                    CAST(:updated_at AS timestamptz[]), CAST(:not_before AS timestamptz[]),
                    CAST(:available_at AS timestamptz[]), CAST(:expires_at AS timestamptz[]),
                    CAST(:headers AS jsonb[]), CAST(:body AS jsonb[]))
                ON CONFLICT (message_id) DO NOTHING
                RETURNING queue, message_id
            )
            SELECT pg_notify(:channel, queue), array_agg(message_id) AS ids FROM added GROUP BY queue
        """)
