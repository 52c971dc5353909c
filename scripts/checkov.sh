#!/usr/bin/env bash
# Static checks of the Bicep in infra/ with checkov, offline.
#
# checkov pins its own (old) pycep-parser and boto3, which clash with the project's dev
# dependencies, so it lives in a separate virtual environment, .checkov-venv (git-ignored).
# Usage: scripts/checkov.sh [DIR]   (DIR defaults to infra; extra checks come from DIR/checks)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHECKOV_VENV:-$root/.checkov-venv}"
target="${1:-$root/infra}"

if [ ! -x "$venv/bin/checkov" ]; then
  echo "creating $venv and installing checkov (one-off, a few minutes)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -qq --upgrade pip
  "$venv/bin/pip" install -qq checkov
fi

set +e
"$venv/bin/checkov" -d "$target" --framework bicep --skip-download --quiet --compact \
  --external-checks-dir "$target/checks"
code=$?
set -e
exit "$code"
