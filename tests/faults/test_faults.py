"""Every step of every multi-step sequence, made to fail on every provider (see ``table.py``).

After each case: the message can be found (the transport still holds it, or it ran), the history of a
worker's sequence agrees with the transport at once, and the operator's action can be repeated and
succeeds; then workers drain and the message ends where it must (it ran, it is gone from transport
and history, or it is archived), with history and transport agreeing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from queueing_core.errors import InvalidOperation
from queueing_core.ops import OpsService
from queueing_core.runtime import Runtime
from queueing_core.tracking import MessageQuery
from tests.contract.harness import Harness, running

from .inject import Crash, Injector
from .kits import DENIALS, KITS, Kit
from .sequences import BY_NAME, Ctx, Sequence, fault_app, run_again_until_settled
from .table import STEPS, WORKER_SEQUENCES, Case, cases

pytestmark = pytest.mark.asyncio(loop_scope="session")

DEAD = ("DeadLettered", "Expired")
#: outcomes after which a transport may keep no copy (an expired message is dropped by some; its
#: history keeps the body, so an operator can still retry it; a cancelled one ends where it is)
DONE = ("Succeeded", "Expired", "Cancelled")


#: how long history may take to reach the transport's state after a failure or a takeover (the
#: documented bound is about 2 s once the store answers; generous here for a loaded machine)
CONVERGES_WITHIN = 30.0


async def _runtime(h: Harness, app: Any, journal: Path) -> Runtime:
    # every process of a case keeps its history journal in one directory, as processes of one
    # machine do: what a crashed one left is taken over by the next
    rt = await h.runtime(app, history_journal=journal)
    delayed = getattr(rt.provider, "delayed", None)
    if delayed is not None:
        delayed.lease = timedelta(seconds=1)  # a dispatcher that died hands its batch on after this
    return rt


async def _close(rt: Runtime) -> None:
    with contextlib.suppress(Exception):
        await rt.close()


async def _where(kit: Kit, rt: Runtime, mid: uuid.UUID, queue: str) -> tuple[str | None, dict[str, int], Any]:
    rec = await rt.tracker.get(mid)
    return (rec.status if rec else None), await kit.places(rt, queue, mid), rec


def _disagreement(status: str | None, places: dict[str, int]) -> str | None:
    dead = places.get("dead", 0) > 0
    live = places.get("queue", 0) + places.get("delayed", 0) > 0
    if status is None:
        return None if not (dead or live) else "the transport holds a message its history does not know"
    if status in DONE:
        return None
    if status in DEAD and not dead:
        return f"history says {status} but no dead letter is held"
    if status not in DEAD and not live:
        return f"history says {status} but the transport holds no live copy"
    return None


async def _recover(ctx: Ctx, seq: Sequence, kit: Kit, timeout: float = 90.0) -> None:
    """Repeat the operator's action where it is needed and let a worker drain, until the message is
    where the sequence must leave it (a scan that crashed leaves its letters hidden for up to
    ``dead_letters.HOLD_SECONDS``: the timeout is longer, by a margin a loaded machine needs)."""
    ops = OpsService(ctx.rt)
    mid = ctx.mid
    deadline = time.monotonic() + timeout
    if seq.final == "cancelled":
        # a request that landed is enough, whatever came after it failed: the host that receives the
        # message settles it without running it. Without one, the operator cancels again
        ctx.rt.control.invalidate()
        if mid not in (await ctx.rt.control.state()).cancelled:
            await ops.cancel(mid)
    async with running(ctx.rt):
        while True:
            status, places, rec = await _where(kit, ctx.rt, mid, seq.queue)
            held = any(places.values())
            if seq.final == "cancelled":
                # a host that received it settled it without running it: it ends where it was cancelled
                assert not ctx.ran, f"a cancelled message ran (attempts {ctx.ran}; history {status})"
                if status == "Cancelled" and not held:
                    return
            elif seq.final == "gone":
                if rec is None and not held:
                    return
                await ops.purge(seq.purges)
            elif seq.final == "dead":
                # (a dead letter twice over is a duplicate: a forward whose answer was lost, repeated)
                live = places.get("queue", 0) + places.get("delayed", 0)
                if status == "DeadLettered" and places.get("dead", 0) and not live:
                    return
            elif seq.final == "archived":
                if rec is not None and rec.archived and not held:
                    return
                if rec is not None and not rec.archived and status == "Succeeded":
                    await ops.archive(mid)
            else:
                if status == "Succeeded" and not held:
                    return
                # a message still waiting (an hour) for its retry, where the operator's action was to
                # bring it forward, is brought forward again
                waiting = status == "Failed" or (places.get("delayed", 0) and not places.get("queue", 0))
                if places.get("dead", 0) or status in DEAD or (seq.name == "bring_forward" and waiting):
                    with contextlib.suppress(InvalidOperation):  # it moved on meanwhile: look again
                        await ops.retry(mid)
            if time.monotonic() > deadline:
                raise AssertionError(f"did not converge: history {status}, transport {places}")
            await asyncio.sleep(0.25)


#: how many times a case acts when its run's lease lapsed on its own before the step the case checks
LAPSES = 3


async def _act(case: Case, seq: Sequence, kit: Kit, ctx: Ctx) -> tuple[Injector, BaseException | None]:
    """The sequence prepared, then acted with the case's fault armed: the calls made, and what the
    act raised."""
    await seq.prepare(ctx)
    refused = {name: DENIALS[name] if seq.denied else None for name in seq.refused}
    injector = Injector(kit.points(), mode=case.mode, at=case.step, refused=refused)
    raised: BaseException | None = None
    with injector.installed(ctx.rt), injector.armed_for():
        try:
            await seq.act(ctx)
        except (Crash, Exception) as exc:
            raised = exc
    return injector, raised


def _lapsed_unasked(case: Case, ctx: Ctx, injector: Injector, listed: list[str]) -> bool:
    """The run's lease lapsed on its own (the queue's lease is 1 s, and a loaded machine can stall a
    run that long): the transport refused its settlement, so the steps after it were never called.
    True only where the case's check would fail for that alone (no fault of the case made it)."""
    if ctx.settlement is None or not ctx.settlement.delivery.refused:
        return False
    if case.mode is None:
        return injector.calls != listed
    return not injector.fired


