"""Idempotent message types on SQL: an enqueue equal (identity and JSON) to the waiting message of
its identity is discarded (the waiting row brought forward to the time the enqueue asks for, when it was
due later); one with a changed body replaces the waiting body; the handler's ``ctx.previous`` is the last
version of its identity that succeeded."""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

import sqlalchemy as sa

from ...clock import as_utc
from ...control.base import CANCEL_KEPT
from ...messages import MessageStatus, QueueMessage, read_body
from .rows import row_for, stored_text
from .schema import CLAIMABLE, CLAIMABLE_SQL, Tables, archived, claimable
from .statements import notify_statement

if TYPE_CHECKING:
    from ...app import QueueingApp, Subscription
    from ...envelope import Envelope
    from ...producer import IdempotentOutcome
    from .provider import SqlProvider

T = TypeVar("T")

#: the waiting statuses whose next run is at a time of the row's own (its delay, its retry); a row held
#: for another reason (paused, waiting for a handler) is looked at again soon, and stays held
TIMED = (MessageStatus.PENDING.value, MessageStatus.SLEEPING.value, MessageStatus.FAILED.value)


#: one statement to run and its parameters (None: run it bare); the plan is sent what it answered
Step = tuple[sa.Executable, Any]


def batch_lock(backend: str, envs: Sequence[Envelope], keys: Sequence[str | None]) -> Step | None:
    """PostgreSQL: the identities of a batch locked together, in one order (sorted), before the plans
    take each its own (again: the lock is the transaction's already). Taken by each plan in the
    batch's order, two batches that name the same identities in opposite orders each held one and
    waited for the other: a deadlock, which PostgreSQL ended by failing one enqueue. None where there
    is nothing to order (SQLite's single writer, or fewer than two identities)."""
    names = sorted({f"{e.type}\x1f{k}" for e, k in zip(envs, keys, strict=True) if k is not None})
    if backend != "postgresql" or len(names) < 2:
        return None
    # (one statement: the function scan of the array gives its rows, and so takes the locks, in order)
    lock = sa.text(
        "SELECT count(pg_advisory_xact_lock(hashtext(n))) FROM unnest(CAST(:names AS text[])) AS n"
    )
    return lock.bindparams(names=names), None


