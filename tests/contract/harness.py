"""Provider harnesses for the contract suite: a fresh provider per test plus the few things a test
needs to reach under the kit (injecting raw bytes on the wire). A new provider joins the suite by
adding one harness here and one name in ``HARNESSES``."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx

from queueing_core import QueueingApp, QueueNaming
from queueing_core.ops import OpsService
from queueing_core.ops.api import PREFIX, create_app
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery, MessageRecord
from queueing_core.transport import Delivery, Provider
from queueing_core.worker import Worker
from tests.services import fresh_prefix


@dataclass
class Harness:
    name: str
    #: async () -> Provider, fresh for each test
    make_provider: Callable[[], Awaitable[Provider]]
    #: async (runtime, logical queue, raw bytes) -> None: put bytes on the wire, bypassing the kit
    inject_raw: Callable[[Runtime, str, bytes], Awaitable[None]]
    #: the transport delivers in enqueue order when one consumer runs one message at a time
    ordered: bool = True
    runtime_kwargs: Callable[[], dict[str, Any]] = field(default=lambda: {})
    cleanup: Callable[[], Awaitable[None]] | None = None
    #: async (runtime, delivery) -> None: take the delivery's lease away as the transport does (an
    #: operator's release, a lapsed visibility timeout or lock, a closed channel); None: no leases
    lose_lease: Callable[[Runtime, Delivery], Awaitable[None]] | None = None
    #: why the transport has no lease to lose (shown when the lease-fencing case is skipped)
    no_lease_reason: str = ""
    #: async (runtime, logical queue) -> dead letters the transport holds for that queue
    dead_letters: Callable[[Runtime, str], Awaitable[int]] | None = None

    def app(self) -> QueueingApp:
        # a unique prefix isolates each test on shared brokers and databases
        return QueueingApp("contract", naming=QueueNaming(prefix=fresh_prefix()))

    async def runtime(self, app: QueueingApp, provider: Provider | None = None, **kw: Any) -> Runtime:
        provider = provider or await self.make_provider()
        opts = {
            "pause_recheck": timedelta(milliseconds=200),
            "waiting_recheck": timedelta(milliseconds=200),
            "control_ttl": 0.05,
            **self.runtime_kwargs(),
            **kw,
        }
        rt = Runtime(app, provider, **opts)
        await rt.open()
        return rt


def fast_worker(runtime: Runtime, **kw: Any) -> Worker:
    opts = dict(poll_min=0.01, poll_max=0.1, pause_poll=0.05, shutdown_timeout=5.0, settle_linger=0.0)
    opts.update(kw)
    return Worker(runtime, **opts)


@contextlib.asynccontextmanager
async def running(runtime: Runtime, **kw: Any) -> AsyncIterator[Worker]:
    worker = fast_worker(runtime, **kw)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.shutdown()


OPS_KEY = "test-key-not-a-secret"


@contextlib.asynccontextmanager
async def ops_client(runtime: Runtime, key: str = OPS_KEY) -> AsyncIterator[httpx.AsyncClient]:
    """The ops API over ASGI with its key: what an operator's HTTP calls reach."""
    api = create_app(OpsService(runtime), api_key=key)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://t" + PREFIX, headers={"X-API-Key": key}
    ) as client:
        yield client


async def wait_until(
    predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 30.0, what: str = "condition"
) -> None:
    # generous: a loaded CI machine can stall for seconds, and waiting longer only costs time when
    # something is already broken
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def record(runtime: Runtime, message_id: uuid.UUID) -> MessageRecord:
    rec = await runtime.tracker.get(message_id)
    assert rec is not None, f"no history for {message_id}"
    return rec


async def statuses(runtime: Runtime, ids: list[uuid.UUID]) -> list[str]:
    return [(await record(runtime, i)).status for i in ids]


async def all_have(runtime: Runtime, ids: list[uuid.UUID], status: str) -> bool:
    for i in ids:
        rec = await runtime.tracker.get(i)
        if rec is None or rec.status != status:
            return False
    return True


async def find(runtime: Runtime, **query: Any) -> list[MessageRecord]:
    return (await runtime.tracker.query(MessageQuery(**query), limit=500)).items


async def lease_lapses(rt: Runtime, delivery: Delivery) -> None:
    """Let the lease run out: the transport makes the message visible (or unlocks it) by itself."""
    sub = rt.app.subscription(delivery.type_name or "")
    assert sub is not None
    await asyncio.sleep(sub.options.lease_duration.total_seconds() + 0.5)


async def operator_release(rt: Runtime, delivery: Delivery) -> None:
    """An operator gives the lease back over the ops service, as `POST .../release` does."""
    assert delivery.envelope is not None
    await OpsService(rt).release_lease(delivery.envelope.message_id)


async def native_dead_letters(rt: Runtime, queue: str) -> int:
    """Dead letters by the transport's own count (Service Bus, RabbitMQ, SQS)."""
    counts = await rt.provider.native_counts()  # type: ignore[attr-defined]
    return int(counts.get(queue, {}).get("dead_lettered", 0))


