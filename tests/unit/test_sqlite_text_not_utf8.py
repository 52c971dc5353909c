"""A SQLite row whose stored text is not UTF-8 (another program wrote it in Latin-1, say): SQLite keeps
whatever bytes it is given, and ``sqlite3`` fails the whole fetch on one such text. The body or headers
of a claimed row are that row's problem alone: it is dead-lettered as malformed with its text kept, the
rest of its queue runs, and the listings show it marked. A text elsewhere in a row that fails a fetch is
reported as what it is, never as the database being unreachable."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any

import pytest
import sqlalchemy as sa

from queueing_core import MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.errors import ConfigurationError, ProviderError, ProviderUnavailable
from queueing_core.providers.sql import SqlProvider
from queueing_core.runtime import Runtime
from queueing_core.testing import run_until_idle
from queueing_core.tracking import MessageQuery

#: ``{"ref": "é"}`` with the é in Latin-1: not UTF-8
LATIN_1 = "CAST(X'7B22726566223A2022E9227D' AS TEXT)"


@queue("not-utf8", max_attempts=3)
class Job(QueueMessage):
    ref: str


async def opened(tmp_path: Any) -> tuple[Runtime, list[str]]:
    app = QueueingApp("not-utf8")
    runs: list[str] = []

    @app.handler()
    async def job(msg: Job) -> None:
        runs.append(msg.ref)

    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    return rt, runs


async def damage(rt: Runtime, message_id: Any, **columns: str) -> None:
    """Write ``columns`` (SQL text) into the message's row, as another program would."""
    provider = rt.provider
    assert isinstance(provider, SqlProvider)
    m = provider.tables.messages
    values = {name: sa.literal_column(sql) for name, sql in columns.items()}
    async with provider.engine.begin() as conn:
        await conn.execute(sa.update(m).where(m.c.message_id == message_id).values(**values))


async def test_a_body_or_headers_not_utf8_is_dead_lettered_alone_and_the_queue_runs_on(tmp_path):
    rt, runs = await opened(tmp_path)
    try:
        body = await rt.app.enqueue(Job(ref="body"))
        headers = await rt.app.enqueue(Job(ref="headers"))
        good = await rt.app.enqueue(Job(ref="good"))
        await damage(rt, body.message_id, body=LATIN_1)
        await damage(rt, headers.message_id, headers=LATIN_1)

        await run_until_idle(rt, raise_errors=False)

        assert runs == ["good"]
        assert (await rt.tracker.get(good.message_id)).status == MessageStatus.SUCCEEDED
        for receipt, what in ((body, "body"), (headers, "headers")):
            record = await rt.tracker.get(receipt.message_id)
            assert record is not None
            assert record.status == MessageStatus.DEAD_LETTERED, what
            assert record.reason == "malformed-envelope", what
            assert "utf-8" in (record.description or "").lower(), record.description
            assert record.malformed is not None
            assert f"{what} is not UTF-8 text" in record.malformed
        dead = await rt.tracker.get(body.message_id)
        assert dead is not None
        assert dead.body is None
        assert dead.raw == '{"ref": "\ufffd"}'  # the stored text, its Latin-1 byte replaced
        assert dead.stored["body"] == '{"ref": "\ufffd"}'

        page = await rt.tracker.query(MessageQuery(queue="not-utf8"))
        listed = {r.message_id: r for r in page.items}
        assert len(listed) == 3
        assert listed[good.message_id].malformed is None
        assert listed[headers.message_id].malformed == "headers is not UTF-8 text"
    finally:
        await rt.close()


async def test_a_listing_holding_a_result_or_progress_not_utf8_shows_the_row_marked(tmp_path):
    rt, _ = await opened(tmp_path)
    try:
        done = await rt.app.enqueue(Job(ref="done"))
        await run_until_idle(rt)
        await damage(rt, done.message_id, result=LATIN_1, progress=LATIN_1)
        record = await rt.tracker.get(done.message_id)
        assert record is not None
        assert record.status == MessageStatus.SUCCEEDED
        assert (record.result, record.progress) == (None, None)
        assert record.malformed == "result is not UTF-8 text; progress is not UTF-8 text"
    finally:
        await rt.close()


