"""The decision behind ``receives_in_flight="auto"`` (``queueing_core.overlap``): one claim unless the
worker is the only one holding leases; alone, a trial of alternating windows (one claim, then two)
keeps two claims only where they claimed more rows a second, pair by pair, for a while, then tries
again."""

from __future__ import annotations

from queueing_core.overlap import BETTER, HOLD, MOST_PAIRS, PAIRS, SETTLE, WINDOW, Overlap


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


def run_windows(o: Overlap, clock: Clock, paces: list[float]) -> list[int]:
    """Windows at the given seconds a claim, one after the other: the mode each ran."""
    modes = []
    for pace in paces:
        modes.append(o.limit())
        limits = run_window(o, clock, pace)
        assert set(limits) == {modes[-1]}, limits
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


def test_one_stalled_window_does_not_decide_a_trial():
    """The logged trial that kept one claim: one window of two claims stalled (2,662 rows a second, its
    others 7,166 and 11,315; its windows of one 5,529, 8,163 and 6,672). Summed, two claims looked 0.75
    times as fast; its pairs disagree, so the trial runs on, and two more pairs like its good ones
    keep two claims."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    paces = [10 / rate for rate in (5_529, 2_662, 8_163, 7_166, 6_672, 11_315)]
    assert run_windows(o, clock, paces) == [1, 2] * PAIRS
    assert o.limit() == 1  # no finding yet: the seventh window, one claim, of a fourth pair
    assert o.chosen_until < clock.now
    more = [10 / rate for rate in (6_500, 8_500) * (MOST_PAIRS - PAIRS)]
    assert run_windows(o, clock, more) == [1, 2] * (MOST_PAIRS - PAIRS)
    assert o.limit() == 2
    clock.now += HOLD - 1
    assert o.limit() == 2  # the finding stands its time


def test_pairs_that_disagree_are_settled_by_the_median_pair():
    """A server whose commits run one after the other, with a first window of one claim slow to start:
    the first pair says two by far, the rest say one, and the median keeps one claim (the pairs' mean,
    5.0 and four times 0.83, would keep two)."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    rates = [1_000, 5_000] + [6_000, 5_000] * (MOST_PAIRS - 1)  # two claims 0.83 of one, but at first
    assert run_windows(o, clock, [10 / r for r in rates]) == [1, 2] * MOST_PAIRS
    assert o.limit() == 1
    assert o.chosen_until > clock.now  # found, not merely undecided
    clock.now += HOLD
    assert o.limit() == 1  # a new trial starts with one claim
    assert run_trial(o, clock, one=0.004, two=0.003) == [1, 2] * PAIRS
    assert o.limit() == 2


def test_a_trial_ends_at_its_most_pairs():
    """Pairs that keep disagreeing do not keep the trial running: at the last pair the median says."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    # alternately a pair for two claims (1.5 times) and one against (0.5 times): three of five for two
    rates = [r for k in range(MOST_PAIRS) for r in ((4_000, 6_000) if k % 2 == 0 else (4_000, 2_000))]
    run_windows(o, clock, [10 / r for r in rates])
    assert o.limit() == 2
    assert o.chosen_until == clock.now + HOLD


def test_a_drained_queue_ends_a_trial_that_ran_on():
    """Pairs that disagreed, then the queue ran dry in the fourth pair: the trial starts again from its
    first window, and needs three pairs of its own before any finding."""
    clock = Clock()
    o = Overlap(clock)
    o.alone(True)
    disagreeing = [4_000, 6_000, 4_000, 2_000, 4_000, 6_000, 4_000]  # three pairs, then one claim
    run_windows(o, clock, [10 / r for r in disagreeing])
    assert o.limit() == 2  # the fourth pair's window of two claims
    o.drained()
    assert o.limit() == 1
    run_windows(o, clock, [10 / r for r in (4_000, 2_000) * (PAIRS - 1)])
    assert o.chosen_until < clock.now  # two pairs of the new trial: no finding yet
    run_windows(o, clock, [0.002, 0.004])  # the third pair: two claims at half the rate
    assert o.limit() == 1
    assert o.chosen_until == clock.now + HOLD  # three pairs, all for one claim
