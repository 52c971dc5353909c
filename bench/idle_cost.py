"""What each transport costs on Flex Consumption while no message arrives, computed from what the app
registers (its timer schedules, read from the functions the Functions adapter builds) and host.json's
polling settings. Nothing here is measured on Azure: these are the figures that follow from the
configuration, under the assumptions stated in the output.

    .venv/bin/python bench/idle_cost.py            # the example app, default settings
    .venv/bin/python bench/idle_cost.py --markdown # the table infra/README.md shows

The README's table is checked against this output by tests/unit/test_idle_cost.py.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: the schedule monitor (use_monitor=True) reads and writes its status blob on every timer execution
MONITOR_BLOB_OPERATIONS = 2
FIELDS = ((0, 59), (0, 59), (0, 23), (1, 31), (1, 12), (0, 6))  # NCRONTAB: sec min hour day month dow


def _matches(field: str, value: int, low: int, high: int) -> bool:
    for part in field.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/")
            step = int(step_text)
        if part == "*":
            lo, hi = low, high
        elif "-" in part:
            lo, hi = (int(x) for x in part.split("-"))
        else:
            lo = hi = int(part)
            if step != 1:
                hi = high
        if lo <= value <= hi and (value - lo) % step == 0:
            return True
    return False


def runs_per_hour(schedule: str) -> int:
    """Occurrences of a six-field NCRONTAB schedule in one hour (one that every hour runs alike)."""
    sec, minute, hour, *_ = schedule.split()
    if hour != "*":
        raise ValueError(f"{schedule!r}: only schedules that repeat every hour are counted here")
    return sum(
        1
        for m in range(60)
        for s in range(60)
        if _matches(sec, s, *FIELDS[0]) and _matches(minute, m, *FIELDS[1])
    )


def _seconds(timespan: str) -> float:
    h, m, s = (float(x) for x in timespan.split(":"))
    return h * 3600 + m * 60 + s


@dataclass(frozen=True)
class IdleCost:
    transport: str
    timers: dict[str, int]  # function -> executions per hour
    queues: int  # queues the host's triggers poll (Storage Queues)
    poll_interval: float | None  # seconds between polls of an idle queue, while an instance runs

    @property
    def executions(self) -> int:
        return sum(self.timers.values())

    @property
    def timer_storage_operations(self) -> int:
        return self.executions * MONITOR_BLOB_OPERATIONS

    @property
    def polls_per_running_hour(self) -> int:
        return 0 if not self.poll_interval else int(self.queues * 3600 / self.poll_interval)

    @property
    def always_running(self) -> bool:
        # a timer at least once a minute: Flex never gets to scale the app to zero
        return any(n >= 60 for n in self.timers.values())


def _functions(provider: str) -> list[Any]:
    from functions import build_app
    from queueing_core.settings import QueueingSettings

    env = {
        "QueueingStorage__queueServiceUri": "https://a.queue.core.windows.net",
        "QueueingStorage__tableServiceUri": "https://a.table.core.windows.net",
        "QueueingServiceBus__fullyQualifiedNamespace": "n.servicebus.windows.net",
    }
    extra = (
        {"database_url": "postgresql://app@h.postgres.database.azure.com/queueing"}
        if provider == "sql"
        else {}
    )
    return list(build_app(QueueingSettings(provider=provider, **extra), env=env).get_functions())


def idle_cost(provider: str) -> IdleCost:
    host = json.loads((ROOT / "host.json").read_text(encoding="utf-8"))
    timers: dict[str, int] = {}
    queues = 0
    for fn in _functions(provider):
        [trigger, *_] = json.loads(fn.get_function_json())["bindings"]
        if trigger["type"] == "timerTrigger":
            timers[fn.get_function_name()] = runs_per_hour(trigger["schedule"])
        elif trigger["type"] == "queueTrigger":
            queues += 1
    poll = host.get("extensions", {}).get("queues", {}).get("maxPollingInterval")
    return IdleCost(provider, timers, queues, _seconds(poll) if queues and poll else None)


ASSUMPTIONS = (
    "Computed from the registered timers (NCRONTAB) and host.json, for the example app (three queues). "
    f"Storage operations count the schedule monitor's {MONITOR_BLOB_OPERATIONS} status-blob operations per "
    "timer execution; not counted: the timer's singleton lock renewals and the scale controller's own "
    "checks, whose rates Azure does not document. Queue polls happen only while an instance runs."
)


def markdown() -> str:
    rows = [
        "| transport | timer executions per idle hour | storage operations per idle hour (timers) "
        "| queue polls per hour an instance runs | scales to zero when idle |",
        "| --- | --- | --- | --- | --- |",
    ]
    for provider in ("servicebus", "storage_queue", "sql"):
        c = idle_cost(provider)
        detail = ", ".join(f"{name} {n}" for name, n in sorted(c.timers.items()))
        rows.append(
            f"| `{provider}` | {c.executions} ({detail}) | {c.timer_storage_operations} "
            f"| {c.polls_per_running_hour or '-'} | {'no' if c.always_running else 'yes'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table infra/README.md shows")
    args = parser.parse_args()
    if args.markdown:
        print(markdown())
        return
    for provider in ("servicebus", "storage_queue", "sql"):
        c = idle_cost(provider)
        print(
            f"{provider}: {c.executions} timer executions/h {c.timers}; {c.timer_storage_operations} storage "
            f"operations/h for them; {c.polls_per_running_hour} queue polls per running hour; "
            f"{'never scales to zero' if c.always_running else 'scales to zero'}"
        )
    print(re.sub(r"\s+", " ", ASSUMPTIONS))


if __name__ == "__main__":
    main()
