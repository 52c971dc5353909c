"""History converges: a history write that fails is kept (on local disk) and retried until it lands,
an enqueue whose send succeeded never fails because history did not, and ``health`` shows the backlog.

The history stores are cut off for real: a TCP proxy (``tests/tcp_proxy.py``) in front of Azurite's
Tables endpoint or PostgreSQL is closed and reopened, and a real worker process is killed (SIGKILL)
between a settlement and its history write.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from queueing_core import Health, MessageStatus, QueueingApp, QueueMessage, queue
from queueing_core.connections import StorageConnection
from queueing_core.ops.service import OpsService
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.providers.storage_queue import StorageQueueProvider
from queueing_core.runtime import Runtime
from queueing_core.tracking import MemoryTracker, MessageQuery, MessageRecord
from tests.azurite import ACCOUNT, ACCOUNT_KEY
from tests.contract.harness import running, wait_until
from tests.services import fresh_prefix
from tests.tcp_proxy import TcpProxy

from .flaky_history import FlakyTracker

ROOT = Path(__file__).resolve().parents[2]
#: how long history may take to catch up once its store answers again (the backlog retries every 2 s
#: at most; generous for a loaded machine)
CONVERGE_WITHIN = 30.0


@queue("hist/work", lease_duration=timedelta(seconds=30), max_concurrency=16)
class Work(QueueMessage):
    n: int
    child: bool = False


async def statuses(tracker, ids) -> list[str | None]:
    out = []
    for i in ids:
        rec = await tracker.get(i)
        out.append(rec.status if rec else None)
    return out


async def all_succeeded(tracker, ids) -> bool:
    try:
        return all(s == MessageStatus.SUCCEEDED for s in await statuses(tracker, ids))
    except Exception:
        return False


# -- enqueue and ctx.enqueue ---------------------------------------------------------------------------


async def test_enqueue_and_ctx_enqueue_keep_their_send_when_history_fails():
    app = QueueingApp("hist")
    runs: list[int] = []

    @app.handler()
    async def handle(msg: Work, ctx) -> None:
        runs.append(msg.n)
        if not msg.child:
            await ctx.enqueue(Work(n=msg.n + 100, child=True))

    tracker = FlakyTracker()
    rt = Runtime(app, InProcessProvider(), tracker=tracker)
    async with running(rt):
        tracker.down = True
        receipt = await app.enqueue(Work(n=1))  # used to raise: the caller would send it again
        await wait_until(lambda: sorted(runs) == [1, 101], timeout=30)
        assert rt.history.backlog >= 2
        tracker.down = False
        await wait_until(lambda: rt.history.backlog == 0, timeout=CONVERGE_WITHIN)
        children = [r for r in tracker._items.values() if r.body and r.body.get("child")]
        assert await all_succeeded(tracker, [receipt.message_id, *(c.message_id for c in children)])
    assert sorted(runs) == [1, 101], "the handler ran again because its ctx.enqueue failed"
    assert len(children) == 1


async def test_health_is_degraded_while_history_waits_to_be_written():
    app = QueueingApp("hist")

    @app.handler()
    async def handle(msg: Work) -> None:
        pass

    tracker = FlakyTracker()
    rt = Runtime(app, InProcessProvider(), tracker=tracker)
    ops = OpsService(rt)
    async with running(rt):
        await app.enqueue(Work(n=1))
        await wait_until(lambda: rt.history.backlog == 0 and len(tracker) == 1)
        assert (await ops.health()).status is Health.HEALTHY
        tracker.down = True
        await app.enqueue_many([Work(n=i) for i in range(5)])
        await wait_until(lambda: rt.history.backlog >= 5)
        report = await ops.health()
        assert report.status is Health.DEGRADED
        assert report.history_backlog >= 5
        tracker.down = False
        await wait_until(lambda: rt.history.backlog == 0, timeout=CONVERGE_WITHIN)
        assert (await ops.health()).status is Health.HEALTHY


async def test_a_dead_letter_recorded_while_history_failed_can_be_retried_once_it_lands():
    from queueing_core import NonRetryableError

    app = QueueingApp("hist")
    runs: list[int] = []
    go = asyncio.Event()

    @app.handler()
    async def handle(msg: Work) -> None:
        runs.append(msg.n)
        if len(runs) == 1:
            await go.wait()
            raise NonRetryableError("card declined")

    tracker = FlakyTracker()
    rt = Runtime(app, InProcessProvider(), tracker=tracker)
    ops = OpsService(rt)
    async with running(rt):
        receipt = await app.enqueue(Work(n=1))
        await wait_until(lambda: runs == [1])
        tracker.down = True  # the dead letter's history write fails
        go.set()
        await wait_until(lambda: getattr(getattr(rt, "history", None), "backlog", 0) == 1, timeout=30)
        tracker.down = False
        await wait_until(lambda: rt.history.backlog == 0, timeout=CONVERGE_WITHIN)
        rec = await tracker.get(receipt.message_id)
        assert rec is not None
        assert rec.status == MessageStatus.DEAD_LETTERED
        await ops.retry(receipt.message_id)  # refused while history still said Pending
        await wait_until(lambda: all_succeeded(tracker, [receipt.message_id]))
    assert runs == [1, 1]


async def test_a_late_record_never_replaces_a_newer_one():
    """A "Failed" kept while the store was down is written after the "Succeeded" of the retry that ran
    meanwhile on another host: the newer record stays."""
    tracker = MemoryTracker()
    now = time.time()
    base = dict(message_id=uuid.uuid4(), tracking_id=uuid.uuid4(), type="Work", queue="hist/work")
    created = datetime.fromtimestamp(now, UTC)
    newer = MessageRecord(
        **base, status="Succeeded", created_at=created, updated_at=created + timedelta(seconds=5)
    )
    late = MessageRecord(
        **base, status="Failed", created_at=created, updated_at=created + timedelta(seconds=1)
    )
    await tracker.upsert([newer])
    await tracker.upsert_newer([late])
    assert (await tracker.get(base["message_id"])).status == "Succeeded"


# -- Storage Queues: the Tables endpoint cut off ----------------------------------------------------


async def _cut_while_processing(rt: Runtime, app: QueueingApp, proxy: TcpProxy, ids: list) -> None:
    """Cut the history store for 5 s while handlers run and settle, enqueue meanwhile, bring it back:
    every message's history reaches Succeeded and the backlog empties."""
    async with running(rt):
        await asyncio.sleep(0.5)  # handlers are running
        await proxy.cut()
        late = await app.enqueue(Work(n=999))  # the send stands; its record waits
        ids.append(late.message_id)
        backlog_seen = 0
        cut_at = time.monotonic()
        # 5 s of outage at least, held on until something is seen waiting for the history store (a
        # loaded machine may get there later; the cap only bounds a broken run)
        while (elapsed := time.monotonic() - cut_at) < 5 or (not backlog_seen and elapsed < 60):
            backlog_seen = max(backlog_seen, rt.history.backlog)
            await asyncio.sleep(0.1)
        await proxy.restore()
        assert backlog_seen > 0, "nothing waited for the history store during the outage"
        await wait_until(lambda: all_succeeded(rt.tracker, ids), timeout=CONVERGE_WITHIN + 60)
        await wait_until(lambda: rt.history.backlog == 0, timeout=CONVERGE_WITHIN)


