"""A run's bound (a transport's or host's longest run, counted from the receive) cuts a handler whose
own time limit is longer or unset, as its time limit would, with the bound's reason in its error; a
type whose own limit is nearer keeps it."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

from queueing_core import QueueingApp, QueueMessage, RetryAfter, queue
from queueing_core.clock import utcnow
from queueing_core.transport import RunBound
from tests.unit.test_sync_handler_threads import delivery, make

BOUND = RunBound(timedelta(seconds=2), "the host's own limit, 2 s")


@queue("bound-unlimited", max_attempts=3)
class Unlimited(QueueMessage):
    pass


@queue("bound-limited", max_attempts=3, time_limit=timedelta(milliseconds=200))
class Limited(QueueMessage):
    pass


def _app() -> QueueingApp:
    app = QueueingApp("bound")

    @app.handler()
    async def slow(msg: Unlimited) -> None:
        await asyncio.sleep(60)

    @app.handler()
    async def slow_too(msg: Limited) -> None:
        await asyncio.sleep(60)

    return app


async def test_a_handler_with_no_limit_is_cut_at_the_bound_from_its_receive() -> None:
    pipe, prod = make(_app())
    pipe.run_bound = BOUND
    # received an hour ago (it waited in a consumer's buffer): the bound has passed; it gets a second
    waited = dataclasses.replace(delivery(prod, Unlimited()), received_at=utcnow() - timedelta(hours=1))
    decision = await asyncio.wait_for(pipe.process(waited), 10)
    assert isinstance(decision, RetryAfter)
    assert decision.error == "cut after 1 s: the host's own limit, 2 s"


async def test_a_type_whose_own_limit_is_nearer_keeps_it() -> None:
    pipe, prod = make(_app())
    pipe.run_bound = BOUND
    decision = await asyncio.wait_for(pipe.process(delivery(prod, Limited())), 10)
    assert isinstance(decision, RetryAfter)
    assert decision.error == "execution time limit of 0.2s exceeded"


def test_the_tighter_of_two_bounds() -> None:
    longer = RunBound(timedelta(minutes=5), "longer")
    assert BOUND.tighter(longer) is BOUND
    assert longer.tighter(BOUND) is BOUND
    assert longer.tighter(None) is longer
