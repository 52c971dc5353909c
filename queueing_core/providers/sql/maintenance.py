"""Periodic upkeep of the messages table. Every statement is idempotent and concurrency-safe, so each
host (or one Functions timer) may run it; batches keep each transaction short."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ...decisions import DeadLetterReason
from ...messages import MessageStatus
from .schema import archived, claimable, first_rows

if TYPE_CHECKING:
    from ...app import QueueingApp
    from .provider import SqlProvider

LEASED = MessageStatus.LEASED.value

#: how long after its lease lapsed a row of a queue this app does not register is swept: the hosts
#: that register it (every 5 s in a worker, every 30 s on Functions) sweep it first, by its own options
UNREGISTERED_GRACE = timedelta(minutes=5)


async def sweep_leases(
    provider: SqlProvider, app: QueueingApp, now: datetime, *, lease_now: datetime | None = None
) -> dict[str, int]:
    """Leases that lapsed (a worker died or hung): count the attempt, then retry, dead-letter at
    max attempts, or mark Abandoned where the queue asks a person to look. Rows of queues the app
    does not register are only counted and retried, ``UNREGISTERED_GRACE`` late (see below).

    A lease has lapsed before ``lease_now``, the database's time (``SqlProvider.lease_time``) that
    every host's leases are written on; ``now`` (the host's) stamps the rows, as everything else the
    host writes. Without ``lease_now``, ``now`` is both."""
    lapsed_before = now if lease_now is None else lease_now
    m = provider.tables.messages
    out = {"leases_retried": 0, "leases_abandoned": 0}
    woke: set[str] = set()
    registered = app.by_queue()
    async with provider.engine.begin() as conn:
        for queue, opts in [*((q, s.options) for q, s in registered.items()), (None, None)]:
            # None: every queue in the table that the app does not register (its rows would stay
            # leased for good otherwise). Its options are not known here: a type removed, or one that
            # a newer version mid-rollout or another app on the same table registers, perhaps with
            # more attempts than the defaults or lease_expired="abandon". So the attempt is counted
            # and the row made claimable, never dead-lettered or abandoned on this app's defaults:
            # a host that registers the queue decides that by its own options: its sweeper, which goes
            # first (the grace), or its pipeline, which dead-letters a message whose attempts were used
            # up before it runs (so a message that kills every worker that runs it still ends); a
            # removed type's row waits, Failed, for its expiry or a person
            if queue is not None:
                lapsed = sa.and_(m.c.queue == queue, m.c.status == LEASED, m.c.locked_until < lapsed_before)
            else:
                lapsed = sa.and_(
                    m.c.queue.not_in(sorted(registered)),
                    m.c.status == LEASED,
                    m.c.locked_until < lapsed_before - UNREGISTERED_GRACE,
                )
            note = sa.func.coalesce(m.c.locked_by, "?")
            error = sa.literal("lease expired: worker ") + note + sa.literal(" stopped renewing it")
            common: dict[str, Any] = {
                "attempt": m.c.attempt + 1,
                "locked_by": None,
                "locked_until": None,
                "updated_at": now,
                "last_error": error,
            }
            if opts is None:
                res = await conn.execute(
                    sa.update(m)
                    .where(lapsed)
                    .values(status=MessageStatus.FAILED.value, available_at=now, **common)
                )
                out["leases_retried"] += res.rowcount or 0
                continue
            if opts.lease_expired == "abandon":
                res = await conn.execute(
                    sa.update(m)
                    .where(lapsed)
                    .values(status=MessageStatus.ABANDONED.value, settled_at=now, **common)
                )
                out["leases_abandoned"] += res.rowcount or 0
                continue
            dead = m.c.attempt + 1 >= opts.max_attempts
            res = await conn.execute(
                sa.update(m)
                .where(lapsed)
                .values(
                    status=sa.case(
                        (dead, MessageStatus.DEAD_LETTERED.value), else_=MessageStatus.FAILED.value
                    ),
                    reason=sa.case((dead, DeadLetterReason.MAX_ATTEMPTS.value), else_=m.c.reason),
                    description=sa.case((dead, error), else_=m.c.description),
                    settled_at=sa.case((dead, now), else_=m.c.settled_at),
                    available_at=now,
                    **common,
                )
            )
            if res.rowcount:
                out["leases_retried"] += res.rowcount
                if queue is not None:
                    woke.add(queue)
        await provider.notify_statements(conn, woke)
    return out


async def expire_waiting(provider: SqlProvider, now: datetime) -> int:
    """Rows nobody will claim before they expire (no handler, paused, held) become Expired, in every
    queue of the table (an expiry is the row's own, whatever registers its type)."""
    m = provider.tables.messages
    async with provider.engine.begin() as conn:
        res = await conn.execute(
            sa.update(m)
            .where(claimable(), m.c.expires_at < now)
            .values(
                status=MessageStatus.EXPIRED.value,
                reason=DeadLetterReason.EXPIRED.value,
                settled_at=now,
                updated_at=now,
            )
        )
    return res.rowcount or 0


async def _batched(provider: SqlProvider, build: Any) -> int:
    """Run ``build()`` until a batch touches fewer rows than the batch size."""
    total = 0
    while True:
        async with provider.engine.begin() as conn:
            res = await conn.execute(build())
        n = res.rowcount or 0
        total += n
        if n < provider.retention.batch:
            return total


async def retain(provider: SqlProvider, app: QueueingApp | None, now: datetime) -> dict[str, int]:
    m = provider.tables.messages
    policy = provider.retention
    out = {"archived": 0, "deleted_processed": 0, "deleted_archived": 0}
    succeeded = MessageStatus.SUCCEEDED.value

    def batch(where: list[sa.ColumnElement[bool]]) -> list[sa.ColumnElement[bool]]:
        return first_rows(m, where, policy.batch, provider.backend)

    # a queue's own keep_processed_for goes first: those rows are deleted, not archived. Every
    # statement here finds its rows on a partial index (settled and not archived, or archived), so a
    # long history costs a range of an index, not a read of the table per batch
    kept_for = {
        sub.queue: sub.options.keep_processed_for
        for sub in (app.subscriptions() if app is not None else [])
        if sub.options.keep_processed_for is not None
    }
    for queue, keep in kept_for.items():
        cutoff_p = now - keep

        def drop_processed(q: str = queue, c: datetime = cutoff_p) -> sa.Delete:
            return sa.delete(m).where(
                *batch([archived(m, False), m.c.settled_at < c, m.c.queue == q, m.c.status == succeeded])
            )

        def drop_archived_processed(q: str = queue, c: datetime = cutoff_p) -> sa.Delete:
            # archived by hand (or before their queue kept them for a while): an archive follows the
            # settlement, so archived before the cutoff means settled before it, never deleted early
            return sa.delete(m).where(
                *batch([archived(m), m.c.archived_at < c, m.c.queue == q, m.c.status == succeeded])
            )

        out["deleted_processed"] += await _batched(provider, drop_processed)
        out["deleted_processed"] += await _batched(provider, drop_archived_processed)
    if policy.archive_after is not None:
        cutoff = now - policy.archive_after
        statuses = sorted(policy.archive_statuses)
        # a queue that keeps its successes for a while has them deleted on time, not archived first
        kept = sa.and_(m.c.queue.in_(sorted(kept_for)), m.c.status == succeeded)
        others = [sa.not_(kept)] if kept_for else []

        def archive() -> sa.Update:
            due = [archived(m, False), m.c.settled_at < cutoff, m.c.status.in_(statuses), *others]
            return sa.update(m).where(*batch(due)).values(archived=True, archived_at=now)

        out["archived"] = await _batched(provider, archive)
    if policy.delete_archived_after is not None:
        cutoff_a = now - policy.delete_archived_after
        # the last success of each identity of an idempotent type is its handler's ctx.previous: kept
        newer = m.alias("newer")
        previous = sa.and_(
            m.c.identity.is_not(None),
            m.c.status == succeeded,
            ~sa.exists().where(
                newer.c.type == m.c.type,
                newer.c.identity == m.c.identity,
                newer.c.status == succeeded,
                newer.c.settled_at > m.c.settled_at,
            ),
        )

        def drop_archived() -> sa.Delete:
            return sa.delete(m).where(*batch([archived(m), m.c.archived_at < cutoff_a, sa.not_(previous)]))

        out["deleted_archived"] = await _batched(provider, drop_archived)
    return out


async def run_maintenance(
    provider: SqlProvider, app: QueueingApp | None, now: datetime, lease_now: datetime | None = None
) -> dict[str, int]:
    out: dict[str, int] = {}
    if app is not None:
        out.update(await sweep_leases(provider, app, now, lease_now=lease_now))
    out["expired"] = await expire_waiting(provider, now)
    out.update(await retain(provider, app, now))
    return out
