#!/usr/bin/env bash
# Where a cache hit's CPU goes, corral beside nginx: user space and kernel
# time per answer, from each server's own /proc/PID/stat, under one load.
# bench/run.sh gives the sum (CPU per answer); this splits it, so that a
# change to the hit can be judged against the part it can move: callgrind
# (bench/callgrind.sh) counts user-space instructions only, and a 64 KiB
# hit's time is mostly the kernel's.
#
#   bench/cpusplit.sh [SIZE] [SECONDS] [RUNS]   # default 65536 8 2
#   CPUSPLIT_PERF=1 bench/cpusplit.sh 65536     # and the kernel's top symbols
#   CPUSPLIT_CLIENT=capacity bench/cpusplit.sh 1024   # each server at capacity
#
# Each server has core 0 and one worker (corral TOKIO_WORKER_THREADS=1,
# nginx bench/nginx's config, one worker), the demo origin is on core 0 too
# (idle once the key is cached), and oha has core 1: 50 keep-alive
# connections on one cached key for SECONDS, the systems alternating, RUNS
# times. Prints req/s, user and kernel µs per answer (clock ticks of 10 ms,
# so read it from runs of several seconds) and the ratio of corral's total
# to nginx's. With CPUSPLIT_PERF=1 (perf, cpu-clock sampling of core 0 for
# 4 s in the middle of each load), the 12 kernel symbols that cost each
# server most, in ns per answer.
#
# With oha one answer costs the client about what it costs the server, so
# oha's core is full first: the servers idle between batches and are
# measured below capacity. CPUSPLIT_CLIENT=capacity loads them with
# target/release/capacity-load instead (CPUSPLIT_CONNS=64 connections,
# CPUSPLIT_DEPTH=1 request in flight on each, as oha), which costs the
# client a fraction of that, so the server's core runs full (the `busy`
# column: the server's CPU seconds per second of the load) and its req/s,
# CPU per answer and p50/p99 are those of a server that is the limit.
# Both figures are true; they answer different questions. A depth above 1
# pipelines; nginx's own cost per 64 KiB answer then rises (about 23 to 46 µs
# at depth 16), so compare the two servers at depth 1.
#
# Loopback only (ports 3980, 8280, 9280, 8281); needs oha, curl, taskset and
# nginx; build first with cargo build --release -p corral -p corral-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-65536}
secs=${2:-8}
runs=${3:-2}
export PATH="$PATH:/usr/sbin:/sbin"
capacity=
conns=${CPUSPLIT_CONNS:-64}
depth=${CPUSPLIT_DEPTH:-1}
case "${CPUSPLIT_CLIENT:-oha}" in
  oha) ;;
  capacity)
    capacity=1
    [ -x target/release/capacity-load ] || { echo "build first: cargo build --release -p corral-bench" >&2; exit 1; }
    ;;
  *) echo "CPUSPLIT_CLIENT is oha or capacity" >&2; exit 1 ;;
esac
for tool in oha curl taskset nginx; do
  command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done
if [ -n "${CPUSPLIT_PERF:-}" ]; then
  command -v perf >/dev/null || { echo "perf is needed" >&2; exit 1; }
  # perf samples 4 s inside each load.
  [ "$secs" -ge 6 ] || { echo "CPUSPLIT_PERF needs loads of 6 s or more" >&2; exit 1; }
fi
server=(taskset -c 0)
client=(taskset -c 1)
[ "$(nproc)" -ge 2 ] || client=()

