#!/usr/bin/env bash
# What corral does when offered more than it can serve (issue 27, finding
# 5), measured: corral on core 0, sharing it with a busy loop (so that it
# gets about half the core, and oha, alone on core 1, can offer twice what
# corral sustains: on a whole core corral serves about as many 1 KiB hits
# as one core of oha can send). First the hit rate corral sustains there
# (closed loop, 50 connections, 10 s);
# then an open loop at twice that rate (oha -q, 400 connections, latency
# corrected for coordinated omission, 10 s), for hits alone and for hits
# with one request in ten a miss on a new key. Prints per load the rate
# served, p50/p99/max latency, the share of answers that were not 200
# (shed), and corral's RSS after it.
#
#   bench/overload.sh            # BENCH_NO_BUILD=1 uses target/release as is
#
# Loopback only (ports 3961, 8262, 9262); every load bounded by -z and
# timeout. Needs oha, taskset, curl, jq.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BENCH_NO_BUILD:-}" ]; then
  cargo build --release --locked -p corral -p corral-bench >&2
fi
for tool in oha taskset curl jq; do command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }; done
work=$(mktemp -d /tmp/corral-overload.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8262
admin: 127.0.0.1:9262
cache: { memory: 256MiB, max_object_size: 8MiB }
routes:
  - name: bench
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3961
YAML
TOKIO_WORKER_THREADS=1 taskset -c 1 target/release/demo-origin 127.0.0.1:3961 >"$work/origin.log" 2>&1 &
pids+=($!)
CORRAL_LOG=warn taskset -c 0 target/release/corral serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
corral=$!
pids+=($corral)
for _ in $(seq 100); do curl -fsS http://127.0.0.1:9262/healthz >/dev/null 2>&1 && break; sleep 0.1; done
# The busy loop that takes half of core 0 (same priority as corral).
taskset -c 0 bash -c 'while :; do :; done' &
pids+=($!)
hit='http://127.0.0.1:8262/hit?max-age=600&size=1024'
curl -fsS "$hit" >/dev/null
rss() { awk '/^VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$corral/status"; }
report() { # label oha.json
  jq -r --arg l "$1" --arg rss "$(rss)" '
    ([.statusCodeDistribution | to_entries[] | select(.key != "200") | .value] | add // 0) as $bad
    | ([.statusCodeDistribution | to_entries[] | .value] | add // 0) as $all
    | "\($l)\tserved \(.summary.requestsPerSec | floor) req/s\tp50 \(.latencyPercentiles.p50 * 1000 | . * 100 | floor / 100) ms\tp99 \(.latencyPercentiles.p99 * 1000 | . * 100 | floor / 100) ms\tmax \(.summary.slowest * 1000 | floor) ms\tnot 200: \($bad) of \($all)\terrors \(.errorDistribution | to_entries | map(.value) | add // 0)\tRSS \($rss) MiB"' "$2"
}
load() { # out.json oha-args...
  local out=$1; shift
  timeout -k 5 40 taskset -c 1 oha --no-tui --output-format json --worker-threads 1 "$@" >"$out" 2>"$out.err" || true
}
load "$work/closed.json" -z 10s -c 50 "$hit"
report "hits, closed loop, 50 connections" "$work/closed.json"
capacity=$(jq -r '.summary.requestsPerSec | floor' "$work/closed.json")
rate=$((capacity * 2))
load "$work/open.json" -z 10s -c 400 -q "$rate" --latency-correction "$hit"
report "hits, open loop at ${rate}/s (2x)" "$work/open.json"
# One in ten a miss on a new key: the URL list repeats the hit nine times.
for i in $(seq 0 1999); do
  for _ in 1 2 3 4 5 6 7 8 9; do echo "$hit"; done
  echo "http://127.0.0.1:8262/miss-$i?max-age=600&size=1024"
done >"$work/urls.txt"
load "$work/mixed.json" -z 10s -c 400 -q "$rate" --latency-correction --urls-from-file "$work/urls.txt"
report "10% misses, open loop at ${rate}/s (2x)" "$work/mixed.json"