def plan(
    tables: Tables,
    backend: str,
    app: QueueingApp | None,
    env: Envelope,
    key: str,
    now: datetime,
    *,
    woken: set[str] | None = None,
) -> Generator[Step, Any, IdempotentOutcome]:
    """The statements that send one envelope of an idempotent type, in order, inside a transaction
    the driver holds: discard it if the waiting message of its identity has the same JSON (bringing that
    message forward to the time this one asks for, if it was due later: its queue is then added to
    ``woken``, and NOTIFYed on PostgreSQL), replace the waiting body if it differs, else insert it with
    its identity. One plan for the provider's own transaction (:func:`send`) and the caller's (the
    outbox), sync or async: a row written without its identity would be invisible to the next enqueue
    of that identity and to ``ctx.previous``."""
    from ...producer import DUPLICATE, IdempotentOutcome, outlasts
    from .provider import initial_status, insert_statement

    m = tables.messages
    if backend == "postgresql":
        # one enqueuer per identity at a time, to the commit: two cannot both find none and both insert
        yield sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"{env.type}\x1f{key}"))), None
    else:
        # SQLite: the write lock first, so the lookup and what follows are one writer's: a caller's
        # connection (the outbox) may not have begun its transaction yet, or only to read, and two
        # enqueuers could both find none and both insert (a write that changes no row takes the lock)
        yield sa.update(m).where(sa.false()).values(id=m.c.id), None
    # the identity's newest version (its last row): only it may stand for this one or take its body.
    # An older row still waiting (a version that was running when a newer one came, back for its
    # retry) is superseded by the newer rows when it starts (``newer_version``); a newest version that
    # runs now or has finished leaves this one a row of its own
    x = tables.cancels
    find = (
        sa.select(
            m.c.id,
            m.c.message_id,
            m.c.tracking_id,
            m.c.expires_at,
            m.c.status,
            m.c.not_before,
            m.c.available_at,
            # (bytes on SQLite, decoded by ``_same``: a row another program wrote that is not UTF-8 failed
            # every idempotent enqueue of the identity)
            stored_text(m.c.body, backend, "b"),
            sa.literal_column(f"({CLAIMABLE_SQL})").label("waits"),
            m.c.superseded_by,
            # a cancellation standing for it (as the control state reads them): the next claim settles
            # it Cancelled unrun, so it cannot stand for this enqueue
            sa.exists()
            .where(x.c.message_id == m.c.message_id, x.c.requested_at > now - CANCEL_KEPT)
            .label("cancelling"),
        )
        .where(m.c.type == env.type, m.c.identity == key)
        .order_by(m.c.id.desc())
        .limit(1)
    )
    if backend == "postgresql":
        # held to the commit: a claim (which skips locked rows) cannot run the waiting version before
        # the caller's transaction commits what an enqueue discarded against it stands for
        find = find.with_for_update(of=m)
    newest = (yield find, None).first()
    waiting = newest if newest is not None and newest.waits else None
    # a message id stored already (a producer's retry, an outbox replayed, long after): nothing is
    # written. Sent on, it replaced a newer waiting version's body with its own older one, told
    # "replaced", and the newer content never ran (found in review); the waiting message itself sent
    # again with the same JSON goes on below (discarded, brought forward if asked sooner)
    if not (waiting is not None and waiting.message_id == env.message_id):
        stored = (
            yield sa.select(m.c.message_id, m.c.tracking_id).where(m.c.message_id == env.message_id), None
        ).first()
        if stored is not None:
            return IdempotentOutcome(DUPLICATE, stored.message_id, stored.tracking_id)
    if waiting is not None and waiting.cancelling and _same(waiting.b, env.body):
        # the same JSON as a version whose cancellation stands (its run was cancelled, and ended with a
        # retry or a release before it heard): that version ends Cancelled as asked, and this one is a
        # version of its own, enqueued below (it supersedes the cancelled one): discarded, the run
        # asked for now would be lost. (A changed body replaces the waiting one and withdraws its
        # request, as before: the replacing version is not the cancelled one.)
        waiting = None
    if waiting is not None and _same(waiting.b, env.body):
        # (the row is this transaction's: locked, or the single writer's)
        keep: dict[str, Any] = {}
        if not outlasts(waiting.expires_at, env.expires_at):
            # it would expire before this one: it takes this one's expiry, so the run asked for now
            # still comes
            keep["expires_at"] = env.expires_at
        if waiting.superseded_by is not None:
            # marked by a newer row that is gone since (retention, a purge): it stands for this
            # enqueue now, so it runs
            keep["superseded_by"] = None
        asked = env.not_before or now
        forward = waiting.status in TIMED and as_utc(waiting.available_at) > as_utc(asked)
        if forward:
            # it is due later than this one asks to run (its delay, its retry): it is brought forward
            # to this one's time, so the run asked for comes when asked, not days later
            keep["available_at"] = asked
            if waiting.not_before is not None:
                keep["not_before"] = env.not_before
            if waiting.status == MessageStatus.SLEEPING.value and env.not_before is None:
                keep["status"] = initial_status(app, env)
            keep["updated_at"] = now
        if keep:
            yield sa.update(m).where(m.c.id == waiting.id).values(**keep), None
        if forward:
            if woken is not None:
                woken.add(env.queue)
            if backend == "postgresql":
                # a listening worker claims it at the commit, as it would a row just inserted
                yield notify_statement(_channel(tables), env.queue), None
        return IdempotentOutcome("discarded", waiting.message_id, waiting.tracking_id)
    if waiting is not None:
        # the new version as it was enqueued, as on every other transport (where it is a message of
        # its own): its delay, expiry and fresh attempts, not the replaced version's; a row held for
        # another reason (paused, waiting for a handler) stays held
        replace = (
            sa.update(m)
            .where(m.c.id == waiting.id, claimable())
            .values(
                body=env.body,
                headers=env.headers,
                # the new version's, as it is a message of its own on the other transports
                correlation_id=env.correlation_id,
                created_at=env.created_at,
                updated_at=now,
                not_before=env.not_before,
                available_at=env.not_before or now,
                expires_at=env.expires_at,
                attempt=env.attempt,
                status=sa.case((m.c.status.in_(TIMED), initial_status(app, env)), else_=m.c.status),
                # the newest version now, whatever marked the row before (a newer row gone since)
                superseded_by=None,
            )
        )
        if (yield replace, None).rowcount == 1:
            # a cancellation requested for the replaced version's run (which ended before it saw the
            # request, so the request stayed) is not the new version's: it would be settled Cancelled
            # unrun, its enqueue told "replaced"
            x = tables.cancels
            yield sa.delete(x).where(x.c.message_id == waiting.message_id), None
            return IdempotentOutcome("replaced", waiting.message_id, waiting.tracking_id)
    row = {**row_for(env, initial_status(app, env), now), "identity": key}
    # (its id returned: whether it was added, or its message id was known already; a row count may
    # not say, -1 on psycopg here)
    added = (yield insert_statement(tables, backend).returning(m.c.id), row).first() is not None
    if not added:  # (another sender's row under this id committed meanwhile: nothing was written)
        return IdempotentOutcome(DUPLICATE, env.message_id, env.tracking_id)
    if newest is not None:
        # the versions of the identity not settled yet (running now, or back for a retry later) are
        # superseded by this one, as on the other transports: a running one runs to its end, and if it
        # comes back it is settled superseded (said on its row, whatever becomes of this one's)
        unsettled = [*CLAIMABLE, MessageStatus.LEASED.value]
        yield (
            (
                sa.update(m)
                .where(
                    m.c.type == env.type,
                    m.c.identity == key,
                    m.c.status.in_(unsettled),
                    archived(m, False),
                    m.c.message_id != env.message_id,
                )
                .values(superseded_by=env.message_id)
            ),
            None,
        )
    return IdempotentOutcome("enqueued", env.message_id, env.tracking_id)


