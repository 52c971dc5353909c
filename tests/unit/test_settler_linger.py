"""The settler lingers before each flush that is not a full batch, not only before the first of a
busy spell: settlements that arrive while a batch is being settled wait the linger for more to join
them. Flushed at once, a batch would hold only what arrived during one settle call, and the faster
the provider's call, the smaller the batches and the more commits. The provider is a stand-in with
only the calls the settler makes; what it checks is the settler's own scheduling."""

from __future__ import annotations

import asyncio
from typing import Any

from queueing_core.worker import Settler
from tests.contract.harness import wait_until
from tests.unit.test_settler_hold import Done, Runtime


class Provider:
    """Settles at once, but for the first call, which waits for its gate."""

    def __init__(self) -> None:
        self.settled: list[list[str]] = []
        self.gate = asyncio.Event()

    async def settle(self, chunk: list[Any]) -> None:
        self.settled.append([s.name for s in chunk])
        if len(self.settled) == 1:
            await self.gate.wait()


async def test_settlements_that_arrive_during_a_flush_linger_for_company():
    """s2 arrives while the first batch is being settled; s3 right after that batch is done. With a
    linger, they are settled together; without one, s2 would go alone the moment the first batch
    returned (s3 after it: two commits for two settlements)."""
    p = Provider()
    finished: list[list[str]] = []
    # (a long linger: the test's own steps between the first batch's end and s3 are far shorter)
    st = Settler(
        Runtime(p),  # type: ignore[arg-type]
        linger=1.0,
        on_settled=lambda chunk: finished.append([s.name for s in chunk]),  # type: ignore[attr-defined]
    )
    st.start()
    st.add(Done("s1"))  # type: ignore[arg-type]
    await wait_until(lambda: p.settled == [["s1"]], what="the first batch's settle call")
    st.add(Done("s2"))  # type: ignore[arg-type]  # (while s1's call is in flight)
    p.gate.set()
    await wait_until(lambda: bool(finished), what="the first batch settled")
    st.add(Done("s3"))  # type: ignore[arg-type]
    await wait_until(lambda: len(p.settled) == 2, what="the second batch's settle call")
    assert p.settled == [["s1"], ["s2", "s3"]]
    await st.close()


async def test_settlements_held_for_a_coming_claim_linger_once(monkeypatch):
    """s2 arrives during the first flush while a consumer is about to claim: it lingers once and is
    then held for the claim (bounded), not lingered again on the way to the hold."""
    real_sleep = asyncio.sleep
    lingers: list[float] = []
    linger = 0.0123  # (told apart from any other sleep by its value)

    async def counting(delay: float, *args: Any) -> Any:
        if delay == linger:
            lingers.append(delay)
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", counting)
    p = Provider()
    finished: list[list[str]] = []
    st = Settler(
        Runtime(p),  # type: ignore[arg-type]
        linger=linger,
        hold=0.05,
        on_settled=lambda chunk: finished.append([s.name for s in chunk]),  # type: ignore[attr-defined]
    )
    st.start()
    st.add(Done("s1"))  # type: ignore[arg-type]
    await wait_until(lambda: p.settled == [["s1"]], what="the first batch's settle call")
    assert lingers == [linger]  # (s1 alone lingered before its flush)
    with st.expecting():
        st.add(Done("s2"))  # type: ignore[arg-type]  # (while s1's call is in flight)
        p.gate.set()
        await wait_until(lambda: len(p.settled) == 2, what="s2 settled after the bounded hold")
    assert p.settled == [["s1"], ["s2"]]
    assert lingers == [linger, linger]
    await st.close()
