#!/usr/bin/env bash
# How long a new user waits: a fresh `git clone`, then `make serve`, until GET /health answers.
#
#   bench/first_serve.sh [--cold] [REPO]    (REPO defaults to this repository; --cold uses an empty
#                                            pip cache, so every package is downloaded)
# Prints the seconds from `make serve` to the first 200 from /health, and the size of .venv-serve.
set -euo pipefail

COLD=0
if [ "${1:-}" = "--cold" ]; then COLD=1; shift; fi
REPO="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
WORK=$(mktemp -d -t first-serve.XXXXXX)
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pid=""
cleanup() { [ -n "$pid" ] && kill -- -"$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

git clone -q "$REPO" "$WORK/clone"
cd "$WORK/clone"
if [ "$COLD" = 1 ]; then export PIP_CACHE_DIR="$WORK/pip-cache"; fi

load_before=$(cut -d' ' -f1 /proc/loadavg)
start=$(date +%s.%N)
# `make serve` is `make serve-env` (the install) then the server: timing the install on its own also
# gives its CPU seconds, which other work on a shared machine does not change
TIMEFORMAT='%R %U %S'
install=$( { time make serve-env >"$WORK/install.log" 2>&1; } 2>&1 ) || { cat "$WORK/install.log" >&2; exit 1; }
read -r _ install_user install_sys <<<"$install"
set -m  # its own process group, so the clean-up stops make and the server together
make serve PORT="$PORT" >"$WORK/serve.log" 2>&1 &
pid=$!
set +m
until curl -fs "http://127.0.0.1:$PORT/api/_system/queueing/health" >/dev/null; do
  kill -0 "$pid" 2>/dev/null || { cat "$WORK/serve.log" >&2; echo "make serve exited" >&2; exit 1; }
  sleep 0.2
done
end=$(date +%s.%N)
# the machine is shared: the 1-minute load average before and after says how busy it was
printf 'make serve answered /health after %.1f s (%s pip cache; load %s -> %s); install CPU %.1f s; .venv-serve: %s, %s packages\n' \
  "$(echo "$end - $start" | bc)" "$([ "$COLD" = 1 ] && echo "an empty" || echo "the warm")" \
  "$load_before" "$(cut -d' ' -f1 /proc/loadavg)" "$(echo "$install_user + $install_sys" | bc)" \
  "$(du -sh .venv-serve | cut -f1)" "$(.venv-serve/bin/python -m pip list --format=freeze 2>/dev/null | wc -l)"