async def history_dead_letters(rt: Runtime, queue: str) -> int:
    """Dead letters of a transport whose history is the transport itself (SQL)."""
    return len(await find(rt, queue=queue, status=("DeadLettered",)))


# -- in-process ------------------------------------------------------------------------------------
def inprocess() -> Harness:
    from queueing_core.providers.inprocess import InProcessProvider, _Item, _seq

    async def make() -> Provider:
        return InProcessProvider()

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        from queueing_core.clock import utcnow

        prov = rt.provider
        assert isinstance(prov, InProcessProvider)
        prov._q(queue).put(_Item(utcnow(), next(_seq), raw), utcnow())

    async def dead_letters(rt: Runtime, queue: str) -> int:
        return len(rt.provider.dead_letters.get(queue, []))  # type: ignore[attr-defined]

    return Harness(
        "inprocess",
        ordered=True,
        make_provider=make,
        inject_raw=inject,
        no_lease_reason="the in-process provider hands a message to one run and nothing can take it back",
        dead_letters=dead_letters,
    )


# -- SQL ---------------------------------------------------------------------------------------------
def _sql_inject(backend: str):
    import json

    from queueing_core.clock import utcnow

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        import sqlalchemy as sa

        prov = rt.provider
        m = prov.tables.messages
        now = utcnow()
        text = raw.decode()
        # PostgreSQL's jsonb holds only JSON, so there the "corrupt" body is a JSON string, not an object;
        # SQLite stores whatever text it is given
        pg = backend == "postgresql"
        cast = "CAST({} AS jsonb)" if pg else "{}"
        async with prov.engine.begin() as conn:
            await conn.execute(
                sa.text(
                    f"INSERT INTO {m.fullname} (message_id, tracking_id, queue, type, status, attempt, "
                    "created_at, updated_at, available_at, headers, body, archived) VALUES (:mid, :tid, :q, "
                    f"'Job', 'Pending', 0, :now, :now, :now, {cast.format(':h')}, {cast.format(':b')}, false)"
                ).bindparams(
                    mid=uuid.uuid4(),
                    tid=uuid.uuid4(),
                    q=queue,
                    now=now,
                    h="{}",
                    b=json.dumps(text) if pg else text,
                )
            )

    return inject


def sqlite(tmp_dir: str) -> Harness:
    from queueing_core.providers.sql import SqlProvider

    url = f"sqlite:///{tmp_dir}/contract-{uuid.uuid4().hex[:8]}.db"
    made: list[SqlProvider] = []

    async def make() -> Provider:
        prov = SqlProvider(url, maintenance_interval=0.2)
        made.append(prov)
        return prov

    async def cleanup() -> None:
        # closed on the test's own event loop: a provider left to the garbage collector stops its
        # aiosqlite thread from there, and that thread then reports to a loop already closed
        # (PytestUnhandledThreadExceptionWarning "Event loop is closed", in whichever test is running)
        for prov in made:
            await prov.close()

    return Harness(
        "sqlite",
        make_provider=make,
        inject_raw=_sql_inject("sqlite"),
        cleanup=cleanup,
        lose_lease=operator_release,
        dead_letters=history_dead_letters,
    )


def postgres() -> Harness:
    from queueing_core.providers.sql import SqlProvider
    from tests.services import POSTGRES_URL, drop_schema, require

    require("PostgreSQL", "127.0.0.1", 5432)
    schema = f"qt_{uuid.uuid4().hex[:10]}"
    made: list[SqlProvider] = []

    async def make() -> Provider:
        prov = SqlProvider(POSTGRES_URL, schema=schema, maintenance_interval=0.2)
        made.append(prov)
        return prov

    async def cleanup() -> None:
        for prov in made:
            await prov.close()
        await drop_schema(schema)

    return Harness(
        "postgres",
        make_provider=make,
        inject_raw=_sql_inject("postgresql"),
        cleanup=cleanup,
        lose_lease=operator_release,
        dead_letters=history_dead_letters,
    )


# -- Azure Storage Queues (Azurite) ----------------------------------------------------------------
def storage_queue(azurite, delayed_url: str | None = None) -> Harness:
    """``delayed_url``: a database for the optional delayed store (delays beyond the queue's 7-day
    visibility limit wait there); without it, none, as the contract suite runs it."""
    from queueing_core.connections import StorageConnection
    from queueing_core.providers.sql.history import SideStores
    from queueing_core.providers.storage_queue import StorageQueueProvider, encode_body

    # fresh tables per test: a shared control table would leak pauses between tests
    tables = {"control_table": f"ctl{uuid.uuid4().hex[:10]}", "tracker_table": f"hist{uuid.uuid4().hex[:10]}"}
    made: list[StorageQueueProvider] = []

    async def make() -> Provider:
        stores = SideStores(delayed_url) if delayed_url is not None else None
        prov = StorageQueueProvider(
            StorageConnection(azurite.connection_string), delayed_stores=stores, **tables
        )
        made.append(prov)
        return prov

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        prov = rt.provider
        c = await prov._ensure(prov.physical(queue))
        await c.send_message(encode_body(raw.decode()))

    async def cleanup() -> None:
        for prov in made:
            await prov.close()

    async def dead_letters(rt: Runtime, queue: str) -> int:
        prov = rt.provider
        poison = await prov._ensure(prov.poison_name(queue))
        return int((await poison.get_queue_properties()).approximate_message_count or 0)

    # Storage Queues do not promise order
    return Harness(
        "storage_queue",
        make_provider=make,
        inject_raw=inject,
        ordered=False,
        cleanup=cleanup,
        lose_lease=lease_lapses,
        dead_letters=dead_letters,
    )


