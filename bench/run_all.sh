#!/usr/bin/env bash
# The queue-throughput benchmarks, one after another (never together: they would measure each other).
# Each prints the machine's load average with every round; on a shared machine, read the ratios.
#   bench/run_all.sh            full sizes
#   bench/run_all.sh --quick    smoke sizes (a few minutes in all)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for script in sql_burndown sql_history sql_scaleout latency sqlite_burndown sqlite_history storage_queue; do
    echo
    echo "######## bench/$script.py $*"
    "$PY" "bench/$script.py" "$@"
done