@pytest.mark.parametrize("case", cases())
async def test_fault(case: Case, harnesses, tmp_path: Path) -> None:
    seq, kit = BY_NAME[case.sequence], KITS[case.provider]
    h: Harness = harnesses(case.provider)
    app = h.app()
    mode: dict[str, str] = {"handler": "ok"}
    ran: list[int] = []
    sent: list[uuid.UUID] = []
    fault_app(app, mode, ran, sent)
    rt = await _runtime(h, app, tmp_path)
    ctx = Ctx(app, rt, mode, ran=ran)
    listed = list(STEPS.get((case.sequence, case.provider), ()))
    try:
        for tries_left in reversed(range(LAPSES)):
            ran.clear()
            sent.clear()
            mode["handler"] = "ok"
            ctx = Ctx(app, rt, mode, ran=ran)
            injector, raised = await _act(case, seq, kit, ctx)
            if ctx.message_id is None and sent:
                ctx.message_id = sent[0]
            if not (tries_left and _lapsed_unasked(case, ctx, injector, listed)):
                break
            # (that message runs to its end, and the case is checked again on a new one)
            await run_again_until_settled(ctx)
        if case.mode is None:
            # (an operator's action whose call the transport refuses fails, and says so)
            assert (raised is not None) == (seq.refusal_leaves is not None), f"the baseline: {raised!r}"
            if os.environ.get("QUEUEING_FAULTS_DISCOVER"):  # write the rows to paste into table.py
                with open(os.environ["QUEUEING_FAULTS_DISCOVER"], "a") as out:
                    out.write(json.dumps([case.sequence, case.provider, injector.calls]) + "\n")
            assert injector.calls == listed or os.environ.get("QUEUEING_FAULTS_DISCOVER"), (
                f"the steps of {case.sequence} on {case.provider} changed; table.py lists {listed}, "
                f"the calls were {injector.calls}"
            )
            if seq.refusal_leaves is not None:
                wanted = MessageQuery(queue=seq.queue, status=(seq.refusal_leaves,))
                listing = await OpsService(rt).list_messages(wanted)
                assert [m.message_id for m in listing.items] == [ctx.mid], (
                    f"after the refusal ({raised!r}) the history lists {listing.items}, not the message as "
                    f"{seq.refusal_leaves}: {await rt.tracker.get(ctx.mid)}"
                )
        else:
            assert injector.fired, f"step {case.step} ({case.step_name}) was never reached: {injector.calls}"
            assert injector.calls[case.step] == case.step_name
        # the process that acted carries on (error) or is gone (crash): either way a new one takes over
        if kit.durable:
            await _close(rt)
            rt = ctx.rt = await _runtime(h, app, tmp_path)
        # history written ahead of a settlement, or left by a failed write, lands within a stated time
        assert await rt.history.settle(CONVERGES_WITHIN), f"history backlog left: {rt.history.backlog}"
        status, places, _ = await _where(kit, rt, ctx.mid, seq.queue)
        # an enqueue's send that ran, its answer lost (the enqueue raised); not SQLite's statement, which
        # runs inside the enqueue's transaction and is rolled back by the error (its commit's lost
        # answer is a send's); PostgreSQL's runs on an autocommit connection: it stands
        lost_send = (
            case.sequence == "enqueue_history"
            and case.mode == "lost"
            and not case.step_name.startswith("history.")
            and (case.step_name, case.provider) != ("sql.execute", "sqlite")
        )
        if (
            case.sequence == "enqueue_history"
            and raised is not None
            and status is None
            and not any(places.values())
        ):
            # (a send whose answer was lost did land: it must be found)
            assert not lost_send, f"the send ran, its answer lost, and the transport holds nothing: {places}"
            return  # the enqueue failed before its send landed: nothing was promised, nothing is left
        if seq.final != "gone":
            assert status in DONE or any(places.values()), f"lost: history {status}, transport {places}"
        # a producer that dies between its send and the history write leaves a message history does
        # not know yet (never one it claims wrongly); the run records it, which _recover waits for
        # (so does one whose send's answer was lost: the enqueue raised, the message is on its queue)
        unknown_until_it_runs = (
            case.sequence == "enqueue_history" and (case.mode == "crash" or lost_send) and status is None
        )
        if (
            case.sequence in WORKER_SEQUENCES or case.sequence == "enqueue_history"
        ) and not unknown_until_it_runs:
            why = _disagreement(status, places)
            assert why is None, f"{why} (history {status}, transport {places}, after {raised!r})"
        await _recover(ctx, seq, kit)
    finally:
        await _close(ctx.rt)
