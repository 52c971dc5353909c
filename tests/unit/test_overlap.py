"""The decision behind ``receives_in_flight="auto"`` (``queueing_core.overlap``): one claim unless the
worker is the only one holding leases; alone, a trial of alternating windows (one claim, then two)
keeps two claims only where they claimed more rows a second, for a while, then tries again."""

from __future__ import annotations

from queueing_core.overlap import BETTER, HOLD, PAIRS, SETTLE, WINDOW, Overlap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_window(o: Overlap, clock: Clock, seconds_per_claim: float, rows: int = 10) -> list[int]:
    """One trial window: its settling claims and its counted ones, each ``seconds_per_claim`` apart;
    the limits the controller gave before each claim."""
    limits = []
    for _ in range(SETTLE + WINDOW):
        limits.append(o.limit())
        clock.now += seconds_per_claim
        o.returned(rows)
    return limits


def run_trial(o: Overlap, clock: Clock, one: float, two: float) -> list[int]:
    """A whole trial: claims come back every ``one`` seconds while one claim runs, ``two`` while two."""
    modes = []
    for _ in range(2 * PAIRS):
        mode = o.limit()
        modes.append(mode)
        limits = run_window(o, clock, one if mode == 1 else two)
        assert set(limits) == {mode}, limits  # a window runs one mode throughout
    return modes


def test_one_claim_while_another_worker_holds_leases():
    clock = Clock()
    o = Overlap(clock)
    assert o.limit() == 1  # nobody has said it is alone yet
    o.alone(False)
    for _ in range(10 * (SETTLE + WINDOW)):
        clock.now += 0.001
        o.returned(10)
        assert o.limit() == 1


def test_a_trial_alternates_one_and_two_claims_and_keeps_two_when_they_claim_faster():
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    modes = run_trial(o, clock, one=0.004, two=0.003)  # two claims: a third more rows a second
    assert modes == [1, 2] * PAIRS
    assert o.limit() == 2
    # held: whatever the claims do meanwhile, until the finding is HOLD seconds old
    clock.now += HOLD - 1
    run_window(o, clock, 0.010)
    assert o.limit() == 2
    clock.now += 2
    assert o.limit() == 1  # tried again: the next trial starts with one claim
    assert run_trial(o, clock, one=0.004, two=0.003) == [1, 2] * PAIRS


def test_two_claims_that_claim_no_faster_are_not_kept():
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    # just short of the margin: two claims claim 1.04 times the rows a second of one
    run_trial(o, clock, one=0.004, two=0.004 / (BETTER - 0.01))
    assert o.limit() == 1
    clock.now += HOLD - 1
    assert o.limit() == 1  # the finding stands for HOLD seconds
    clock.now += 2
    o_modes = run_trial(o, clock, one=0.004, two=0.002)
    assert o_modes == [1, 2] * PAIRS
    assert o.limit() == 2  # tried again later, and faster now


def test_a_drained_queue_ends_a_trial_unfinished():
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    run_window(o, clock, 0.004)
    assert o.limit() == 2  # the second window of the trial
    run_window(o, clock, 0.001)  # (two claims, very fast: not counted, the queue drained after)
    o.drained()
    assert o.limit() == 1  # the trial starts again from its first window
    run_trial(o, clock, one=0.002, two=0.003)  # two claims slower this time
    assert o.limit() == 1


def test_another_worker_appearing_ends_two_claims_at_once():
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    run_trial(o, clock, one=0.004, two=0.002)
    assert o.limit() == 2
    o.alone(False)
    assert o.limit() == 1
    o.alone(True)  # alone again: a new trial, not the old finding
    assert o.limit() == 1
    assert run_trial(o, clock, one=0.004, two=0.002) == [1, 2] * PAIRS


def test_the_settling_claims_of_a_window_are_not_counted():
    """The first claims back after a change of mode started under the old one: a window's rate counts
    from the last of them, so a burst of them cannot make either mode look faster."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    for window in range(2 * PAIRS):
        for i in range(SETTLE + WINDOW):
            # the settling claims come back at once (a burst); the counted ones at the window's pace
            clock.now += 0.0 if i < SETTLE else (0.004 if window % 2 == 0 else 0.0041)
            o.returned(10)
    assert o.limit() == 1  # two claims slightly slower once the burst is left out



def test_a_finding_of_one_claim_stands_through_a_moment_not_alone():
    """A worker seen now and then (or a slow answer) ends a choice of two claims, not a finding that two
    do not pay: that one stands its time, rather than trials of two claims starting again at once."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    run_trial(o, clock, one=0.002, two=0.004)  # two claims slower
    assert o.limit() == 1
    o.alone(False)
    o.alone(True)
    limits = run_window(o, clock, 0.002) + run_window(o, clock, 0.002)
    assert set(limits) == {1}  # no trial within the finding's time
    clock.now += HOLD
    assert run_trial(o, clock, one=0.004, two=0.002) == [1, 2] * PAIRS  # then tried again


def test_a_trial_that_measured_no_time_keeps_one_claim():
    """Claims that all come back at one instant (a clock too coarse to tell them apart) are no
    evidence that two claims pay."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    run_trial(o, clock, one=0.0, two=0.0)
    assert o.limit() == 1
