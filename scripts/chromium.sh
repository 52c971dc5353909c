#!/usr/bin/env bash
# The dashboard's browser tests drive Debian's chromium through Playwright (the Playwright registry's
# own browser download is not reachable everywhere); install it when it is missing.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is missing and apt-get is not here: install chromium to run the dashboard's browser tests" >&2
  exit 0
fi
sudo_=""
[ "$(id -u)" -eq 0 ] || sudo_="sudo"
# apt's progress runs to hundreds of lines: keep it in a log, shown only when the install fails
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "installing chromium from Debian (once) ..."
if ! { $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq chromium; } >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
