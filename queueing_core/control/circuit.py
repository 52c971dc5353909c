"""Circuit-breaker transitions as pure functions, shared by every control store.

closed --N consecutive failures--> open --cooldown elapsed, one probe acquired--> half_open
half_open --probe succeeds--> closed;   half_open --probe fails--> open (a new cooldown)
A probe that never reports (its host died) is replaced after ``probe_timeout``. While half-open, only
the probe that is out decides: the outcome of any other run changes nothing.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from enum import StrEnum

from ..options import CircuitBreakerOptions
from .base import CircuitState


class Admission(StrEnum):
    RUN = "run"
    PROBE = "probe"  # the caller must acquire the probe first
    HOLD = "hold"


def admission(state: CircuitState, now: datetime) -> Admission:
    if state.state == "closed":
        return Admission.RUN
    if state.state == "open":
        return Admission.PROBE if state.open_until is not None and now >= state.open_until else Admission.HOLD
    # half_open: a probe is out; another may go only once the probe's time is up
    return Admission.PROBE if state.probe_until is not None and now >= state.probe_until else Admission.HOLD


def hold_until(state: CircuitState, now: datetime) -> datetime:
    if state.state == "open" and state.open_until is not None:
        return max(now, state.open_until)
    if state.state == "half_open" and state.probe_until is not None:
        return max(now, state.probe_until)
    return now


def on_failure(
    state: CircuitState, opts: CircuitBreakerOptions, now: datetime, probe_until: datetime | None = None
) -> CircuitState | None:
    """The state after a failure, or None when the failure must not change it.

    ``probe_until`` names the probe that failed (the time it was acquired until), None a run that was
    not a probe. A half-open circuit is the probe's to decide: only the probe that is out reopens it.
    A failure of any other run is left out, state and count: it is older news than the probe's (a run
    admitted before the circuit opened, or a probe that outlived ``probe_timeout`` and was replaced),
    and reopening on it gave the circuit a new cooldown under the live probe, whose success then could
    no longer close it."""
    if state.state == "half_open" and (probe_until is None or not _is_the_probe(state, probe_until)):
        return None
    failures = state.consecutive_failures + 1
    if state.state == "half_open" or failures >= opts.failure_threshold:
        return replace(
            state,
            state="open",
            consecutive_failures=failures,
            opened_at=now,
            open_until=now + opts.cooldown,
            probe_until=None,
        )
    return replace(state, consecutive_failures=failures)


def on_success(state: CircuitState, probe_until: datetime | None = None) -> CircuitState | None:
    """The state after a success, or None when the success must not change it.

    ``probe_until`` is None for a run admitted while the circuit was closed: its success resets the
    failures counted while it ran only if the circuit is still closed. One that began before the
    circuit opened says nothing of the downstream since (Polly and the like ignore a success placed
    before the break), and closing the circuit would skip its cooldown and its probe. A probe's success
    names the probe (the time it was acquired until) and closes the circuit only while that probe is
    still the one out: once it timed out and another took its place, the later probe decides.
    """
    if probe_until is None:
        return reset(state) if state.state == "closed" else None
    if not _is_the_probe(state, probe_until):
        return None
    return reset(state)


def reset(state: CircuitState) -> CircuitState:
    """Closed with no failures counted (an operator's reset, a success that closes)."""
    return CircuitState.closed(state.type_name)


def _is_the_probe(state: CircuitState, held_until: datetime) -> bool:
    # any later probe's time ends at least a probe_timeout after this one's; a second of leeway for
    # the stores that keep times to the second
    return (
        state.state == "half_open"
        and state.probe_until is not None
        and abs(state.probe_until - held_until) <= timedelta(seconds=1)
    )


def acquire_probe(state: CircuitState, opts: CircuitBreakerOptions, now: datetime) -> CircuitState | None:
    """The half-open state with this caller as the probe, or None if a probe may not go now."""
    if admission(state, now) is not Admission.PROBE:
        return None
    return replace(state, state="half_open", probe_until=now + opts.probe_timeout)


def release_probe(state: CircuitState, held_until: datetime, now: datetime) -> CircuitState | None:
    """The probe acquired until ``held_until`` handed back unrun (its host stopping): the next message
    may probe at once, rather than after ``probe_timeout``, which is for a probe whose host died. None
    when that probe is no longer the one out (it reported, or timed out and another took its place:
    any later probe's time ends at least a ``probe_timeout`` after it)."""
    if not _is_the_probe(state, held_until) or state.probe_until is None or state.probe_until <= now:
        return None
    return replace(state, probe_until=now)