def _storage_connection(azurite, table_port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
        f"QueueEndpoint={azurite.queue_endpoint};"
        f"TableEndpoint=http://127.0.0.1:{table_port}/{ACCOUNT};"
    )


@pytest.fixture
async def tables_proxy(azurite):
    port = int(azurite.table_endpoint.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy("127.0.0.1", port)
    await proxy.start()
    yield proxy
    await proxy.stop()


def _storage_runtime(azurite, proxy: TcpProxy, tag: str, prefix: str, app: QueueingApp, **kw) -> Runtime:
    from queueing_core import QueueNaming

    app.naming = QueueNaming(prefix=prefix)
    provider = StorageQueueProvider(
        StorageConnection(_storage_connection(azurite, proxy.port)),
        control_table=f"ctl{tag}",
        tracker_table=f"hist{tag}",
    )
    return Runtime(app, provider, **kw)


async def _drop_storage(rt: Runtime) -> None:
    prov = rt.provider
    assert isinstance(prov, StorageQueueProvider)
    for q in (prov.physical("hist/work"), prov.poison_name("hist/work")):
        with contextlib.suppress(Exception):
            await prov.client(q).delete_queue()


async def test_storage_history_converges_after_the_tables_endpoint_is_cut(azurite, tables_proxy, tmp_path):
    tag = uuid.uuid4().hex[:8]
    app = QueueingApp("hist")

    @app.handler()
    async def handle(msg: Work) -> None:
        await asyncio.sleep(0.2)

    rt = _storage_runtime(azurite, tables_proxy, tag, fresh_prefix(), app, history_journal=tmp_path)
    await rt.open()
    try:
        receipts = await app.enqueue_many([Work(n=i) for i in range(60)])
        ids = [r.message_id for r in receipts]
        await _cut_while_processing(rt, app, tables_proxy, ids)
    finally:
        await _drop_storage(rt)
        await rt.close()


async def test_enqueue_count_in_the_cli_exits_0_when_history_is_down(azurite, tables_proxy, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = fresh_prefix()
    await tables_proxy.cut()
    env = {
        **os.environ,
        "QUEUEING_PROVIDER": "storage_queue",
        "QueueingStorage": _storage_connection(azurite, tables_proxy.port),
        "QUEUEING_CONTROL_TABLE": f"ctl{tag}",
        "QUEUEING_TRACKER_TABLE": f"hist{tag}",
        "QUEUEING_QUEUE_PREFIX": prefix,
        "QUEUEING_HISTORY_JOURNAL": str(tmp_path),
        "QUEUEING_APP": "tests.integration.history_worker:app",
    }
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "queueing_core.cli", "enqueue", "Beat", "--json", '{"n": 1}', "--count", "30"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "every message was sent" in done.stderr
    assert "enqueued 30" in done.stdout
    # the messages are on the queue, once each
    from azure.storage.queue.aio import QueueServiceClient

    async with QueueServiceClient.from_connection_string(azurite.connection_string) as svc:
        q = svc.get_queue_client(f"{prefix}beats")
        assert (await q.get_queue_properties()).approximate_message_count == 30
        # history is written by the next process that opens this store on this machine
        await tables_proxy.restore()
        from tests.integration.history_worker import build_app

        rt = _storage_runtime(azurite, tables_proxy, tag, prefix, build_app(), history_journal=tmp_path)
        await rt.open()
        try:
            await wait_until(lambda: rt.history.backlog == 0, timeout=CONVERGE_WITHIN)
            page = await rt.tracker.query(MessageQuery(), limit=100)
            assert len(page.items) == 30
        finally:
            await rt.close()
            await q.delete_queue()
            await svc.get_queue_client(f"{prefix}beats-poison").delete_queue()


# -- a worker killed between the settlement and the history write ----------------------------------


async def test_history_converges_after_a_worker_is_killed_between_settlement_and_history(azurite, tmp_path):
    tag = uuid.uuid4().hex[:8]
    prefix = fresh_prefix()
    env = {
        **os.environ,
        "QUEUEING_PROVIDER": "storage_queue",
        "QueueingStorage": azurite.connection_string,
        "QUEUEING_CONTROL_TABLE": f"ctl{tag}",
        "QUEUEING_TRACKER_TABLE": f"hist{tag}",
        "QUEUEING_QUEUE_PREFIX": prefix,
        "QUEUEING_HISTORY_JOURNAL": str(tmp_path),
    }
    from queueing_core import QueueNaming
    from tests.integration.history_worker import Beat, build_app

    app = build_app()
    app.naming = QueueNaming(prefix=prefix)
    rt = Runtime(
        app,
        StorageQueueProvider(
            StorageConnection(azurite.connection_string),
            control_table=f"ctl{tag}",
            tracker_table=f"hist{tag}",
        ),
    )
    await rt.open()
    physical = rt.provider.physical("beats")
    try:
        ids = [r.message_id for r in await app.enqueue_many([Beat(n=i) for i in range(40)])]
        cmd = [sys.executable, "-m", "tests.integration.history_worker"]
        crashing = subprocess.Popen(cmd, env={**env, "CRASH_AT_HISTORY": "1"}, cwd=ROOT)
        assert await asyncio.to_thread(crashing.wait, 60) == -9
        # settled on the transport, history not written: the state the crash leaves
        client = rt.provider.client(physical)
        left = (await client.get_queue_properties()).approximate_message_count
        assert left < 40, "the worker died before settling anything"
        assert MessageStatus.SUCCEEDED not in await statuses(rt.tracker, ids)
        started = time.monotonic()
        worker = subprocess.Popen(cmd, env=env, cwd=ROOT)
        try:
            await wait_until(lambda: all_succeeded(rt.tracker, ids), timeout=CONVERGE_WITHIN + 30)
            print(f"history converged {time.monotonic() - started:.1f}s after the restart")
        finally:
            worker.terminate()
            await asyncio.to_thread(worker.wait, 30)
    finally:
        for q in (physical, rt.provider.poison_name("beats")):
            with contextlib.suppress(Exception):
                await rt.provider.client(q).delete_queue()
        await rt.close()


# -- RabbitMQ: the PostgreSQL side store cut off ----------------------------------------------------


async def test_rabbitmq_history_converges_after_the_postgres_history_store_is_cut(tmp_path):
    from queueing_core import QueueNaming
    from queueing_core.providers.rabbitmq import RabbitMQProvider
    from queueing_core.providers.sql.history import SideStores
    from tests.services import RABBITMQ_URL, drop_schema, require

    require("RabbitMQ", "127.0.0.1", 5672)
    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qh_{uuid.uuid4().hex[:10]}"
    proxy = TcpProxy("127.0.0.1", 5432)
    await proxy.start()
    app = QueueingApp("hist", naming=QueueNaming(prefix=fresh_prefix()))

    @app.handler()
    async def handle(msg: Work) -> None:
        await asyncio.sleep(0.2)

    provider = RabbitMQProvider(
        RABBITMQ_URL,
        stores=SideStores(f"postgresql://postgres@127.0.0.1:{proxy.port}/test", schema=schema),
        idle_timeout=0.5,
        reconnect_interval=0.5,
    )
    rt = Runtime(app, provider, history_journal=tmp_path)
    await rt.open()
    try:
        ids = [r.message_id for r in await app.enqueue_many([Work(n=i) for i in range(80)])]
        await _cut_while_processing(rt, app, proxy, ids)
    finally:
        await rt.close()
        await proxy.stop()
        await drop_schema(schema)


async def test_the_journal_rows_of_a_live_process_are_left_to_it(tmp_path):
    """A process takes over only the rows of processes that are gone: a live one may be settling
    them right now (and drops those whose settlement is refused)."""
    from queueing_core.tracking.backlog import Journal

    journal = Journal(tmp_path / "j.sqlite3")
    now = datetime.now(UTC)
    recs = [
        MessageRecord(
            message_id=uuid.uuid4(),
            tracking_id=uuid.uuid4(),
            type="Work",
            queue="hist/work",
            status="Succeeded",
            created_at=now,
            updated_at=now,
        )
        for _ in range(3)
    ]
    journal.add(recs)
    assert journal.take_over() == []  # this process is alive: its rows are its own
    other = Journal(tmp_path / "j.sqlite3")  # another journal of this process, still open
    assert other.take_over() == []
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    journal._db.execute("UPDATE pending SET owner = ?", (f"{gone.pid}:x",))
    taken = other.take_over()
    assert [r.message_id for _, r in taken] == [r.message_id for r in recs]
    assert journal.take_over() == []  # taken once
    journal.add(recs[:1])
    journal.close()  # closed (as a crashed host leaves it): another journal takes its rows
    assert [r.message_id for _, r in other.take_over()] == [recs[0].message_id]
    other.close()


async def test_a_row_kept_before_a_settlement_that_never_happened_waits_out_the_lease(tmp_path):
    """A process that died between journaling a record and the transport applying its settlement
    leaves a row that may describe nothing that happened (the message is still on its queue and runs
    again when its lease lapses). It is written only after the lease, and never over a newer record;
    a row whose settlement was applied is written at once."""
    from queueing_core.tracking.backlog import Journal

    now = datetime.now(UTC)

    def record(status: str) -> MessageRecord:
        return MessageRecord(
            message_id=uuid.uuid4(),
            tracking_id=uuid.uuid4(),
            type="Work",
            queue="hist/work",
            status=status,
            created_at=now,
            updated_at=now,
        )

    dead_lettered, succeeded = record("DeadLettered"), record("Succeeded")
    dying = Journal(tmp_path / "j.sqlite3")
    rows = dying.add([dead_lettered, succeeded], settled=False)
    dying.mark_settled([rows[succeeded.message_id]])  # only this one's settlement was applied
    dying.close()  # the process is gone
    heir = Journal(tmp_path / "j.sqlite3")
    taken = heir.take_over(unsettled_after=60.0)
    assert [r.message_id for _, r in taken] == [succeeded.message_id]  # the applied one, at once
    assert heir.take_over(unsettled_after=60.0) == []  # the other waits out the lease
    heir.forget([seq for seq, _ in taken])  # written to the store
    heir.close()  # the unapplied one waits across another restart too
    later = Journal(tmp_path / "j.sqlite3")
    assert [r.message_id for _, r in later.take_over(unsettled_after=0.0)] == [dead_lettered.message_id]
    later.close()

    # written through the late-write rule: a run since then (a newer record) is kept
    from queueing_core.tracking import MemoryTracker

    tracker = MemoryTracker()
    rerun = dead_lettered.model_copy(update={"status": "Succeeded", "updated_at": now + timedelta(seconds=5)})
    await tracker.upsert([rerun])
    await tracker.upsert_newer([dead_lettered])
    assert (await tracker.get(dead_lettered.message_id)).status == "Succeeded"
