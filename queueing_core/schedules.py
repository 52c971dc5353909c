"""Recurring schedules: what they are, when they tick, and the store that claims each tick once.

A schedule is a cron expression (with a time zone) or a fixed interval, plus a function that returns
the message(s) to enqueue at each tick. This module is pure: tick arithmetic, the registry and the
:class:`TickStore` protocol. :mod:`queueing_core.scheduler` runs schedules inside a host.

Ticks are instants in UTC, whole seconds. Interval ticks are aligned to the Unix epoch, so every host
computes the same ticks without agreeing on a start time. A tick is *on time* while it is at most
``grace`` old; older ticks that were never claimed (every host was down), or were claimed and never
sent (the transport was down, or the host died), are *missed*, and the schedule's ``catch_up`` policy
decides: ``"skip"`` drops them, ``"once"`` runs the newest of them one time. So a long outage never
ends in a burst of catch-up ticks, nor in a tick sent hours late.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .clock import utcnow
from .errors import RegistrationError
from .messages import QueueMessage

if TYPE_CHECKING:
    from .envelope import Envelope
    from .producer import IdempotentOutcome

CatchUp = Literal["skip", "once"]
Produced = QueueMessage | Iterable[QueueMessage] | None
ScheduleFunc = Callable[..., Produced | Awaitable[Produced]]
#: sends prepared envelopes; ``True`` once the transport has durably accepted them
Send = Callable[["Sequence[Envelope]"], Awaitable[None]]
#: what a store that writes a tick's envelopes itself tells once they are committed: the outcome of
#: each idempotent one, by its place in the tick (discarded or replacing the waiting version); the rest
#: went in as they are. The scheduler records them and tells the ``enqueued`` hooks
Announce = Callable[["dict[int, IdempotentOutcome]"], Awaitable[object]]

SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_TICK_IDS = uuid.UUID("6f1c3a52-9a59-4d55-9c0f-5a5c4d1e0b18")
#: the headers a scheduled message carries: which schedule made it, and for which tick
SCHEDULE_HEADER = "queueing-schedule"
TICK_HEADER = "queueing-schedule-tick"
_WALK_LIMIT = 100_000  # on-time ticks walked at most (a 1-second schedule with a day of grace)


def _second(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(microsecond=0)


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    produce: ScheduleFunc
    cron: str | None = None
    every: timedelta | None = None
    timezone: str = "UTC"
    catch_up: CatchUp = "once"
    origin: str = ""
    _takes_tick: bool = field(default=False, repr=False)

    @property
    def expression(self) -> str:
        if self.cron is not None:
            return self.cron
        assert self.every is not None
        return f"every {self.every.total_seconds():g}s"

    def at_or_before(self, when: datetime) -> datetime:
        """The latest tick at or before ``when``."""
        if self.every is not None:
            return _second(EPOCH + ((when - EPOCH) // self.every) * self.every)
        # Derived from forward steps so that it always agrees with next_after: croniter's get_prev
        # drops the fold in a repeated (fall-back) hour and lands on the first occurrence, so due()
        # would skip the ticks of the second occurrence (or run a fixed-time tick twice, the second
        # time as a late catch-up). get_prev only gives the starting point; a start is accepted once a
        # tick lies between it and ``when``, and if none does (the hint was late) it moves back.
        start = self._cron_prev_hint(when) - timedelta(seconds=1)
        back = timedelta(hours=3)  # more than any daylight-saving shift
        tick = self.next_after(start)
        while tick > when:
            start -= back
            back *= 2  # a sparse schedule (yearly, 29 February) may need years: a few dozen steps
            tick = self.next_after(start)
        while (following := self.next_after(tick)) <= when:
            tick = following
        return tick

    def next_after(self, when: datetime) -> datetime:
        """The first tick strictly after ``when``."""
        if self.every is not None:
            return self.at_or_before(when) + self.every
        tick = self._cron_next(when)
        if not _interval_like(self._cron):
            # a job at a fixed wall-clock time runs once when the clock goes back: at the first of the
            # two instants that read that time, as Vixie cron does
            while _second_occurrence(tick, self._zone):
                tick = self._cron_next(tick)
        return tick

    @property
    def _cron(self) -> str:
        assert self.cron is not None
        return self.cron

    @property
    def _zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def _cron_next(self, when: datetime) -> datetime:
        from croniter import croniter

        zone = self._zone
        tick = _second(croniter(self._cron, when.astimezone(zone)).get_next(datetime))
        if _offset(tick, zone) < _offset(when, zone):
            # The clocks went back in between. croniter steps over a repeated stretch that is not a
            # whole hour (Australia/Lord_Howe goes back 30 minutes) when it starts before it, yet is
            # right from inside it: look again from the first instant of the repeated stretch.
            back = _fall_back(when, tick, zone)
            local = back.astimezone(zone)
            if croniter.match(self._cron, local.replace(tzinfo=None)):
                return back
            tick = min(tick, _second(croniter(self._cron, local).get_next(datetime)))
        return tick

    def _cron_prev_hint(self, when: datetime) -> datetime:
        """Where at_or_before starts: croniter's get_prev, read in both folds of its wall-clock time
        (the later instant that is not after ``when``), so that in the repeated hour the search starts
        at the tick rather than an hour before it (3,600 steps for a once-a-second expression)."""
        from croniter import croniter

        start = when.astimezone(self._zone) + timedelta(microseconds=1)
        prev = croniter(self._cron, start).get_prev(datetime)
        readings = {_second(prev.replace(fold=0)), _second(prev.replace(fold=1))}
        return max((t for t in readings if t <= when), default=min(readings))

    def due(self, last: datetime | None, now: datetime, grace: timedelta) -> list[datetime]:
        """Ticks to run now, oldest first, given the last tick claimed (``None``: never ran)."""
        latest = self.at_or_before(now)
        if last is not None and latest <= last:
            return []
        if last is None:  # a new schedule starts with its current tick, if that is on time
            return [latest] if now - latest <= grace else []
        # Walked forward with next_after, the one source of ticks (a walk back would call at_or_before,
        # itself a forward search, once per tick). On time means ``now - tick <= grace``.
        missed = self.at_or_before(now - grace - timedelta(microseconds=1))  # the newest tick too old
        on_time: list[datetime] = []
        tick = max(missed, last)
        while (tick := self.next_after(tick)) <= now and len(on_time) < _WALK_LIMIT:
            on_time.append(tick)
        if missed > last and self.catch_up == "once":
            on_time.insert(0, missed)  # the newest missed tick, once; older missed ones are dropped
        return on_time

    async def messages(self, tick: datetime) -> list[QueueMessage]:
        produced = self.produce(tick) if self._takes_tick else self.produce()
        if inspect.isawaitable(produced):
            produced = await produced
        if produced is None:
            return []
        items = [produced] if isinstance(produced, QueueMessage) else list(produced)
        for item in items:
            if not isinstance(item, QueueMessage):
                raise TypeError(f"schedule {self.name!r} produced {item!r}, which is not a QueueMessage")
        return items


def _interval_like(cron: str) -> bool:
    """A cron expression whose minute or hour field is ``*`` or a step (``*/15 * * * *``,
    ``0 */2 * * *``, ``@hourly``) repeats through the day: it keeps running in both occurrences of a
    repeated (fall-back) hour, so an hourly job still runs once per real hour. Any other expression
    names wall-clock times (``30 2 * * *``) and runs once at such a time."""
    fields = {"@hourly": "0 * * * *"}.get(cron.strip().lower(), cron).split()
    return any("*" in f or "/" in f for f in fields[:2])


def _second_occurrence(tick: datetime, zone: ZoneInfo) -> bool:
    """Whether ``tick`` reads a local time the clock already showed once that night (fall-back)."""
    local = tick.astimezone(zone)
    return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()


def _offset(when: datetime, zone: ZoneInfo) -> timedelta:
    offset = when.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


def _fall_back(after: datetime, until: datetime, zone: ZoneInfo) -> datetime:
    """The instant in (after, until] at which the zone's UTC offset drops, to the second."""
    # whole seconds throughout (zone transitions fall on whole seconds), so the halving always ends
    low, high, offset = _second(after), _second(until), _offset(after, zone)
    while high - low > timedelta(seconds=1):
        middle = low + timedelta(seconds=(high - low).total_seconds() // 2)
        if _offset(middle, zone) < offset:
            high = middle
        else:
            low = middle
    return high


def tick_message_id(schedule: str, tick: datetime, index: int) -> uuid.UUID:
    """The same id for the same message of the same tick on every host: a re-sent tick is a duplicate
    the SQL provider ignores and a transport with duplicate detection drops."""
    return uuid.uuid5(_TICK_IDS, f"{schedule}|{tick.isoformat()}|{index}")


def validate_name(name: str) -> str:
    if not SCHEDULE_NAME.fullmatch(name):
        raise RegistrationError(
            f"schedule name {name!r}: 1-200 letters, digits, '_', '.', ':' or '-', not starting "
            "with '.', ':' or '-'"
        )
    return name


def _check_zone(tz: str) -> None:
    try:
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise RegistrationError(f"unknown time zone {tz!r}: {exc}") from None


def _check_matches(schedule: Schedule) -> None:
    """croniter accepts expressions that name no real date (``0 0 30 2 *``, 30 February); such a
    schedule would fail at every wake of every host, so it fails here instead."""
    from croniter import CroniterError

    try:
        schedule.next_after(utcnow())
    except CroniterError as exc:
        raise RegistrationError(
            f"schedule {schedule.name!r}: the cron expression {schedule.expression!r} never matches "
            f"a time to come (a day its month does not have?): {exc}"
        ) from None


#: the @-names croniter reads as five fields (with no hash id, as here): a fixed time each
_MACROS = frozenset({"@midnight", "@hourly", "@daily", "@weekly", "@monthly", "@yearly", "@annually"})
#: croniter's random (R) and hashed (H) values, with their optional range and step: 'R', 'H(0-5)/2'
_DRAWN = re.compile(r"[HR](\(\d+-\d+\))?(/\d+)?", re.IGNORECASE)
_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")


def _check_deterministic(cron: str) -> None:
    """Every host must compute the same ticks from the expression. croniter draws a random value for an
    ``R`` field each time it reads the expression (each host, each round: the schedule would fire at
    random, many times an hour) and an ``H`` one from a hash id, which a schedule has none of; and it
    takes @-names beyond the five-field ones (``@reboot`` and the like) that are no timetable."""
    text = cron.strip()
    if text.startswith("@"):
        if text.lower() not in _MACROS:
            raise RegistrationError(
                f"{cron!r} is not a cron expression a schedule takes: of the @-names, only "
                f"{', '.join(sorted(_MACROS))}; otherwise five fields, e.g. '*/5 * * * *'"
            )
        return
    for field_name, value in zip(_FIELDS, text.split(), strict=False):
        if _DRAWN.fullmatch(value):
            raise RegistrationError(
                f"{cron!r}: the {field_name} field {value!r} is croniter's random (R) or hashed (H) "
                "value, which the hosts would not agree on (a random one changes at every round); "
                "write the values out, e.g. '17 * * * *' instead of 'R * * * *'"
            )


def _default_name(func: Callable[..., Any]) -> str:
    """``module.qualname`` of the function, made a valid name (``<locals>`` and the like become _)."""
    text = f"{getattr(func, '__module__', '_')}.{getattr(func, '__qualname__', '_')}"
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", text)[-200:]


def _takes_tick(func: Callable[..., Any]) -> bool:
    params = [
        p
        for p in inspect.signature(func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(params) > 1:
        raise RegistrationError(f"schedule function {func.__qualname__} must take () or (tick)")
    return len(params) == 1


class ScheduleBook:
    """The schedules of an app (a part of the registry: recording only, no I/O)."""

    def __init__(self) -> None:
        self._schedules: dict[str, Schedule] = {}

    def add_cron(
        self,
        func: ScheduleFunc,
        cron: str,
        *,
        timezone: str,
        name: str | None,
        catch_up: CatchUp,
        origin: str,
    ) -> Schedule:
        from croniter import croniter

        if isinstance(cron, str):
            _check_deterministic(cron)  # (first: croniter's own refusal of 'H' names no field)
        if not isinstance(cron, str) or not croniter.is_valid(cron):
            raise RegistrationError(f"{cron!r} is not a cron expression (five fields, e.g. '*/5 * * * *')")
        if not cron.strip().startswith("@") and len(cron.split()) != 5:
            # croniter reads a sixth field as seconds at the end (a seventh as years), where Azure
            # Functions' NCRONTAB puts seconds first: '0 0 9 * * *' (09:00 there) would fire every
            # second of the 9th of each month here
            raise RegistrationError(
                f"{cron!r} has {len(cron.split())} fields: a schedule's cron expression has five "
                "(minute hour day-of-month month day-of-week); an Azure Functions NCRONTAB expression "
                "(seconds first) drops its first field here, e.g. '0 0 9 * * *' is '0 9 * * *'"
            )
        _check_zone(timezone)
        schedule = Schedule(
            validate_name(name or _default_name(func)),
            func,
            cron=cron,
            timezone=timezone,
            catch_up=_policy(catch_up),
            origin=origin,
            _takes_tick=_takes_tick(func),
        )
        _check_matches(schedule)
        return self._add(schedule)

    def add_every(
        self,
        interval: timedelta,
        message: QueueMessage | ScheduleFunc,
        *,
        name: str | None,
        catch_up: CatchUp,
    ) -> Schedule:
        if not isinstance(interval, timedelta) or interval < timedelta(seconds=1) or interval.microseconds:
            raise RegistrationError(f"interval {interval!r}: a timedelta of whole seconds, at least 1 second")
        if isinstance(message, QueueMessage):
            fixed = message
            produce: ScheduleFunc = lambda: fixed  # noqa: E731 - the same message each tick (new id each time)
            default = f"{type(message).type_name()}.every.{int(interval.total_seconds())}s"
            takes = False
        elif callable(message):
            produce, takes = message, _takes_tick(message)
            default = _default_name(message)
        else:
            raise RegistrationError(f"every(): {message!r} is neither a QueueMessage nor a function")
        return self._add(
            Schedule(
                validate_name(name or default),
                produce,
                every=interval,
                catch_up=_policy(catch_up),
                _takes_tick=takes,
            )
        )

    def _add(self, schedule: Schedule) -> Schedule:
        known = self._schedules.get(schedule.name)
        if known is not None and not _same(known, schedule):
            # (the same function with another timetable is a clash too: two @app.schedule stacked on
            # one function both take its default name, and one would silently replace the other)
            raise RegistrationError(
                f"two schedules are named {schedule.name!r} ({_described(known)}; "
                f"{_described(schedule)}); give each its own name= (the name is what hosts agree on "
                "to run each tick once, and defaults to the function's module and name)"
            )
        if known is None:  # the very same schedule again (a router included twice) changes nothing
            self._schedules[schedule.name] = schedule
        return known or schedule

    def include(self, other: ScheduleBook) -> None:
        for s in other._schedules.values():
            self._add(s)

    def __iter__(self) -> Iterator[Schedule]:
        return iter(sorted(self._schedules.values(), key=lambda s: s.name))

    def __len__(self) -> int:
        return len(self._schedules)

    def get(self, name: str) -> Schedule | None:
        return self._schedules.get(name)


def _same(a: Schedule, b: Schedule) -> bool:
    """Whether two registrations are one schedule: the same function, timetable and policy."""
    timetable = (a.cron, a.every, a.timezone, a.catch_up)
    return a.produce is b.produce and timetable == (b.cron, b.every, b.timezone, b.catch_up)


def _described(s: Schedule) -> str:
    zone = f" in {s.timezone}" if s.cron is not None else ""
    where = f", {s.origin}" if s.origin else ""
    return f"{s.expression!r}{zone}, catch_up={s.catch_up!r}{where}"


def _policy(catch_up: str) -> CatchUp:
    if catch_up not in ("skip", "once"):
        raise RegistrationError(f"catch_up must be 'skip' or 'once', not {catch_up!r}")
    return "skip" if catch_up == "skip" else "once"


@runtime_checkable
class TickStore(Protocol):
    """Where hosts agree on ticks. ``fire`` claims one tick and has its envelopes sent, exactly once
    across hosts; it returns False when another host has it (or had it). A store whose
    ``writes_messages`` is true writes the envelopes itself, with the claim (the SQL transport), never
    calls ``send``, and calls ``announce`` after its commit (the scheduler gives ``announce`` to such a
    store alone)."""

    async def last_ticks(self, names: Sequence[str]) -> dict[str, datetime]:
        """The newest claimed tick of each schedule that has one."""
        ...

    async def fire(
        self,
        schedule: str,
        tick: datetime,
        envelopes: Sequence[Envelope],
        send: Send,
        now: datetime,
        identities: Sequence[str | None] = (),
        announce: Announce | None = None,
    ) -> bool:
        """``identities``: each envelope's identity (an idempotent type's; None for the others), for a
        store that writes the envelopes itself (``send`` has them already)."""
        ...

    async def unfinished(self, schedule: str, now: datetime) -> list[datetime]:
        """Ticks claimed by a host that died before confirming the send (their claim has lapsed)."""
        ...


@runtime_checkable
class ProvidesTickStore(Protocol):
    def schedule_store(self) -> TickStore: ...


class MemoryTickStore:
    """One process (tests, the in-process provider): a lock stands in for the shared claim."""

    def __init__(self) -> None:
        self.ticks: dict[str, set[datetime]] = {}
        self._lock = asyncio.Lock()

    async def last_ticks(self, names: Sequence[str]) -> dict[str, datetime]:
        return {n: max(self.ticks[n]) for n in names if self.ticks.get(n)}

    async def fire(
        self,
        schedule: str,
        tick: datetime,
        envelopes: Sequence[Envelope],
        send: Send,
        now: datetime,
        identities: Sequence[str | None] = (),
        announce: Announce | None = None,
    ) -> bool:
        async with self._lock:
            seen = self.ticks.setdefault(schedule, set())
            if tick in seen:
                return False
            await send(envelopes)  # claim after the send: a failed send leaves the tick to run again
            seen.add(tick)
            return True

    async def unfinished(self, schedule: str, now: datetime) -> list[datetime]:
        return []
