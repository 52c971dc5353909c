"""``Update status where`` on the SQL provider: a JSON-path comparison on the message body.

The path's steps are validated (property names and array indexes) by the ops models and still go to
the database as a bound parameter, as does the value: no part of the statement is built from input.
A comparison holds only for a value of the same JSON type (text with text, number with number,
boolean with boolean); null matches a missing value as well as JSON null.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from ...messages import MessageStatus
from .errors import db_boundary
from .schema import CLAIMABLE, IN_LIST_BATCH, archived

if TYPE_CHECKING:
    from .provider import SqlProvider

Scalar = str | int | float | bool | None
_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}


def _sqlite_path(steps: Sequence[str | int]) -> str:
    # steps are validated names ([A-Za-z_][A-Za-z0-9_]*) and integers; the result is still bound
    return "$" + "".join(f"[{s}]" if isinstance(s, int) else f'."{s}"' for s in steps)


def condition(p: SqlProvider, steps: Sequence[str | int], op: str, value: Scalar) -> sa.ColumnElement[bool]:
    body = p.tables.messages.c.body
    if p.backend == "postgresql":
        path = sa.bindparam("where_path", [str(s) for s in steps], type_=ARRAY(sa.Text()))
        kind: sa.ColumnElement[Any] = sa.func.jsonb_typeof(body.op("#>")(path))
        text: sa.ColumnElement[Any] = body.op("#>>", return_type=sa.Text())(path)
        is_text, is_number = kind == "string", kind == "number"

        def is_bool(b: bool) -> sa.ColumnElement[bool]:
            return sa.and_(kind == "boolean", text == ("true" if b else "false"))

    else:
        path = sa.bindparam("where_path", _sqlite_path(steps), type_=sa.Text())
        kind = sa.func.json_type(body, path)
        text = sa.func.json_extract(body, path)
        is_text, is_number = kind == "text", kind.in_(["integer", "real"])

        def is_bool(b: bool) -> sa.ColumnElement[bool]:
            return kind == ("true" if b else "false")

    compare = _OPS[op]
    if value is None:
        missing = sa.or_(kind.is_(None), kind == "null")
        if op not in ("eq", "ne"):
            return sa.false()  # nothing is ordered against null
        return missing if op == "eq" else sa.not_(missing)
    if isinstance(value, bool):
        # each boolean for which the comparison holds (false < true, as PostgreSQL orders them): as
        # for text and numbers, a value of another JSON type (or null, or none) never matches
        return sa.or_(sa.false(), *(is_bool(b) for b in (False, True) if compare(b, value)))
    test: sa.ColumnElement[bool]
    if isinstance(value, int | float):
        test = compare(_number(p, is_number, text), _number_value(p, value))
    else:
        test = compare(
            sa.case((is_text, text), else_=sa.null()), sa.bindparam("where_value", value, type_=sa.Text())
        )
    return test


def _number(p: SqlProvider, is_number: sa.ColumnElement[bool], text: sa.ColumnElement[Any]) -> Any:
    """The body's number, compared exactly: not as a double, whose 53 bits made an id past 2**53 match
    its neighbours (an update meant for one message changed several), and whose range a body's huge
    number overflowed (every numeric update of the queue failed)."""
    if p.backend == "postgresql":
        return sa.case((is_number, sa.cast(text, sa.Numeric())), else_=sa.null())
    # SQLite's json_extract gives the number with its own type (an integer stays one) and compares an
    # integer with an integer or a real exactly
    return sa.case((is_number, text), else_=sa.null())


def _number_value(p: SqlProvider, value: int | float) -> sa.BindParameter[Any]:
    if p.backend == "postgresql":
        # a float as its shortest decimal (0.1 is 0.1, as the body's text says, not the double's expansion)
        exact = Decimal(value) if isinstance(value, int) else Decimal(repr(value))
        return sa.bindparam("where_value", exact, type_=sa.Numeric(asdecimal=True))
    if isinstance(value, int):
        return sa.bindparam("where_value", value, type_=sa.BigInteger())
    return sa.bindparam("where_value", value, type_=sa.Float())


def _expiry_from(p: SqlProvider, now: datetime) -> sa.ColumnElement[Any]:
    """A new run's expiry by its row's type, as an operator's retry sets it: the type's expiration
    after ``now``, or none for a type that never expires. A type the app does not register keeps the
    expiry it has: none read as "never" by this host, a worker that registers it counts the type's
    expiration from the message's creation, and the message expired again unrun."""
    m = p.tables.messages
    types: dict[datetime | None, list[str]] = defaultdict(list)
    for sub in p._app.subscriptions() if p._app is not None else ():
        expiration = sub.options.expiration
        types[now + expiration if expiration is not None else None].append(sub.type_name)
    at = [
        (m.c.type.in_(names), sa.literal(when, m.c.expires_at.type) if when is not None else sa.null())
        for when, names in types.items()
    ]
    return sa.case(*at, else_=m.c.expires_at) if at else m.c.expires_at


async def update_status(
    p: SqlProvider,
    queue: str,
    steps: Sequence[str | int],
    op: str,
    value: Scalar,
    new_status: str,
    only: Sequence[str] | None,
    now: datetime,
) -> int:
    """Set ``new_status`` on the queue's matching messages that no worker holds and that are not
    archived; returns how many. A runnable status makes them claimable at once."""
    m = p.tables.messages
    where = [
        m.c.queue == queue,
        archived(m, False),
        m.c.status != MessageStatus.LEASED.value,
        condition(p, steps, op, value),
    ]
    if only:
        where.append(m.c.status.in_(list(only)))
    values: dict[str, Any] = {"status": new_status, "updated_at": now}
    if new_status in CLAIMABLE:
        values.update(available_at=now, settled_at=None)
        # a message whose run had ended (dead-lettered at its last attempt, abandoned, ...) gets its
        # attempts back, as an operator's retry gives them: with its attempts used up the worker would
        # dead-letter it again without running it. Ended: settled, whatever status it was given since
        # (dead-lettered, then held under a custom status, then put back). One held mid-retries (a
        # custom status set on a waiting message, never settled) keeps its count
        ended = [s.value for s in (*MessageStatus.terminal(), MessageStatus.ABANDONED)]
        settled = sa.or_(m.c.status.in_(sorted(ended)), m.c.settled_at.is_not(None))
        values["attempt"] = sa.case((settled, 0), else_=m.c.attempt)
        # and a new expiry, as the retry gives: its first run's, long past for a letter put back the
        # next morning, would end it Expired without running it
        values["expires_at"] = sa.case((settled, _expiry_from(p, now)), else_=m.c.expires_at)
        # put back by an operator: an idempotent type's version runs, whatever came after it (as a retry)
        values["superseded_by"] = None
    elif new_status in {s.value for s in MessageStatus.terminal()}:
        values["settled_at"] = now
    update = sa.update(m).where(*where).values(**values)
    with db_boundary("an update of statuses"):
        async with p.engine.begin() as conn:
            if new_status not in CLAIMABLE:
                return (await conn.execute(update)).rowcount or 0
            # put back to run: a cancellation asked for earlier (kept a day) would have the worker settle
            # it Cancelled again without running it, so those requests go with it, in the same transaction
            # and for exactly the rows changed (as an operator's retry of a cancelled message clears its own)
            changed = list((await conn.execute(update.returning(m.c.message_id))).scalars())
            x = p.tables.cancels
            for start in range(0, len(changed), IN_LIST_BATCH):
                await conn.execute(
                    x.delete().where(x.c.message_id.in_(changed[start : start + IN_LIST_BATCH]))
                )
            await p.notify_statements(conn, {queue})
    return len(changed)
