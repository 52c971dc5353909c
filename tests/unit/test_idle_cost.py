"""The idle cost stated in infra/README.md is what bench/idle_cost.py computes from the app's timers
and host.json, and that computation counts schedules right."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _idle_cost():
    spec = importlib.util.spec_from_file_location("idle_cost", ROOT / "bench" / "idle_cost.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["idle_cost"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("schedule", "runs"),
    [
        ("*/15 * * * * *", 240),
        ("*/30 * * * * *", 120),
        ("0 5 * * * *", 1),
        ("0 */5 * * * *", 12),
        ("0,30 * * * * *", 120),
        ("10-19 0 * * * *", 10),
    ],
)
def test_runs_per_hour_counts_ncrontab_schedules(schedule, runs):
    assert _idle_cost().runs_per_hour(schedule) == runs


def test_schedules_that_skip_hours_are_not_counted_as_hourly():
    with pytest.raises(ValueError, match="every hour"):
        _idle_cost().runs_per_hour("0 0 */2 * * *")


def test_sql_on_functions_never_idles_and_the_others_do():
    ic = _idle_cost()
    sql = ic.idle_cost("sql")
    assert sql.timers == {
        "queueing_sql_processor": 240,
        "queueing_lease_sweeper": 120,
        "queueing_retention": 1,
    }
    assert sql.always_running
    storage = ic.idle_cost("storage_queue")
    assert storage.timers == {"queueing_retention": 1}
    assert storage.queues == 3
    assert storage.poll_interval == 2.0
    assert not storage.always_running


def test_infra_readme_states_what_the_calculator_computes():
    text = (ROOT / "infra" / "README.md").read_text(encoding="utf-8")
    block = re.search(
        r"<!-- BEGIN IDLE COST \(bench/idle_cost.py --markdown\) -->\n(.*?)\n<!-- END IDLE COST -->",
        text,
        re.S,
    )
    assert block, "infra/README.md lost its idle-cost table"
    assert block.group(1) == _idle_cost().markdown()
