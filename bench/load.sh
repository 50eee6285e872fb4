#!/usr/bin/env bash
# The service under load: vbs against fbs tables under the same
# memory limit, `vbs loadtest` twice per solver (a text run, then a --json run).
#
#   bash bench/load.sh [MODEL] [PORT]      (default mobilenet_v2 8765; loopback only)
#
# Each solver gets its own `vbs serve` (tables planned into a fresh directory store on its first
# start, profiles cached), 40 MB memory limit, b <= 12; 8 clients, 30 s, one sample per request.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-mobilenet_v2}"
port="${2:-8765}"
PY="${PYTHON:-python}"
store="$(mktemp -d /tmp/vbs-load-store.XXXXXX)"
trap 'kill "$server" 2>/dev/null || true; rm -rf "$store"' EXIT
for solver in vbs fbs; do
  "$PY" -m service.commands serve --model "$model" --batch-max 12 --memory-limit 40MB \
    --solver "$solver" --store "$store" --host 127.0.0.1 --port "$port" --log-level warning &
  server=$!
  for _ in $(seq 600); do  # up to 10 minutes: the first start profiles and plans
    curl -sf "http://127.0.0.1:$port/v2/health/ready" >/dev/null && break
    sleep 1
  done
  echo "== $solver"
  "$PY" -m service.commands loadtest --url "http://127.0.0.1:$port" --model "$model" \
    --clients 8 --duration 30 --samples 1
  "$PY" -m service.commands loadtest --url "http://127.0.0.1:$port" --model "$model" \
    --clients 8 --duration 30 --samples 1 --json
  curl -s "http://127.0.0.1:$port/metrics" | grep -E '^vbs_batch_(run_seconds|size)_(sum|count)'
  kill "$server"; wait "$server" 2>/dev/null || true
done