@pytest.mark.parametrize("column", ["type", "correlation_id"])
async def test_a_text_not_utf8_elsewhere_in_a_row_is_not_the_database_unreachable(tmp_path, column):
    """Read as text by the driver (claim and listing alike), such a text still fails the fetch: the error
    says what failed, and is not taken for an outage, which callers retry without end."""
    rt, _ = await opened(tmp_path)
    try:
        bad = await rt.app.enqueue(Job(ref="bad"))
        await damage(rt, bad.message_id, **{column: "CAST(X'4AE9' AS TEXT)"})
        sub = rt.app.subscription("Job")
        assert sub is not None
        with pytest.raises(ProviderError, match="decode") as claimed:
            await rt.provider.receive(sub, 10)
        assert not isinstance(claimed.value, ProviderUnavailable)
        with pytest.raises(ProviderError, match="decode") as listed:
            await rt.tracker.query(MessageQuery(queue="not-utf8"))
        assert not isinstance(listed.value, ProviderUnavailable)
    finally:
        await rt.close()


async def test_a_database_file_in_utf16_is_refused_at_open(tmp_path) -> None:
    """The claim reads a body as its stored bytes and decodes them as UTF-8; a file another program
    made UTF-16 held every body in UTF-16, and every message was dead-lettered unread as malformed."""
    path = tmp_path / "utf16.db"
    made = sqlite3.connect(path)
    made.execute("PRAGMA encoding='UTF-16le'")
    made.execute("CREATE TABLE made_elsewhere (a)")  # (the encoding is fixed by the first table)
    made.commit()
    made.close()
    rt = Runtime(QueueingApp("utf16"), SqlProvider(f"sqlite:///{path}", listen=False))
    with pytest.raises(ConfigurationError) as refused:
        await rt.open()
    assert refused.value.setting == "QUEUEING_DATABASE_URL"
    assert "UTF-16le" in str(refused.value)
    with contextlib.suppress(Exception):
        await rt.close()


@queue("not-utf8-versions", idempotent=True, identity="sku")
class Version(QueueMessage):
    sku: str
    price: int


async def opened_versions(tmp_path: Any) -> tuple[Runtime, list[tuple[int, int | None]]]:
    """An app of versions whose handler notes each version's price and its ``ctx.previous``'s."""
    from queueing_core import HandlerContext

    app = QueueingApp("not-utf8-versions")
    seen: list[tuple[int, int | None]] = []

    @app.handler()
    async def handle(msg: Version, ctx: HandlerContext) -> None:
        seen.append((msg.price, ctx.previous.price if ctx.previous else None))

    rt = Runtime(app, SqlProvider(f"sqlite:///{tmp_path}/q.db", listen=False))
    await rt.open()
    return rt, seen


async def test_an_idempotent_enqueue_over_a_waiting_body_not_utf8_replaces_it(tmp_path):
    """The waiting version of an identity, its body damaged, failed every enqueue of the identity (the
    lookup read the body as text): it is now taken for a different body and replaced, and the version
    sent runs, the last success its ``ctx.previous`` as ever."""
    rt, seen = await opened_versions(tmp_path)
    try:
        await rt.app.enqueue(Version(sku="A", price=1))
        await run_until_idle(rt)
        waiting = await rt.app.enqueue(Version(sku="A", price=2))
        await damage(rt, waiting.message_id, body="CAST(X'7B22736B75223A2022E9227D' AS TEXT)")
        again = await rt.app.enqueue(Version(sku="A", price=3))
        assert (again.outcome, again.message_id) == ("replaced", waiting.message_id)
        await run_until_idle(rt)
        assert seen == [(1, None), (3, 1)]
    finally:
        await rt.close()


async def test_a_last_success_not_utf8_is_no_previous_version(tmp_path):
    rt, seen = await opened_versions(tmp_path)
    try:
        done = await rt.app.enqueue(Version(sku="A", price=1))
        await run_until_idle(rt)
        await damage(rt, done.message_id, body=LATIN_1)
        await rt.app.enqueue(Version(sku="A", price=2))
        await run_until_idle(rt)
        assert seen == [(1, None), (2, None)]  # (the lookup failed, told in the log: it ran)
    finally:
        await rt.close()
