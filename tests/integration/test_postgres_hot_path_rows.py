"""What the PostgreSQL hot path reads back from a claimed row: the envelope and lease exactly as stored,
whatever the session's time zone or date style; rows damaged outside the kit claimed as malformed,
each alone, beside the others."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from uuid import UUID

import pytest
import sqlalchemy as sa

from queueing_core import QueueingApp, QueueMessage, queue
from queueing_core.decisions import Complete
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.transport import Settlement


@queue("hot_rows")
class Note(QueueMessage):
    text: str


#: the ``text`` field of a stored body
TEXT = sa.literal_column("body->>'text'")


def app() -> QueueingApp:
    a = QueueingApp("hot_rows")

    @a.handler()
    async def handle(msg: Note) -> None:
        return None

    return a


#: a body near the SQL transport's limit of 1 MB once encoded: accents, a 4-byte character, quotes, a
#: backslash, a line break
BIG = ('é€😀 "q" \\ \n' * 40_000)[:480_000]


async def claim_and_check(pg_db, session: str | None, expires_at: datetime) -> None:
    """Claims two rows on connections with ``session``'s settings (libpq ``options``), one carrying
    ``expires_at``, and checks every value the claim read against the stored row; then settles both."""
    url = pg_db.url if session is None else f"{pg_db.url}?options={session.replace(' ', '%20')}"
    prov = SqlProvider(url, schema=pg_db.schema, listen=False, maintenance_interval=0.2)
    pg_db.providers.append(prov)  # (closed by the fixture)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Note(text=BIG), Note(text="small")])
    not_before = datetime(2020, 2, 29, 23, 59, 59, 999_999, tzinfo=UTC)
    m = prov.tables.messages
    engine = pg_db.sync_engine()
    with engine.begin() as conn:
        conn.execute(
            sa.update(m)
            .where(TEXT == "small")
            .values(not_before=not_before, expires_at=expires_at, headers={"k": "v"}, correlation_id="c-1")
        )
        stored = {
            r.text: r
            for r in conn.execute(
                sa.select(TEXT.label("text"), m.c.message_id, m.c.tracking_id, m.c.created_at)
            )
        }

    got = await prov.receive(a.subscription("Note"), 10)
    assert len(got) == 2
    assert all(d.malformed is None for d in got)
    with engine.connect() as conn:
        locked = dict(conn.execute(sa.select(m.c.id, m.c.locked_until)).all())
    engine.dispose()
    for d in got:
        env = d.envelope
        assert env is not None
        row = stored[env.body["text"]]
        assert isinstance(env.message_id, UUID)
        assert env.message_id == row.message_id
        assert isinstance(env.tracking_id, UUID)
        assert env.tracking_id == row.tracking_id
        assert env.created_at == row.created_at
        assert env.created_at.utcoffset() == timedelta(0)
        assert d.lease_until == locked[d.handle.row]
        assert d.lease_until.utcoffset() == timedelta(0)
        assert d.attempt == 1
        assert env.attempt == 0
    big, small = sorted(got, key=lambda d: len(d.envelope.body["text"]), reverse=True)
    assert big.envelope.body == {"text": BIG}
    assert big.envelope.headers == {}
    assert small.envelope.not_before == not_before
    assert small.envelope.not_before.utcoffset() == timedelta(0)
    assert small.envelope.expires_at == expires_at
    assert small.envelope.expires_at.utcoffset() == timedelta(0)
    assert small.envelope.headers == {"k": "v"}
    assert small.envelope.correlation_id == "c-1"

    await prov.settle([Settlement(d, Complete()) for d in got])
    assert not any(d.refused for d in got)


@pytest.mark.parametrize("session", [None, "-c TimeZone=Asia/Kathmandu"])  # (the server's own; +05:45)
async def test_a_claimed_row_reads_back_exactly_in_utc_whatever_the_sessions_time_zone(pg_db, session):
    await claim_and_check(pg_db, session, datetime(2999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC))


async def test_a_claim_reads_its_rows_whatever_the_sessions_date_style(pg_db):
    # times written day first (-03:30): psycopg cannot parse them as text
    session = "-c TimeZone=America/St_Johns -c DateStyle=SQL,DMY"
    await claim_and_check(pg_db, session, datetime(2999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC))


async def test_a_time_late_in_year_9999_is_read_in_a_session_ahead_of_utc(pg_db):
    # in +05:45 this time falls in year 10000, which no datetime holds: the claim must still read it
    latest = datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)
    await claim_and_check(pg_db, "-c TimeZone=Asia/Kathmandu", latest)


async def test_rows_damaged_outside_the_kit_are_claimed_malformed_each_alone(pg_db):
    prov = pg_db.provider(listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Note(text=f"n{i}") for i in range(5)])
    m = prov.tables.messages
    engine = pg_db.sync_engine()
    damage = {
        "n0": {"body": sa.text("'[1, 2]'::jsonb")},  # a body that is not an object
        "n1": {"headers": sa.text("""'{"k": 1}'::jsonb""")},  # a header that is not text
        "n2": {"type": ""},  # no type
        "n3": {"attempt": -1},  # an attempt count below zero
    }
    with engine.begin() as conn:
        ids = dict(conn.execute(sa.select(TEXT, m.c.id)).all())
        for text, values in damage.items():
            conn.execute(sa.update(m).where(m.c.id == ids[text]).values(**values))
    engine.dispose()

    got = await prov.receive(a.subscription("Note"), 10)
    by_row = {d.handle.row: d for d in got}
    assert sorted(by_row) == sorted(ids.values())
    for text in damage:
        d = by_row[ids[text]]
        assert d.envelope is None, text
        assert d.malformed is not None, text
        assert f"stored row {ids[text]} does not decode" in d.malformed.reason
    assert by_row[ids["n1"]].raw == '{"text": "n1"}'  # the stored body kept as the malformed text
    assert by_row[ids["n0"]].raw == "[1, 2]"
    fine = by_row[ids["n4"]]
    assert fine.malformed is None
    assert fine.envelope is not None
    assert fine.envelope.body == {"text": "n4"}


@pytest.mark.parametrize("column", ["expires_at", "not_before", "created_at"])
@pytest.mark.parametrize("value", ["infinity", "-infinity"])
async def test_a_time_no_datetime_holds_makes_its_row_malformed_alone(pg_db, column, value):
    # PostgreSQL stores ``infinity``; a claim reading it must not fail for every row of the queue
    prov = pg_db.provider(listen=False)
    a = app()
    rt = Runtime(a, prov)
    await rt.open()
    await a.enqueue_many([Note(text="bad"), Note(text="fine")])
    m = prov.tables.messages
    engine = pg_db.sync_engine()
    with engine.begin() as conn:
        conn.execute(sa.update(m).where(TEXT == "bad").values({column: sa.text(f"'{value}'::timestamptz")}))
        ids = dict(conn.execute(sa.select(TEXT, m.c.id)).all())
    engine.dispose()

    got = await prov.receive(a.subscription("Note"), 10)
    by_row = {d.handle.row: d for d in got}
    assert sorted(by_row) == sorted(ids.values())
    bad = by_row[ids["bad"]]
    assert bad.envelope is None
    assert bad.malformed is not None
    assert f"stored row {ids['bad']} does not decode" in bad.malformed.reason
    fine = by_row[ids["fine"]]
    assert fine.malformed is None
    assert fine.envelope is not None
    assert fine.envelope.body == {"text": "fine"}
