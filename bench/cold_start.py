"""Cold start of the Functions app: `python -c "import function_app"` against `import azure.functions`.

    .venv/bin/python bench/cold_start.py [--runs 15]

Each import runs in a fresh interpreter, interleaved, for each transport configuration; the median
wall time of each is reported with the ratio. Target: ratio <= 3.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "storage_queue": {"QUEUEING_PROVIDER": "storage_queue", "QueueingStorage": "UseDevelopmentStorage=true"},
    "sql": {"QUEUEING_PROVIDER": "sql", "QUEUEING_DATABASE_URL": "postgresql://host/db"},
    "servicebus": {
        "QUEUEING_PROVIDER": "servicebus",
        "QueueingStorage": "UseDevelopmentStorage=true",
        "QueueingServiceBus__fullyQualifiedNamespace": "kit.servicebus.windows.net",
    },
}


def timed(code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True)
    return time.perf_counter() - start


def main(runs: int) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("QUEUEING_", "Queueing"))}
    print(f"{'configuration':<16}{'import function_app':>22}{'import azure.functions':>25}{'ratio':>8}")
    for name, extra in CONFIGS.items():
        env = {**base, **extra}
        app_times, sdk_times = [], []
        for _ in range(runs):  # interleaved: noise hits both alike
            app_times.append(timed("import function_app", env))
            sdk_times.append(timed("import azure.functions", env))
        a, s = statistics.median(app_times), statistics.median(sdk_times)
        print(f"{name:<16}{a * 1000:>19.0f} ms{s * 1000:>22.0f} ms{a / s:>8.2f}")
    print(f"(median of {runs} fresh interpreters each; target ratio <= 3)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=15)
    main(parser.parse_args().runs)