work=$(mktemp -d /tmp/corral-cpusplit.XXXXXX)
pids=()
cleanup() {
  [ -z "${nginx_conf:-}" ] || nginx -p "$work/nginx/" -c "$nginx_conf" -s stop 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # Gone before the ports are asked for again (corral drains first).
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

ready() { # url: waits (at most 30 s) until it answers
  for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "no answer from $1" >&2
  return 1
}

TOKIO_WORKER_THREADS=1 "${server[@]}" target/release/demo-origin 127.0.0.1:3980 >"$work/origin.log" 2>&1 &
pids+=($!)
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8280
admin: 127.0.0.1:9280
cache: { memory: 256MiB, max_object_size: 8MiB }
routes:
  - name: bench
    match: { path_prefix: / }
    upstream: http://127.0.0.1:3980
YAML
CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 "${server[@]}" target/release/corral serve \
  --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
corral_pid=$!
pids+=("$corral_pid")
mkdir -p "$work/nginx/tmp" "$work/nginx/cache"
nginx_conf=$work/nginx/nginx.conf
user_line=""
[ "$(id -u)" -ne 0 ] || user_line="user root;" # the cache dir must be writable
sed -e "s|@USER_LINE@|$user_line|" -e "s|@DIR@|$work/nginx|g" -e "s|@PORT@|8281|" \
  -e "s|@ORIGIN@|127.0.0.1:3980|" bench/nginx/nginx.conf.tmpl >"$nginx_conf"
"${server[@]}" nginx -p "$work/nginx/" -c "$nginx_conf" -e "$work/nginx/error.log" \
  >"$work/nginx.log" 2>&1 &
pids+=($!)
ready http://127.0.0.1:9280/healthz
ready "http://127.0.0.1:8281/ready?max-age=0"
nginx_pid=$(cat "$work/nginx/nginx.pid")
# The worker serves; the master only waits.
nginx_worker=$(pgrep -P "$nginx_pid" -f "nginx: worker" | head -1)
tick=$(getconf CLK_TCK)

measure() { # system pid port run comm: prints the figures, sets $total (µs per answer)
  local target="/cpusplit?max-age=86400&size=$size" url u0 s0 u1 s1 rps load
  url="http://127.0.0.1:$3$target"
  curl -sf -o /dev/null "$url" # the miss
  curl -sf -o /dev/null "$url"
  read -r u0 s0 < <(awk '{ print $14, $15 }' "/proc/$2/stat")
  if [ -n "$capacity" ]; then
    "${client[@]}" timeout $((secs + 30)) target/release/capacity-load "127.0.0.1:$3" \
      "$target" "$conns" "$depth" "$secs" \
      >"$work/load-$1-$4.json" 2>"$work/load-$1-$4.err" &
  else
    "${client[@]}" timeout $((secs + 30)) oha --no-tui -z "${secs}s" -c 50 "$url" >"$work/oha-$1-$4.txt" 2>&1 &
  fi
  load=$!
  if [ -n "${CPUSPLIT_PERF:-}" ]; then
    sleep $(((secs - 4) / 2))
    perf record -q -e cpu-clock -C 0 -o "$work/perf-$1-$4.data" -- sleep 4 >/dev/null 2>&1
  fi
  # capacity-load exits 1 on a failed answer: said below, from its JSON.
  wait "$load" || [ -n "$capacity" ]
  read -r u1 s1 < <(awk '{ print $14, $15 }' "/proc/$2/stat")
  local n wall busy=""
  if [ -n "$capacity" ]; then
    # {"answers": N, "failed": F, "seconds": S, "rps": R, "p50_ms": A, "p99_ms": B}
    local failed p50 p99
    read -r n failed wall rps p50 p99 < <(tr -d '{},"' <"$work/load-$1-$4.json" |
      awk '{ print $2, $4, $6, $8, $10, $12 }')
    [ "${failed:-1}" = 0 ] || { echo "$1: ${failed:-?} failed answers: $(head -c 300 "$work/load-$1-$4.err")" >&2; exit 1; }
    busy=$(awk -v c=$((u1 - u0 + s1 - s0)) -v t="$tick" -v w="$wall" -v p50="$p50" -v p99="$p99" \
      'BEGIN { printf ", busy %3.0f%%, p50 %s p99 %s ms", c / t / w * 100, p50, p99 }')
  else
    rps=$(awk '/Requests\/sec/ { print $2 }' "$work/oha-$1-$4.txt")
    n=$(awk -v r="$rps" -v s="$secs" 'BEGIN { print r * s }')
  fi
  # The total first, for the ratio, then the line to print.
  read -r total line < <(awk -v name="$1" -v run="$4" -v rps="$rps" -v n="$n" -v busy="$busy" \
    -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v t="$tick" 'BEGIN {
    printf "%.2f %-6s run %d: %8.0f req/s, user %5.2f µs, kernel %5.2f µs, total %5.2f µs per answer%s\n",
      (u + s) / t * 1e6 / n, name, run, rps, u / t * 1e6 / n, s / t * 1e6 / n, (u + s) / t * 1e6 / n, busy
  }')
  echo "$line"
  if [ -n "${CPUSPLIT_PERF:-}" ]; then
    # Samples of core 0 over 4 s, each the share of the core: ns per answer.
    perf report -i "$work/perf-$1-$4.data" --stdio --no-children --comms "$5" --sort sym 2>/dev/null |
      awk -v rps="$rps" '$2 == "[k]" && n < 12 { sub("%", "", $1); printf "         %7.0f ns  %s\n", $1 / 100 * 4e9 / (rps * 4), $3; n++ }'
  fi
}

if [ -n "$capacity" ]; then
  load_desc="capacity-load, $conns connections, $depth in flight on each"
else
  load_desc="oha, 50 connections"
fi
echo "cpusplit: ${size}-byte hit, ${secs} s per load, $load_desc, $(nproc) cores; $(oha --version 2>/dev/null | head -1); $(nginx -v 2>&1)"
for run in $(seq "$runs"); do
  measure corral "$corral_pid" 8280 "$run" tokio-rt-worker
  corral_total=$total
  measure nginx "$nginx_worker" 8281 "$run" nginx
  awk -v c="$corral_total" -v x="$total" -v run="$run" \
    'BEGIN { printf "run %d: corral/nginx %.2f (CPU per answer)\n", run, c / x }'
done
