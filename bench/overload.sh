#!/usr/bin/env bash
# What corral does when offered more than it can serve (issue 27, finding
# 5), measured with server.overload at its default (90%) and off, side by
# side. corral runs on core 0, sharing it with a busy loop (so that it gets
# about half the core, and oha, alone on core 1, can offer twice what
# corral sustains: on a whole core corral serves about as many 1 KiB hits
# as one core of oha can send). Per policy:
#   1. the hit rate corral sustains there (closed loop, 50 connections, 10 s);
#   2. an open loop at twice that rate (oha -q, 400 kept-alive connections,
#      latency corrected for coordinated omission, 10 s), hits alone;
#   3. the same with one request in ten a miss on a new key;
#   3b. the same with one request in ten a pass (an answer without
#      Cache-Control, never stored: corral learns to pass the key);
#   4. 50 clients that each open a connection per request, closed loop: what
#      shedding costs at capacity.
# During 2, 3 and 3b two lone clients probe on connections of their own, 20
# requests a second each from the second second on: one asks for the hit,
# one for a new key every time (a miss). The loads' own latencies are
# mostly their queue: 400 connections with one request in flight each
# cannot carry twice the rate, so the rest waits in oha, outside corral;
# the probes show what a client that is not behind that queue gets.
# Prints per load the rate served, p50/p99/max latency of every answer,
# the share not 200 (shed), corral's busy share 5 s in, its RSS after it,
# and what it counted as shed (corral_overload_shed_total).
#
#   bench/overload.sh            # BENCH_NO_BUILD=1 uses target/release as is
#   OVERLOAD_POLICIES="90%" bench/overload.sh   # only the default
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
TOKIO_WORKER_THREADS=1 taskset -c 1 target/release/demo-origin 127.0.0.1:3961 >"$work/origin.log" 2>&1 &
pids+=($!)
# The busy loop that takes half of core 0 (same priority as corral).
taskset -c 0 bash -c 'while :; do :; done' &
pids+=($!)
hit='http://127.0.0.1:8262/hit?max-age=600&size=1024'

