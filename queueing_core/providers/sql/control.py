"""Pause and circuit state in the same database, so every host shares it."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import sqlalchemy as sa

from ...clock import opt_utc
from ...control import circuit
from ...control.base import CANCEL_KEPT, CircuitState, ControlState, PauseKind, cas_backoff
from ...errors import ProviderError
from ...messages import MessageStatus
from ...options import CircuitBreakerOptions
from .errors import db_boundary

if TYPE_CHECKING:
    from .provider import SqlProvider

#: tries of a circuit change whose row another writer changed in between (never, where the row is
#: locked: PostgreSQL, and SQLite on the kit's own engine)
_TRIES = 100
#: NOTIFY payload prefix of a cancellation request: the other payloads are queue names, and the
#: unit separator is in none of them
CANCEL_PREFIX = "\x1fcancel\x1f"


def _state_of(row: Any) -> CircuitState:
    return CircuitState(
        row.type,
        row.state,
        row.consecutive_failures,
        opt_utc(row.opened_at),
        opt_utc(row.open_until),
        opt_utc(row.probe_until),
    )


class SqlControlStore:
    def __init__(self, provider: SqlProvider) -> None:
        self.provider = provider

    @property
    def _t(self) -> Any:
        return self.provider.tables

    async def state(self) -> ControlState:
        p, c, x = self._t.pauses, self._t.circuits, self._t.cancels
        with db_boundary("reading pause and circuit state"):
            await self.provider.ensure_open()
            since = self.provider.clock() - CANCEL_KEPT
            async with self.provider.engine.connect() as conn:
                cancels = (
                    await conn.execute(sa.select(x.c.message_id).where(x.c.requested_at > since))
                ).scalars()
                cancelled = frozenset(cancels)
                pauses = (await conn.execute(sa.select(p.c.kind, p.c.name))).all()
                # every circuit with something to say: open, half-open, or closed with failures counted
                # (the pipeline records a success only where it sees failures to reset)
                circuits = (
                    await conn.execute(
                        sa.select(c).where(sa.or_(c.c.state != "closed", c.c.consecutive_failures > 0))
                    )
                ).all()
            return ControlState(
                paused_queues=frozenset(n for k, n in pauses if k == "queue"),
                paused_types=frozenset(n for k, n in pauses if k == "type"),
                circuits={r.type: _state_of(r) for r in circuits},
                paused_schedules=frozenset(n for k, n in pauses if k == "schedule"),
                cancelled=cancelled,
            )

    async def set_cancel(self, message_id: UUID, requested: bool, now: datetime) -> None:
        x = self._t.cancels
        with db_boundary("storing a cancellation request"):
            await self.provider.ensure_open()
            async with self.provider.engine.begin() as conn:
                await conn.execute(
                    x.delete().where(
                        sa.or_(x.c.message_id == message_id, x.c.requested_at < now - CANCEL_KEPT)
                    )
                )
                if requested:
                    try:
                        async with conn.begin_nested():
                            await conn.execute(x.insert().values(message_id=message_id, requested_at=now))
                    except sa.exc.IntegrityError:
                        pass  # another request for it committed meanwhile: one is enough
                    if self.provider.backend == "postgresql":  # every host hears it at commit
                        await conn.execute(
                            sa.select(
                                sa.func.pg_notify(self.provider.channel, f"{CANCEL_PREFIX}{message_id}")
                            )
                        )

    async def identity_doc(self, type_name: str, identity: str) -> tuple[dict[str, Any], object] | None:
        i = self._t.identities
        with db_boundary("reading an identity"):
            await self.provider.ensure_open()
            async with self.provider.engine.connect() as conn:
                row = (
                    await conn.execute(
                        sa.select(i.c.doc, i.c.version).where(i.c.type == type_name, i.c.identity == identity)
                    )
                ).first()
            return None if row is None else (json.loads(row.doc), row.version)

    async def put_identity_doc(
        self, type_name: str, identity: str, doc: dict[str, Any], token: object | None
    ) -> bool:
        i = self._t.identities
        text = json.dumps(doc, separators=(",", ":"))
        now = self.provider.clock()
        with db_boundary("storing an identity"):
            await self.provider.ensure_open()
            async with self.provider.engine.begin() as conn:
                if token is None:
                    try:
                        async with conn.begin_nested():
                            await conn.execute(
                                i.insert().values(
                                    type=type_name, identity=identity, doc=text, version=1, updated_at=now
                                )
                            )
                    except sa.exc.IntegrityError:
                        return False  # another writer created it first
                    return True
                res = await conn.execute(
                    sa.update(i)
                    .where(i.c.type == type_name, i.c.identity == identity, i.c.version == token)
                    .values(doc=text, version=i.c.version + 1, updated_at=now)
                )
                return bool(res.rowcount == 1)

    async def set_paused(self, kind: PauseKind, name: str, paused: bool) -> None:
        p, m = self._t.pauses, self._t.messages
        now = self.provider.clock()
        with db_boundary("a pause or resume"):
            await self.provider.ensure_open()
            async with self.provider.engine.begin() as conn:
                if paused:
                    exists = (
                        await conn.execute(sa.select(p.c.name).where(p.c.kind == kind, p.c.name == name))
                    ).first()
                    if exists is None:
                        try:
                            async with conn.begin_nested():
                                await conn.execute(p.insert().values(kind=kind, name=name, paused_at=now))
                        except sa.exc.IntegrityError:
                            pass  # another pause of it committed meanwhile (two operators at once): paused
                    return
                await conn.execute(p.delete().where(p.c.kind == kind, p.c.name == name))
                if kind == "schedule":
                    return  # a schedule holds no messages
                # held rows become claimable at once instead of at their next recheck
                column = m.c.queue if kind == "queue" else m.c.type
                await conn.execute(
                    sa.update(m)
                    .where(column == name, m.c.status == MessageStatus.PAUSED.value)
                    .values(status=MessageStatus.PENDING.value, available_at=now, updated_at=now)
                )
                queues = (
                    [name]
                    if kind == "queue"
                    else list(
                        (await conn.execute(sa.select(m.c.queue).where(m.c.type == name).limit(1))).scalars()
                    )
                )
                await self.provider.notify_statements(conn, set(queues))

    async def _update(
        self, type_name: str, change: Callable[[CircuitState], CircuitState | None]
    ) -> tuple[CircuitState, bool]:
        """Read the row, apply ``change`` and write it back in one transaction that holds the row: every
        concurrent change is applied in turn, none lost or refused. ``change`` returning None means no
        write.

        The read locks the row (``FOR UPDATE`` on PostgreSQL; on SQLite the kit's engine begins each
        transaction with ``BEGIN IMMEDIATE``, which lets one writer in at a time), so the other writers
        wait for this commit and then read what it wrote. (A compare-and-set alone, retried without a
        pause, gave up under a burst of failures from many handlers, and those failures went
        uncounted.) The write still checks the version it read: on an engine of the caller's, SQLite
        begins no transaction before the read, and an unchecked write there overwrote what another
        writer wrote in between (every waiting probe was granted at once); such a write is tried
        again, after a short random pause."""
        c = self._t.circuits
        with db_boundary("updating a circuit"):
            await self.provider.ensure_open()
            for attempt in range(_TRIES):
                if attempt:
                    await cas_backoff(attempt)
                async with self.provider.engine.begin() as conn:
                    row = (
                        await conn.execute(sa.select(c).where(c.c.type == type_name).with_for_update())
                    ).first()
                    current = _state_of(row) if row is not None else CircuitState.closed(type_name)
                    new = change(current)
                    if new is None:
                        return current, False
                    values = dict(
                        state=new.state,
                        consecutive_failures=new.consecutive_failures,
                        opened_at=new.opened_at,
                        open_until=new.open_until,
                        probe_until=new.probe_until,
                    )
                    if row is not None:
                        done = await conn.execute(
                            sa.update(c)
                            .where(c.c.type == type_name, c.c.version == row.version)
                            .values(version=row.version + 1, **values)
                        )
                        if done.rowcount == 1:
                            return new, True
                        continue  # written in between (no lock held): read it again
                    try:
                        # (rows are never deleted: a closed circuit is written as closed)
                        async with conn.begin_nested():
                            await conn.execute(c.insert().values(type=type_name, version=1, **values))
                    except sa.exc.IntegrityError:
                        continue  # another writer created it first: read it again
                    return new, True
            raise ProviderError(f"circuit state for {type_name!r} kept changing under {_TRIES} tries")

    async def record_failure(
        self, type_name: str, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
    ) -> CircuitState:
        return (await self._update(type_name, lambda s: circuit.on_failure(s, opts, now, probe_until)))[0]

    async def record_success(self, type_name: str, probe_until: datetime | None = None) -> CircuitState:
        return (await self._update(type_name, lambda s: circuit.on_success(s, probe_until)))[0]

    async def acquire_probe(self, type_name: str, opts: CircuitBreakerOptions, now: datetime) -> bool:
        return (await self._update(type_name, lambda s: circuit.acquire_probe(s, opts, now)))[1]

    async def release_probe(self, type_name: str, held_until: datetime, now: datetime) -> None:
        await self._update(type_name, lambda s: circuit.release_probe(s, held_until, now))

    async def reset_circuit(self, type_name: str) -> None:
        await self._update(type_name, circuit.reset)
