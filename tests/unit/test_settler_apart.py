"""The settler's split of a failed batch (``Settler._settle``): where a batch is one transaction, a
failure that is not the store's absence has it settled one by one, once. The provider here is a
stand-in with only the calls the settler makes, refusing what a test names; what it checks is the
settler's own choices: what settles, what is given up, what goes on as a batch, and how many calls."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from queueing_core.errors import ProviderError, ProviderUnavailable
from queueing_core.runtime import HistoryAhead
from queueing_core.transport import Capabilities
from queueing_core.worker import Settler


class Provider:
    def __init__(self, *, as_one: bool = True) -> None:
        self.capabilities = Capabilities(settles_as_one=as_one)
        self.calls: list[list[str]] = []
        self.committed: list[str] = []
        #: names whose settlement the store refuses (their values), in any batch
        self.bad: set[str] = set()
        #: every call fails with this (the store's trouble, not the data's), while set
        self.down: BaseException | None = None
        #: fails with ProviderUnavailable from this call on (counted from 1)
        self.away_from: int | None = None

    async def settle(self, chunk: list[Any]) -> None:
        names = [s.name for s in chunk]
        self.calls.append(names)
        if self.away_from is not None and len(self.calls) >= self.away_from:
            raise ProviderUnavailable("database unreachable")
        if self.down is not None:
            raise self.down
        if self.bad & set(names):
            raise ProviderError("database: a settlement failed: value out of range")
        self.committed += names


class Runtime:
    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.applied: list[str] = []
        self.dropped: list[int] = []

    def history_ahead(self, chunk: Any) -> HistoryAhead:
        # one journal row per settlement, numbered by name, so the test sees whose rows are dropped
        return HistoryAhead(rows={id(s.delivery): int(s.name[1:]) for s in chunk})

    def history_applied(self, chunk: Any, ahead: HistoryAhead) -> None:
        self.applied += [s.name for s in chunk]

    def history_not_settled(self, ahead: HistoryAhead) -> None:
        self.dropped += sorted(ahead.rows.values())

    async def record(self, chunk: Any, ahead: Any) -> None:
        return None


class Done:
    def __init__(self, name: str) -> None:
        self.name = name
        self.delivery = SimpleNamespace(applied=False, unconfirmed=False)  # (keyed by id() in the journal)


def batch(n: int) -> list[Any]:
    return [Done(f"s{i}") for i in range(n)]


def settler(p: Provider) -> tuple[Settler, Runtime, list[str]]:
    rt = Runtime(p)
    released: list[str] = []  # what the worker would stop renewing
    st = Settler(rt, on_settled=lambda chunk: released.extend(s.name for s in chunk))  # type: ignore[arg-type]
    st.backoff = 0.001
    return st, rt, released


async def test_one_refused_settlement_holds_back_no_other():
    p = Provider()
    p.bad = {"s2"}
    st, rt, released = settler(p)
    await st._flush(batch(5))
    assert p.committed == ["s0", "s1", "s3", "s4"]
    assert len(p.calls) == 1 + 5  # the batch, then each once: no retries of what settled
    assert rt.applied == ["s0", "s1", "s3", "s4"]
    assert rt.dropped == [2]  # only the refused one's journal row
    assert sorted(released) == [f"s{i}" for i in range(5)]  # each reported once
    assert len(released) == 5


async def test_a_batch_none_of_which_settles_apart_goes_on_with_its_tries():
    # the store's trouble dressed as a refusal (a failover's read-only server): nothing settles alone
    p = Provider()
    p.down = ProviderError("database: a settlement failed: read-only transaction")
    st, rt, released = settler(p)
    await st._flush(batch(4))
    # the batch, each once, then the batch's four other tries: not each single five times
    assert len(p.calls) == 1 + 4 + 4
    assert [len(c) for c in p.calls[5:]] == [4, 4, 4, 4]
    assert rt.dropped == [0, 1, 2, 3]
    assert sorted(released) == ["s0", "s1", "s2", "s3"]


async def test_the_store_going_away_during_the_split_ends_it():
    p = Provider()
    p.bad = {"s0"}
    p.away_from = 3  # the batch, s0 alone, then unreachable
    st, rt, released = settler(p)
    await st._flush(batch(4))
    # after the split met the store's absence, the rest went on as one batch, not one by one
    assert [len(c) for c in p.calls] == [4, 1, 1, 4, 4, 4, 4]
    assert p.committed == []
    assert rt.dropped == [0, 1, 2, 3]
    assert sorted(released) == ["s0", "s1", "s2", "s3"]


async def test_the_store_unreachable_never_splits():
    p = Provider()
    p.down = ProviderUnavailable("database unreachable")
    st, _, _ = settler(p)
    await st._flush(batch(3))
    assert [len(c) for c in p.calls] == [3, 3, 3, 3, 3]


async def test_a_transport_that_settles_each_message_apart_is_not_split():
    p = Provider(as_one=False)
    p.bad = {"s1"}
    st, _, _ = settler(p)
    await st._flush(batch(3))
    assert [len(c) for c in p.calls] == [3, 3, 3, 3, 3]


async def test_a_batch_that_settles_is_one_call():
    p = Provider()
    st, rt, _ = settler(p)
    await st._flush(batch(3))
    assert p.calls == [["s0", "s1", "s2"]]
    assert rt.applied == ["s0", "s1", "s2"]


async def test_what_settled_during_the_split_is_not_settled_again_when_the_store_comes_back():
    p = Provider()
    p.bad = {"s0"}
    p.away_from = 4  # the batch, s0 alone (refused), s1 alone (settled), then unreachable once
    st, rt, released = settler(p)
    original = p.settle

    async def settle(chunk: list[Any]) -> None:
        if len(p.calls) >= 4:  # after the outage's one call: back, and nothing refused any more
            p.away_from = None
            p.bad = set()
        await original(chunk)

    p.settle = settle  # type: ignore[method-assign]
    await st._flush(batch(4))
    # s1 settled alone; the rest (s0 refused, s2 and s3 untried) went on as one batch, which settled
    assert [len(c) for c in p.calls] == [4, 1, 1, 1, 3]
    assert p.calls[-1] == ["s0", "s2", "s3"]
    assert sorted(p.committed) == ["s0", "s1", "s2", "s3"]  # each once
    assert len(p.committed) == 4
    assert sorted(rt.applied) == ["s0", "s1", "s2", "s3"]
    assert len(rt.applied) == 4
    assert rt.dropped == []
    assert sorted(released) == ["s0", "s1", "s2", "s3"]
    assert len(released) == 4


async def test_none_settled_apart_then_the_batch_settles_on_a_later_try():
    p = Provider()
    p.down = ProviderError("database: a settlement failed: read-only transaction")
    st, rt, released = settler(p)
    original = p.settle

    async def settle(chunk: list[Any]) -> None:
        if len(p.calls) == 1 + 3:  # the batch and each of three alone failed: the server is back
            p.down = None
        await original(chunk)

    p.settle = settle  # type: ignore[method-assign]
    await st._flush(batch(3))
    assert [len(c) for c in p.calls] == [3, 1, 1, 1, 3]
    assert p.committed == ["s0", "s1", "s2"]
    assert rt.applied == ["s0", "s1", "s2"]
    assert rt.dropped == []
    assert sorted(released) == ["s0", "s1", "s2"]


async def test_a_split_cut_short_by_the_store_s_absence_may_split_again():
    p = Provider()
    p.bad = {"s0"}
    p.away_from = 3  # the batch, s0 alone (refused), then unreachable for one call
    st, rt, released = settler(p)
    original = p.settle

    async def settle(chunk: list[Any]) -> None:
        if len(p.calls) >= 3:
            p.away_from = None  # back; s0 is still refused
        await original(chunk)

    p.settle = settle  # type: ignore[method-assign]
    await st._flush(batch(4))
    # the rest as one batch (fails again: s0), split again: s1..s3 settle, only s0 is given up
    assert [len(c) for c in p.calls] == [4, 1, 1, 4, 1, 1, 1, 1]
    assert sorted(p.committed) == ["s1", "s2", "s3"]
    assert rt.dropped == [0]
    assert sorted(released) == ["s0", "s1", "s2", "s3"]
    assert len(released) == 4
