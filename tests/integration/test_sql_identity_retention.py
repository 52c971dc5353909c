"""Identity documents of idempotent types (RabbitMQ and SQS keep them in ``queueing_identities``) are
pruned by the side stores' maintenance with the history they point at: a document nobody changed for
longer than the history is kept goes, a recent one stays, whatever its age. Real SQLite and PostgreSQL
(a schema of its own per test)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from queueing_core.providers.side_stores import SideStoreOps
from queueing_core.providers.sql.history import SideStores
from queueing_core.providers.sql.schema import MIGRATIONS, Tables
from tests.services import POSTGRES_URL, drop_schema, require


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


class Maintained(SideStoreOps):
    """The side stores' maintenance as a broker provider runs it, without a broker."""

    def __init__(self, stores: SideStores, clock: Clock) -> None:
        self.stores, self.clock = stores, clock


@pytest.fixture(params=["sqlite", "postgres"])
async def side(request, tmp_path):
    clock = Clock()
    schema = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/side.db"
    else:
        require("PostgreSQL", "127.0.0.1", 5432)
        url, schema = POSTGRES_URL, f"qi_{uuid.uuid4().hex[:10]}"
    stores = SideStores(url, schema=schema, retention=timedelta(days=14), clock=clock)
    await stores.open()
    yield stores, clock
    await stores.close()
    if schema is not None:
        await drop_schema(schema)


async def test_old_identity_documents_go_with_the_history_and_live_ones_stay(side):
    stores, clock = side
    control = stores.control
    doc = {"waiting": [str(uuid.uuid4()), str(uuid.uuid4()), "h"], "superseded": {}}
    start = clock.now
    assert await control.put_identity_doc("Order", "old", doc, None)
    assert await control.put_identity_doc("Order", "renewed", doc, None)
    clock.now = start + timedelta(days=10)
    # a document written again lately is live, however old its first version
    _, token = await control.identity_doc("Order", "renewed")
    assert await control.put_identity_doc("Order", "renewed", {**doc, "started": doc["waiting"][0]}, token)
    assert await control.put_identity_doc("Order", "recent", doc, None)
    assert await control.put_identity_doc("Invoice", "old", doc, None)  # (same identity, other type)
    clock.now = start + timedelta(days=15)
    done = await Maintained(stores, clock).maintain()
    assert done["identities_pruned"] == 1
    assert await control.identity_doc("Order", "old") is None
    for type_name, identity in [("Order", "renewed"), ("Order", "recent"), ("Invoice", "old")]:
        assert await control.identity_doc(type_name, identity) is not None, (type_name, identity)
    # a new version of the pruned identity starts a document of its own
    assert await control.put_identity_doc("Order", "old", doc, None)
    clock.now = start + timedelta(days=40)
    assert (await Maintained(stores, clock).maintain())["identities_pruned"] == 4


async def test_pruning_goes_in_batches(side):
    stores, clock = side
    for n in range(7):
        assert await stores.control.put_identity_doc("Order", f"id-{n}", {"n": n}, None)
    clock.now += timedelta(days=1)
    assert await stores.control.prune_identities(clock.now, batch=3) == 7
    t: Tables = stores.sql.tables
    async with stores.sql.engine.connect() as conn:
        assert (await conn.execute(sa.select(sa.func.count()).select_from(t.identities))).scalar() == 0


def test_the_index_pruning_reads_is_the_latest_migration():
    assert MIGRATIONS[-1][0] == 11
    assert "ix_queueing_identities_updated" in {ix.name for ix in Tables.build(None).identities.indexes}
