"""Queue parameters for the Bicep in ``infra/``, generated from an app's registry.

The names go through the same sanitizer the Functions triggers use, so the queues the Bicep creates
are the queues the triggers bind: code and infrastructure cannot drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from .app import QueueingApp
from .errors import ConfigurationError
from .naming import InvalidQueueName, QueueNaming, Transport, validate
from .options import QueueOptions

BEGIN = "// BEGIN GENERATED QUEUES (queueing infra params)"
END = "// END GENERATED QUEUES"
MAX_LOCK = timedelta(minutes=5)
#: the largest max delivery count a Service Bus queue takes
MAX_DELIVERY_COUNT = 2000


def delivery_limit(max_attempts: int) -> int:
    """A Service Bus queue's max delivery count: one more than the attempts. A message whose runs
    never settled (the process died, a timeout, a lost lock) then reaches the kit once more, which
    dead-letters it with its reason and records it; at ``max_attempts`` the broker moved it itself
    (``MaxDeliveryCountExceeded``), its history left Pending."""
    return min(max_attempts + 1, MAX_DELIVERY_COUNT)


#: Service Bus's "never expires" (TimeSpan.MaxValue), what a queue gets when the type never expires
NEVER = "P10675199DT2H48M5.4775807S"


def queue_time_to_live(options: QueueOptions, ttl_grace: timedelta) -> timedelta | None:
    """A type's Service Bus queue's default message time to live (None: never), as the Bicep and the
    runtime create the queue: the type's expiration plus the grace, in which the kit finds an expired
    message and dead-letters it with its reason before the broker would. Service Bus also caps every
    message's own time to live at it, so no message on that queue may be given a longer one."""
    return None if options.expiration is None else options.expiration + ttl_grace


def iso_duration(value: timedelta) -> str:
    """ISO 8601, as ARM accepts it: P1DT2H3M4.5S (zero parts left out)."""
    total = value.total_seconds()
    if total <= 0:
        raise ValueError("a duration must be positive")
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    out = "P" + (f"{int(days)}D" if days else "")
    time = (f"{int(hours)}H" if hours else "") + (f"{int(minutes)}M" if minutes else "")
    if seconds:
        time += f"{seconds:g}S" if seconds % 1 else f"{int(seconds)}S"
    return out + ("T" + time if time else "")


@dataclass(frozen=True)
class ServiceBusQueue:
    name: str
    max_delivery_count: int
    lock_duration: str
    default_ttl: str
    duplicate_detection: bool


#: the queue each transport keeps beside a queue under a name of its own: its dead letters (or the
#: Functions host's poison messages). A queue named like another's companion would read, and run
#: again, that queue's dead letters, and hide them from every retry and purge of it
COMPANIONS: dict[Transport, str] = {
    Transport.STORAGE_QUEUE: "-poison",
    Transport.SQS: "-dlq",
    Transport.RABBITMQ: ".dead-letter",
}


def check_names(
    app: QueueingApp,
    transports: tuple[Transport, ...] = (Transport.SERVICE_BUS, Transport.STORAGE_QUEUE),
    naming: QueueNaming | None = None,
    *,
    deployed: bool = True,
) -> None:
    """Raise :class:`ConfigurationError` naming the queue whose name on one of ``transports`` the
    service would refuse (its dead-letter or poison companion included), that the Bicep cannot
    create (a Service Bus name holding '/'), or that two queues share (a companion's included).
    ``naming``: the provider's own prefix and suffix, when it has them (the app's by default).
    ``deployed=False`` (a runtime opening its queues itself) leaves out the Bicep's own rule."""
    seen: dict[tuple[Transport, str], tuple[str, str]] = {}  # name -> (its queue, what it is)
    for sub in app.subscriptions():
        for transport in transports:
            name = sub.physical_queue(naming or app.naming, transport)
            companion = COMPANIONS.get(transport)
            names = [name] if companion is None else [name, f"{name}{companion}"]
            kept = "poison" if transport is Transport.STORAGE_QUEUE else "dead-letter"
            for each, role in zip(names, ("", f" (its {kept} queue)"), strict=False):
                try:
                    validate(each, transport)
                except InvalidQueueName as exc:
                    raise ConfigurationError(f"queue {sub.queue!r}", exc.rule, transport.value) from None
                if deployed and transport is Transport.SERVICE_BUS and "/" in each:
                    # Service Bus takes it, but the Bicep declares the queue as the namespace's child
                    # resource, and ARM reads '/' in a resource name as a separator: the deployment
                    # would fail on a name of one segment too many
                    raise ConfigurationError(
                        f"queue {sub.queue!r}",
                        f"{each!r} on {transport.value} holds '/': Azure Resource Manager reserves '/' in "
                        "resource names (a Service Bus queue's is '<namespace>/<queue>'), so the Bicep "
                        "cannot create that queue",
                        "a name without '/', queue prefix and suffix included",
                    )
                key = (transport, each.lower() if transport is Transport.SERVICE_BUS else each)
                if key in seen and seen[key][0] != sub.queue:
                    raise ConfigurationError(
                        f"queue {sub.queue!r}",
                        f"{each!r}{role} is also the name of queue {seen[key][0]!r}{seen[key][1]} on "
                        f"{transport.value}",
                        "queue names that stay apart on the transport, its dead-letter queues' included",
                    )
                seen[key] = (sub.queue, role)


