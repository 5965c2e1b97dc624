#!/usr/bin/env bash
# Instructions corral executes per cache hit, counted by callgrind: a number
# that does not move with the machine's load, for comparing two builds of
# the hit path (wall-clock benchmarks on 2 shared cores move by +-15%).
#
#   bench/callgrind.sh [SIZE] [N]     # default 1024-byte body, 5000 hits
#   SERVER_YAML='server: { runtime: per_core, workers: 1 }' bench/callgrind.sh 1024 20000
#
# Runs target/release/corral under valgrind twice in front of the demo
# origin (loopback, ports 3960/8260/9260), once serving 1000 hits and once
# 1000 + N, and prints (difference) / N: the per-hit user-space instruction
# count, start-up and shutdown cancelled out. Needs valgrind, curl and oha;
# build first: cargo build --release -p corral -p corral-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1024}
n=${2:-5000}
work=$(mktemp -d /tmp/corral-callgrind.XXXXXX)
origin_pid=
cleanup() { [ -z "$origin_pid" ] || kill "$origin_pid" 2>/dev/null || true; [ -n "${CALLGRIND_KEEP:-}" ] || rm -rf "$work"; }
trap cleanup EXIT
for tool in valgrind curl oha; do command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }; done
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8260
admin: 127.0.0.1:9260
${SERVER_YAML:-}
cache: { memory: 256MiB, max_object_size: 8MiB }
routes:
  - name: bench
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3960
YAML
TOKIO_WORKER_THREADS=1 target/release/demo-origin 127.0.0.1:3960 >"$work/origin.log" 2>&1 &
origin_pid=$!
count() { # hits -> total instructions of one corral run serving them
  local out=$work/cg-$1.out pid
  CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$out" \
    target/release/corral serve --config "$work/corral.yaml" >"$work/corral-$1.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf -o /dev/null http://127.0.0.1:9260/healthz && break; sleep 0.1; done
  local url="http://127.0.0.1:8260/callgrind?max-age=86400&size=$size"
  curl -sf -o /dev/null "$url" # the miss
  curl -sf -o /dev/null "$url"
  timeout 600 oha --no-tui -n "$1" -c 10 "$url" >/dev/null
  kill -INT "$pid"
  wait "$pid" || true
  sed -n 's/^summary: //p' "$out"
}
base=$(count 1000)
more=$(count $((1000 + n)))
echo "body $size B: $(((more - base) / n)) instructions per hit (callgrind, user space; $base for 1000 hits, $more for $((1000 + n)))"
