#!/usr/bin/env bash
# server.runtime: shared against per_core on 1 KiB cache hits (issue 14).
# Two corral instances, one per mode, each pinned to SERVER_CORES with
# WORKERS threads; oha on CLIENT_CORES, 64 connections per oha process
# (CLIENTS processes), 10 s per run, the modes alternating, RUNS runs each.
# Prints req/s, p99 and corral's CPU time per answer (utime + stime from
# /proc, over the run). Loopback only; every load bounded (oha -z under
# timeout). Needs oha and taskset.
#
#   bench/runtime.sh [RUNS]                       # 2 cores: corral on 0, oha on 1, 1 worker
#   SERVER_CORES=0-7 CLIENT_CORES=8-15 WORKERS=8 CLIENTS=8 bench/runtime.sh 2   # a 16-core machine
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
server_cores=${SERVER_CORES:-0}
client_cores=${CLIENT_CORES:-1}
workers=${WORKERS:-1}
clients=${CLIENTS:-1}
cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
origin=127.0.0.1:3907
taskset -c "$client_cores" target/release/demo-origin $origin 2>"$work/origin.log" &
pids+=($!)
declare -A pid_of
start() { # mode port admin
  cat >"$work/$1.yaml" <<YAML
listen: 127.0.0.1:$2
admin: 127.0.0.1:$3
server: { runtime: $1, workers: $workers }
cache: { memory: 256MiB }
routes:
  - name: api
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
YAML
  CORRAL_LOG=warn taskset -c "$server_cores" target/release/corral serve --config "$work/$1.yaml" >"$work/$1.log" 2>&1 &
  pid_of[$1]=$!
  pids+=($!)
  local deadline=$((SECONDS + 20))
  until curl -sf "http://127.0.0.1:$3/healthz" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { echo "corral $1 did not start"; cat "$work/$1.log"; exit 1; }
    sleep 0.1
  done
  curl -sf -o /dev/null "http://127.0.0.1:$2/hit?size=1024&max-age=3600"
}
start shared 8141 9141
start per_core 8142 9142
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
run() { # mode port
  local before after i
  before=$(ticks "${pid_of[$1]}")
  for i in $(seq 1 "$clients"); do
    timeout -k 5 30 taskset -c "$client_cores" oha --no-tui --worker-threads 1 -c 64 -z 10s \
      --output-format json -o "$work/oha-$i.json" "http://127.0.0.1:$2/hit?size=1024&max-age=3600" >/dev/null 2>&1 &
  done
  wait $(jobs -p | grep -v -F -x -f <(printf '%s\n' "${pids[@]}")) 2>/dev/null || true
  after=$(ticks "${pid_of[$1]}")
  python3 - "$work" "$clients" "$((after - before))" "$hz" <<'PY'
import json, sys, statistics
work, clients, ticks, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rps, p99, n, bad = 0.0, [], 0, 0
for i in range(1, clients + 1):
    d = json.load(open(f"{work}/oha-{i}.json"))
    s = d["summary"]; rps += s["requestsPerSec"]; p99.append(d["latencyPercentiles"]["p99"] * 1000)
    codes = d.get("statusCodeDistribution", {})
    n += sum(codes.values()); bad += sum(v for k, v in codes.items() if k != "200")
cpu_us = ticks / hz * 1e6 / max(n, 1)
print(f"{rps:.0f} req/s  p99 {statistics.median(p99):.2f} ms (median of {clients})  cpu {cpu_us:.1f} us/answer  non-200 {bad}")
PY
}
for r in $(seq 1 "$runs"); do
  echo "run $r shared   (workers $workers on $server_cores): $(run shared 8141)"
  echo "run $r per_core (workers $workers on $server_cores): $(run per_core 8142)"
done
echo "origin requests: $(curl -s "http://$origin/__hits?path=/hit") (one per instance)"
