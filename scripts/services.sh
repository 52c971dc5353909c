#!/usr/bin/env bash
# Start the local services the test suite talks to (PostgreSQL and RabbitMQ), if they are not
# answering already. Azurite and moto's SQS server are started by the tests themselves.
set -uo pipefail

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # name port seconds
  for _ in $(seq 1 "$3"); do up "$2" && { echo "$1 is up on $2"; return 0; }; sleep 1; done
  echo "$1 did not come up on port $2" >&2; return 1
}

if ! up 5432; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! up 5672; then
  echo "starting RabbitMQ"
  if timeout 20 rabbitmqctl ping >/dev/null 2>&1; then
    timeout 120 rabbitmqctl start_app || true  # the node runs but its app was stopped (a killed test)
  else
    rabbitmq-server -detached || true
  fi
fi
# the browser the dashboard's tests drive
"$(dirname "$0")/chromium.sh" || echo "could not install chromium: the dashboard's browser tests will say so" >&2
wait_for PostgreSQL 5432 60 && wait_for RabbitMQ 5672 90
