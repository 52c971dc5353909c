"""A runtime that fails to open (a store down, a role missing) releases what it made, and the next
invocation starts a fresh one instead of reusing closed clients."""

from __future__ import annotations

import pytest

import functions.host
from functions.host import FunctionsHost
from queueing_core import QueueingApp
from queueing_core.errors import ProviderUnavailable
from queueing_core.providers.inprocess import InProcessProvider
from queueing_core.settings import QueueingSettings


async def test_a_failed_open_releases_the_provider_and_the_next_invocation_starts_fresh(monkeypatch):
    made: list[InProcessProvider] = []
    closed: list[InProcessProvider] = []

    class DownOnce(InProcessProvider):
        async def open(self, app):  # type: ignore[no-untyped-def]
            if len(made) == 1:
                raise ProviderUnavailable("the store is down")
            await super().open(app)

        async def close(self) -> None:
            closed.append(self)
            await super().close()

    def make(cfg):  # type: ignore[no-untyped-def]
        made.append(DownOnce())
        return made[-1]

    monkeypatch.setattr(functions.host, "make_provider", make)
    host = FunctionsHost(QueueingApp("open"), QueueingSettings(provider="inprocess"))
    with pytest.raises(ProviderUnavailable):
        await host.runtime()
    assert closed == [made[0]]
    rt = await host.runtime()
    assert rt.provider is made[1]
    assert rt.is_open
    await host.close()
    assert closed == [made[0], made[1]]


async def test_the_runtime_keeps_history_the_store_has_not_taken_in_the_configured_journal(tmp_path):
    """The Functions host built its runtime without the journal (history held back by a store outage
    lived in memory only, lost with the instance); it now has the one QUEUEING_HISTORY_JOURNAL names,
    as `queueing serve` does (found in review)."""
    cfg = QueueingSettings(
        provider="sql",
        database_url=f"sqlite:///{tmp_path}/fn.db",
        functions_local_sqlite=True,
        history_journal=str(tmp_path / "journal"),
    )
    host = FunctionsHost(QueueingApp("fn-journal"), cfg)
    rt = await host.runtime()
    try:
        assert rt.history._journal_dir == tmp_path / "journal"
    finally:
        await rt.close()