def run_plan(conn: Any, steps: Generator[Step, Any, T]) -> T:
    """Run a plan's statements on a sync connection or session; its result."""
    try:
        stmt, params = next(steps)
        while True:
            stmt, params = steps.send(conn.execute(stmt) if params is None else conn.execute(stmt, params))
    except StopIteration as done:
        result: T = done.value
        return result


async def run_plan_async(conn: Any, steps: Generator[Step, Any, T]) -> T:
    """Run a plan's statements on an async connection or session; its result."""
    try:
        stmt, params = next(steps)
        while True:
            answer = await (conn.execute(stmt) if params is None else conn.execute(stmt, params))
            stmt, params = steps.send(answer)
    except StopIteration as done:
        result: T = done.value
        return result


async def send(
    p: SqlProvider, envelopes: Sequence[Envelope], identities: Sequence[str]
) -> list[IdempotentOutcome]:
    """One transaction: per envelope, discard, replace the waiting body, or insert."""
    now = p.clock()
    out: list[IdempotentOutcome] = []
    woken: set[str] = set()  # queues of waiting rows brought forward (NOTIFYed by the plan)
    async with p.engine.begin() as conn:
        lock = batch_lock(p.backend, envelopes, identities)
        if lock is not None:
            await conn.execute(lock[0])
        for env, key in zip(envelopes, identities, strict=True):
            steps = plan(p.tables, p.backend, p._app, env, key, now, woken=woken)
            out.append(await run_plan_async(conn, steps))
        sent = zip(envelopes, out, strict=True)
        await p.notify_statements(conn, {e.queue for e, o in sent if o.outcome == "enqueued"})
    for q in woken:
        p._note_due(q, now)  # a worker of this process waiting for the old due time looks now
    return out


def _channel(tables: Tables) -> str:
    """The NOTIFY channel of the provider whose tables these are."""
    from .provider import channel_for

    return channel_for(tables.messages.schema)


def _same(stored: str | bytes | None, body: dict[str, Any]) -> bool:
    """Whether the stored body is ``body``: the same JSON whatever the key order, each value of the
    same kind (Python's ``==`` took ``true`` for ``1`` and discarded the changed version), numbers equal
    by value (PostgreSQL's JSONB gives back ``2e16`` as ``20000000000000000`` and ``-0.0`` as ``0``: by
    their text, an unchanged body was taken for a changed one and its due time moved on every repeat).
    One that does not read (not UTF-8, not JSON, nested past what the parser reads) is not: it is
    replaced by this version, which can run."""
    try:
        text = stored.decode() if isinstance(stored, bytes) else stored  # (as the claim reads it)
        return text is not None and _canonical(json.loads(text)) == _canonical(body)
    except (ValueError, RecursionError, ArithmeticError):
        return False


def _canonical(value: Any) -> Any:
    """``value`` (JSON) tagged by kind, its numbers as decimals (a float by its shortest text, as JSON
    wrote it), so that equality is JSON's and never Python's ``True == 1``."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | float):
        return ("number", Decimal(repr(value)) if isinstance(value, float) else Decimal(value))
    if isinstance(value, dict):
        return ("object", frozenset((k, _canonical(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("array", tuple(_canonical(v) for v in value))
    raise ValueError(f"not JSON: {type(value).__name__}")


async def newer_version(p: SqlProvider, message: QueueMessage) -> UUID | None:
    """The version of this message's identity that superseded it while it ran (``plan`` says so on its
    row), if one did: this message, about to run again (its retry, or after its lease lapsed), is
    settled superseded by it, as on the other transports. An operator's retry clears it."""
    m = p.tables.messages
    async with p.engine.connect() as conn:
        newer: UUID | None = (
            await conn.execute(sa.select(m.c.superseded_by).where(m.c.message_id == message.message_id))
        ).scalar()
    return newer


async def previous(p: SqlProvider, sub: Subscription, message: QueueMessage, key: str) -> QueueMessage | None:
    """The last version of this identity that succeeded (another message than this one)."""
    m = p.tables.messages
    async with p.engine.connect() as conn:
        text = (
            await conn.execute(
                sa.select(stored_text(m.c.body, p.backend, "b"))
                .where(
                    m.c.type == sub.type_name,
                    m.c.identity == key,
                    m.c.status == MessageStatus.SUCCEEDED.value,
                    m.c.message_id != message.message_id,
                )
                .order_by(m.c.settled_at.desc(), m.c.id.desc())
                .limit(1)
            )
        ).scalar()
    if text is None:
        return None
    # (a version that does not read fails the lookup, which the pipeline tells and takes for none)
    return read_body(sub.message_type, json.loads(text.decode() if isinstance(text, bytes) else text))
