#!/usr/bin/env bash
# Run the example app on Azure Storage Queues locally: Azurite (from npm), a worker with the ops API,
# and a batch of example orders. Ctrl-C stops everything. `--once` exits after the batch is processed.
# It stops with an error, before starting anything, when one of its ports is taken.
#
#   scripts/local-storage.sh [--once] [--orders N] [--port PORT]   (the ops API's port, default 8080)
set -euo pipefail
cd "$(dirname "$0")/.."

ONCE=0; ORDERS=20; PORT=${PORT:-8080}
while [ $# -gt 0 ]; do
  case "$1" in
    --once) ONCE=1 ;;
    --orders) ORDERS="$2"; shift ;;
    --port) PORT="$2"; shift ;;
    *) echo "usage: $0 [--once] [--orders N] [--port PORT]" >&2; exit 2 ;;
  esac
  shift
done

BIN=.venv/bin
[ -x "$BIN/queueing" ] || make install
[ -x node_modules/.bin/azurite ] || npm ci --no-audit --no-fund

BLOB=${AZURITE_BLOB_PORT:-10000}; QUEUE=${AZURITE_QUEUE_PORT:-10001}; TABLE=${AZURITE_TABLE_PORT:-10002}
API="http://127.0.0.1:$PORT/api/_system/queueing"
taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for pair in "ops API:$PORT" "Azurite blob:$BLOB" "Azurite queue:$QUEUE" "Azurite table:$TABLE"; do
  if taken "${pair##*:}"; then
    echo "error: port ${pair##*:} (${pair%:*}) is already in use on 127.0.0.1; stop what listens there" \
      "or choose another port (make local-storage PORT=...; AZURITE_*_PORT for Azurite)" >&2
    exit 1
  fi
done
DATA=$(mktemp -d -t azurite.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DATA"; }
trap cleanup EXIT INT TERM

node_modules/.bin/azurite --silent --location "$DATA" --loose --skipApiVersionCheck --disableTelemetry \
  --blobHost 127.0.0.1 --queueHost 127.0.0.1 --tableHost 127.0.0.1 \
  --blobPort "$BLOB" --queuePort "$QUEUE" --tablePort "$TABLE" &
pids+=($!)
for _ in $(seq 1 50); do (exec 3<>"/dev/tcp/127.0.0.1/$QUEUE") 2>/dev/null && break; sleep 0.2; done

KEY="Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="  # Azurite's public dev key
export QueueingStorage="DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=$KEY;BlobEndpoint=http://127.0.0.1:$BLOB/devstoreaccount1;QueueEndpoint=http://127.0.0.1:$QUEUE/devstoreaccount1;TableEndpoint=http://127.0.0.1:$TABLE/devstoreaccount1;"
export QUEUEING_PROVIDER=storage_queue
export QUEUEING_POLL_MAX=${QUEUEING_POLL_MAX:-1}
export EXAMPLE_INVOICE_SECONDS=${EXAMPLE_INVOICE_SECONDS:-0.05}

"$BIN/queueing" serve --port "$PORT" &
serve_pid=$!
pids+=("$serve_pid")
# wait for this instance's own API; if it exits first (it could not start), stop here
answered=0
for _ in $(seq 1 150); do
  kill -0 "$serve_pid" 2>/dev/null || { echo "error: queueing serve exited before its API answered" >&2; exit 1; }
  if "$BIN/python" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
    "$API/health" 2>/dev/null; then answered=1; break; fi
  sleep 0.2
done
[ "$answered" = 1 ] || { echo "error: the ops API did not answer on $API within 30 s" >&2; exit 1; }
"$BIN/queueing" enqueue OrderPlaced --example --count "$ORDERS"
echo "enqueued $ORDERS example orders; ops API on $API (Storage Queues on Azurite)"

if [ "$ONCE" = 1 ]; then
  # each order makes three messages (confirmation, invoice, payment): wait until all have finished
  for _ in $(seq 1 120); do
    done_count=$("$BIN/queueing" stats --json | "$BIN/python" -c 'import json,sys; d=json.load(sys.stdin); print(sum(n for q in d.values() for s, n in q.items() if s in ("Succeeded", "DeadLettered")))')
    [ "$done_count" -ge $((ORDERS * 3)) ] && break
    sleep 1
  done
  "$BIN/queueing" stats
  [ "$done_count" -ge $((ORDERS * 3)) ] || { echo "only $done_count of $((ORDERS * 3)) messages finished" >&2; exit 1; }
  echo "all $((ORDERS * 3)) messages finished on Storage Queues"
else
  echo "Ctrl-C to stop"
  wait
fi