# -- Azure Service Bus (the in-memory stand-in; history and control state in Tables over Azurite) -----
def servicebus(azurite) -> Harness:
    from azure.servicebus import ServiceBusMessage

    from queueing_core.fakes.servicebus import (
        FakeServiceBusAdministrationClient,
        FakeServiceBusClient,
        FakeServiceBusNamespace,
    )
    from queueing_core.providers.servicebus import ServiceBusProvider
    from queueing_core.providers.tables import tables_from_connection

    namespace = FakeServiceBusNamespace()
    tables = {"control_table": f"ctl{uuid.uuid4().hex[:10]}", "tracker_table": f"hist{uuid.uuid4().hex[:10]}"}
    made: list[ServiceBusProvider] = []

    async def make() -> Provider:
        control, tracker = tables_from_connection(azurite.connection_string, **tables)
        prov = ServiceBusProvider(
            client=FakeServiceBusClient(namespace),
            admin=FakeServiceBusAdministrationClient(namespace),
            control=control,
            tracker=tracker,
            receive_wait=0.2,
        )
        made.append(prov)
        return prov

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        prov = rt.provider
        async with prov.client.get_queue_sender(prov.physical(queue)) as sender:
            await sender.send_messages(ServiceBusMessage(raw))

    async def cleanup() -> None:
        for prov in made:
            await prov.close()

    # one receiver at a time receives in order, but retries are re-sent copies: no strict order promise
    return Harness(
        "servicebus",
        make_provider=make,
        inject_raw=inject,
        ordered=False,
        cleanup=cleanup,
        lose_lease=lease_lapses,
        dead_letters=native_dead_letters,
    )


def servicebus_live() -> Harness:
    """A real namespace or the official emulator, when QUEUEING_TEST_SERVICEBUS_CONNECTION is set."""
    import os

    import pytest

    conn = os.environ.get("QUEUEING_TEST_SERVICEBUS_CONNECTION")
    if not conn:
        pytest.skip(
            "set QUEUEING_TEST_SERVICEBUS_CONNECTION (a namespace connection string or the emulator's "
            "UseDevelopmentEmulator=true string) to run the contract suite on real Service Bus"
        )
    from queueing_core.connections import ServiceBusConnection
    from queueing_core.control import MemoryControlStore
    from queueing_core.providers.servicebus import ServiceBusProvider
    from queueing_core.tracking import MemoryTracker

    made: list[ServiceBusProvider] = []

    async def make() -> Provider:
        prov = ServiceBusProvider.from_connection(
            ServiceBusConnection(conn),
            control=MemoryControlStore(),
            tracker=MemoryTracker(),
            receive_wait=0.5,
        )
        made.append(prov)
        return prov

    async def inject(rt: Runtime, queue: str, raw: bytes) -> None:
        from azure.servicebus import ServiceBusMessage

        async with rt.provider.client.get_queue_sender(rt.provider.physical(queue)) as sender:
            await sender.send_messages(ServiceBusMessage(raw))

    async def cleanup() -> None:
        for prov in made:
            await prov.close()

    return Harness(
        "servicebus_live",
        make_provider=make,
        inject_raw=inject,
        ordered=False,
        cleanup=cleanup,
        lose_lease=lease_lapses,
        dead_letters=native_dead_letters,
    )


def _discovered() -> dict[str, Callable[..., Harness]]:
    """More providers join the suite by adding ``tests/contract/harness_<name>.py`` with a
    ``make_harness()`` function (it may take the ``azurite`` fixture or nothing)."""
    import importlib
    import pkgutil
    from pathlib import Path

    found: dict[str, Callable[..., Harness]] = {}
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith("harness_"):
            module = importlib.import_module(f"{__package__}.{info.name}")
            found[info.name.removeprefix("harness_")] = module.make_harness
    return found


HARNESSES: dict[str, Callable[..., Harness]] = {
    "inprocess": inprocess,
    "sqlite": sqlite,
    "postgres": postgres,
    "storage_queue": storage_queue,
    "servicebus": servicebus,
    "servicebus_live": servicebus_live,
}
HARNESSES.update(_discovered())
