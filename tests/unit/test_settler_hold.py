"""The settler's hold for a coming claim (providers that settle with their claims) is bounded: a batch
a failed claim gave back, and settlements left over after a full batch, are settled by the settler
itself without waiting for another completion or for shutdown. The provider here is a stand-in with
only the calls the settler makes; what it checks is the settler's own scheduling."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from queueing_core.runtime import HistoryAhead
from queueing_core.transport import SettlesWithClaims
from queueing_core.worker import Settler
from tests.contract.harness import wait_until


class Provider:
    def __init__(self) -> None:
        self.settled: list[list[str]] = []
        self.gate = asyncio.Event()

    def settles_with_claims(self) -> bool:
        return True

    async def settle(self, chunk: list[Any]) -> None:
        self.settled.append([s.name for s in chunk])

    async def receive(self, sub: Any, n: int) -> list[Any]:
        return []

    async def settle_and_receive(self, settlements: Any, sub: Any, n: int) -> list[Any]:
        await self.gate.wait()
        raise ConnectionError("the claim's transaction failed")


class Runtime:
    def __init__(self, provider: Provider) -> None:
        self.provider = provider

    def history_ahead(self, chunk: Any) -> HistoryAhead:
        return HistoryAhead()

    def history_applied(self, chunk: Any, ahead: HistoryAhead) -> None:
        return None

    def history_not_settled(self, ahead: HistoryAhead) -> None:
        return None

    async def record(self, chunk: Any, ahead: Any) -> None:
        return None


class Done:
    """A settlement as far as the settler looks at it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.delivery = None


def settled(p: Provider) -> set[str]:
    return {name for chunk in p.settled for name in chunk}


def test_the_stand_in_offers_what_the_settler_asks_for():
    assert isinstance(Provider(), SettlesWithClaims)


async def test_a_batch_given_back_during_the_hold_is_settled_without_another_completion():
    """A claim took s0 and failed while the settler held s1 for that claim: s0 comes back and both
    are settled by the settler, with no further completion and before shutdown."""
    p = Provider()
    st = Settler(Runtime(p), linger=0.002, hold=0.05)  # type: ignore[arg-type]
    st.start()
    st.add(Done("s0"))  # type: ignore[arg-type]
    claim = asyncio.create_task(st.claim_with(None, 10))  # type: ignore[arg-type]
    await wait_until(lambda: not st._buf, what="the claim to take s0")
    st.add(Done("s1"))  # type: ignore[arg-type]  # held: a claim is coming
    await asyncio.sleep(0.01)
    p.gate.set()  # the claim's transaction fails: s0 goes back to the settler
    with pytest.raises(ConnectionError):
        await claim
    await wait_until(lambda: settled(p) == {"s0", "s1"}, what="both settled by the settler itself")
    assert not st._returned
    await st.close()


async def test_settlements_left_after_a_full_batch_are_not_held_past_the_hold():
    """Batches of 2, three settlements, a consumer waiting for free slots the whole time (it will not
    claim): the third is settled once the bounded hold is over, not at shutdown."""
    p = Provider()
    st = Settler(Runtime(p), batch=2, linger=0.005, hold=0.02)  # type: ignore[arg-type]
    st.start()
    release = asyncio.Event()

    async def consumer_waiting_for_slots() -> None:
        with st.expecting():
            await release.wait()

    consumer = asyncio.create_task(consumer_waiting_for_slots())
    await wait_until(lambda: st._expecting == 1, what="the consumer to wait")
    for name in ("s1", "s2", "s3"):
        st.add(Done(name))  # type: ignore[arg-type]
    await wait_until(lambda: settled(p) == {"s1", "s2", "s3"}, what="all three settled")
    release.set()
    await consumer
    await st.close()