def queues_for(
    app: QueueingApp, ttl_grace: timedelta = timedelta(hours=1)
) -> tuple[list[ServiceBusQueue], list[str]]:
    """The Service Bus queues (with their settings) and Storage queue names of ``app``; raises
    :class:`ConfigurationError` naming the rule a name or setting would break."""
    check_names(app)
    sb: list[ServiceBusQueue] = []
    storage: list[str] = []
    for sub in app.subscriptions():
        o = sub.options
        sb_name = sub.physical_queue(app.naming, Transport.SERVICE_BUS)
        st_name = sub.physical_queue(app.naming, Transport.STORAGE_QUEUE)
        if not 1 <= o.max_attempts < MAX_DELIVERY_COUNT:
            raise ConfigurationError(
                f"queue {sub.queue!r}",
                f"max_attempts {o.max_attempts}: Service Bus allows a max delivery count of 1-2000, and "
                "the kit keeps one delivery beyond the attempts (its own dead letter for a message whose "
                f"runs all died): at most {MAX_DELIVERY_COUNT - 1}",
            )
        ttl = queue_time_to_live(o, ttl_grace)
        sb.append(
            ServiceBusQueue(
                name=sb_name,
                max_delivery_count=delivery_limit(o.max_attempts),
                lock_duration=iso_duration(min(o.lease_duration, MAX_LOCK)),
                default_ttl=NEVER if ttl is None else iso_duration(ttl),
                duplicate_detection=o.idempotent,
            )
        )
        storage.append(st_name)
    return sb, storage


def _bicep_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(app: QueueingApp, ttl_grace: timedelta = timedelta(hours=1)) -> str:
    """The generated block, markers included."""
    sb, storage = queues_for(app, ttl_grace)
    lines = [BEGIN, "param serviceBusQueues = ["]
    for q in sb:
        lines += [
            "  {",
            f"    name: '{q.name}'",
            f"    maxDeliveryCount: {q.max_delivery_count}",
            f"    lockDuration: '{q.lock_duration}'",
            f"    defaultMessageTimeToLive: '{q.default_ttl}'",
            f"    requiresDuplicateDetection: {'true' if q.duplicate_detection else 'false'}",
            "  }",
        ]
    lines += ["]", "param storageQueues = ["]
    lines += [f"  '{name}'" for name in storage]
    # the prefix and suffix the names above were composed with: the app composes its triggers' queue
    # names with the same two, so they come from here, never passed apart from the lists
    naming = app.naming
    lines += ["]", f"param queuePrefix = {_bicep_string(naming.prefix)}"]
    lines += [f"param queueSuffix = {_bicep_string(naming.suffix)}", END]
    return "\n".join(lines) + "\n"


_BLOCK = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END) + r"\n?", re.S)


def update(path: Path, block: str) -> bool:
    """Replace the generated block in ``path``; returns whether the file changed."""
    text = path.read_text(encoding="utf-8")
    if len(_BLOCK.findall(text)) != 1:
        raise ConfigurationError(str(path), f"needs exactly one '{BEGIN}' ... '{END}' block")
    new = _BLOCK.sub(lambda _: block, text)
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


def current(path: Path) -> str:
    match = _BLOCK.search(path.read_text(encoding="utf-8"))
    return match.group(0) if match else ""