metric() { # name{labels} -> value (0 when absent)
  curl -fsS http://127.0.0.1:9262/metrics | awk -v m="$1" '$1 == m { print $2; found = 1 } END { if (!found) print 0 }'
}
report() { # label oha.json [busy]
  local shed_pass shed_conn
  shed_pass=$(metric 'corral_overload_shed_total{what="pass"}')
  shed_conn=$(metric 'corral_overload_shed_total{what="connection"}')
  jq -r --arg l "$1" --arg rss "$(rss)" --arg so "$shed_pass" --arg sc "$shed_conn" --arg busy "${3:--}" '
    def ms: . * 1000 | . * 10 | floor / 10;
    ([.statusCodeDistribution | to_entries[] | select(.key != "200") | .value] | add // 0) as $bad
    | ([.statusCodeDistribution | to_entries[] | .value] | add // 0) as $all
    | "  \($l)\tserved \(.summary.requestsPerSec | floor) req/s\tp50 \(.latencyPercentiles.p50 | ms) ms\tp99 \(.latencyPercentiles.p99 | ms) ms\tmax \(.summary.slowest | ms) ms\tnot 200: \($bad) of \($all)\terrors \(.errorDistribution | to_entries | map(.value) | add // 0)\tbusy \($busy)\tRSS \($rss) MiB\tshed so far: passes \($so), connections \($sc)"' "$2"
}
probe_report() { # label oha.json
  jq -r --arg l "$1" '
    def ms: . * 1000 | . * 10 | floor / 10;
    ([.statusCodeDistribution | to_entries[] | select(.key != "200") | .value] | add // 0) as $bad
    | ([.statusCodeDistribution | to_entries[] | .value] | add // 0) as $all
    | "    probe, \($l):\tp50 \(.latencyPercentiles.p50 | ms) ms\tp99 \(.latencyPercentiles.p99 | ms) ms\tmax \(.summary.slowest | ms) ms\tnot 200: \($bad) of \($all)"' "$2"
}
# A load with the two probes beside it and the busy share read 5 s in.
overload() { # label out.json oha-args...
  local label=$1 out=$2; shift 2
  (sleep 1; timeout -k 5 20 taskset -c 1 oha --no-tui --output-format json -z 8s -c 1 -q 20 "$hit" >"$work/probe-hit.json" 2>/dev/null || true) &
  local p1=$!
  (sleep 1; timeout -k 5 20 taskset -c 1 oha --no-tui --output-format json -z 8s -c 1 -q 20 --rand-regex-url 'http://127[.]0[.]0[.]1:8262/probe-[a-z]{16}[?]max-age=600&size=1024' >"$work/probe-miss.json" 2>/dev/null || true) &
  local p2=$!
  (sleep 5; metric corral_overload_busy_ratio >"$work/busy") &
  local p3=$!
  load "$out" "$@"
  wait "$p1" "$p2" "$p3" || true
  report "$label" "$out" "$(printf '%.2f' "$(cat "$work/busy")")"
  probe_report "a lone client's hit" "$work/probe-hit.json"
  probe_report "a lone client's miss" "$work/probe-miss.json"
}
load() { # out.json oha-args...
  local out=$1; shift
  timeout -k 5 40 taskset -c 1 oha --no-tui --output-format json --worker-threads 1 "$@" >"$out" 2>"$out.err" || true
}
rss() { awk '/^VmRSS/ {printf "%.1f", $2 / 1024}' "/proc/$corral/status"; }

# One in ten a miss on a new key (new per policy): nine hits, then a miss.
urls() { # tag
  for i in $(seq 0 1999); do
    for _ in 1 2 3 4 5 6 7 8 9; do echo "$hit"; done
    echo "http://127.0.0.1:8262/miss-$1-$i?max-age=600&size=1024"
  done >"$work/urls-$1.txt"
}

for policy in ${OVERLOAD_POLICIES:-90% off}; do
  tag=${policy%\%}
  cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8262
admin: 127.0.0.1:9262
server: { overload: "$policy" }
cache: { memory: 256MiB, max_object_size: 8MiB }
routes:
  - name: bench
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3961
YAML
  CORRAL_LOG=warn taskset -c 0 target/release/corral serve --config "$work/corral.yaml" >"$work/corral-$tag.log" 2>&1 &
  corral=$!
  for _ in $(seq 100); do curl -fsS http://127.0.0.1:9262/healthz >/dev/null 2>&1 && break; sleep 0.1; done
  curl -fsS "$hit" >/dev/null
  echo "server.overload: $policy"
  load "$work/closed.json" -z 10s -c 50 "$hit"
  report "hits, closed loop, 50 connections" "$work/closed.json"
  capacity=$(jq -r '.summary.requestsPerSec | floor' "$work/closed.json")
  rate=$((capacity * 2))
  overload "hits, open loop at ${rate}/s (2x)" "$work/open.json" -z 10s -c 400 -q "$rate" --latency-correction "$hit"
  urls "$tag"
  overload "10% misses, open loop at ${rate}/s (2x)" "$work/mixed.json" -z 10s -c 400 -q "$rate" --latency-correction --urls-from-file "$work/urls-$tag.txt"
  for _ in 1 2 3 4 5 6 7 8 9; do echo "$hit"; done >"$work/passes.txt"
  echo "http://127.0.0.1:8262/pass?size=1024" >>"$work/passes.txt"
  overload "10% passes, open loop at ${rate}/s (2x)" "$work/passes.json" -z 10s -c 400 -q "$rate" --latency-correction --urls-from-file "$work/passes.txt"
  load "$work/fresh.json" -z 10s -c 50 --disable-keepalive "$hit"
  report "a connection per request, closed loop, 50 clients" "$work/fresh.json"
  grep -c 'overloaded: the serving threads' "$work/corral-$tag.log" | sed 's/^/  times it began shedding: /'
  kill "$corral"; wait "$corral" 2>/dev/null || true
done
