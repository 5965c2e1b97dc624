#!/usr/bin/env bash
# Instructions per cache hit, counted by callgrind, for corral and for nginx's
# proxy_cache in the same run: a number that does not move with the
# machine's load, for comparing two builds of the hit path and the two
# servers (wall-clock benchmarks on 2 shared cores move by +-15%).
#
#   bench/callgrind.sh [SIZE] [N]     # default 1024-byte body, 5000 hits
#   SERVER_YAML='server: { runtime: per_core, workers: 1 }' bench/callgrind.sh 1024 20000
#   CALLGRIND_SYSTEMS=corral bench/callgrind.sh 1024 20000   # corral alone
#
# Runs each server under valgrind twice in front of the demo origin
# (loopback, ports 3960 for the origin, 8260/9260 for corral, 8261 for
# nginx), once serving 1000 hits and once 1000 + N, and prints
# (difference) / N: the per-hit user-space instruction count, start-up and
# shutdown cancelled out. corral runs with one worker thread; nginx with
# bench/nginx/nginx.conf.tmpl (the config bench/run.sh uses: one worker, no
# access log, sendfile) as a single process (master_process off), so that
# callgrind counts the process that serves. Needs valgrind, curl, oha and
# (for its column) nginx; build first:
# cargo build --release -p corral -p corral-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1024}
n=${2:-5000}
systems=${CALLGRIND_SYSTEMS:-corral nginx}
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

# hits url -> after the miss and one more request, `hits` hits at 10 keep-alive connections
load() {
  curl -sf -o /dev/null "$2" # the miss
  curl -sf -o /dev/null "$2"
  timeout 600 oha --no-tui -n "$1" -c 10 "$2" >/dev/null
}

ready() { # url: waits (at most 30 s) until it answers
  for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "no answer from $1" >&2
  return 1
}

count_corral() { # hits -> total instructions of one corral run serving them
  local out=$work/cg-$1.out pid
  CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$out" \
    target/release/corral serve --config "$work/corral.yaml" >"$work/corral-$1.log" 2>&1 &
  pid=$!
  ready http://127.0.0.1:9260/healthz
  load "$1" "http://127.0.0.1:8260/callgrind?max-age=86400&size=$size"
  kill -INT "$pid"
  wait "$pid" || true
  # moka's clock (quanta) calibrates itself at start-up for a stretch of
  # time, not of work: under valgrind 12.5-13.0 M instructions, 39% of the
  # 1,000-hit run, whose spread moved the per-hit figure. Its inclusive
  # cost is taken out (CALLGRIND_ALL=1 leaves it in).
  local total calibrate=0
  total=$(sed -n 's/^summary: //p' "$out")
  if [ -z "${CALLGRIND_ALL:-}" ]; then
    calibrate=$(callgrind_annotate --inclusive=yes --threshold=100 "$out" 2>/dev/null |
      awk '/quanta::Calibration::calibrate/ { gsub(",", "", $1); if ($1 + 0 > m) m = $1 + 0 } END { print m + 0 }')
  fi
  echo $((total - calibrate))
}

count_nginx() { # hits -> total instructions of one nginx run serving them
  local dir=$work/nginx-$1 out=$work/cgn-$1.out pid user_line=""
  mkdir -p "$dir/tmp" "$dir/cache"
  [ "$(id -u)" -ne 0 ] || user_line="user root;" # the cache dir must be writable
  sed -e "s|@USER_LINE@|$user_line|" -e "s|@DIR@|$dir|g" -e "s|@PORT@|8261|" \
    -e "s|@ORIGIN@|127.0.0.1:3960|" -e "s|^master_process on;|master_process off;|" \
    bench/nginx/nginx.conf.tmpl >"$dir/nginx.conf"
  valgrind --tool=callgrind --callgrind-out-file="$out" \
    nginx -p "$dir/" -c "$dir/nginx.conf" -e "$dir/error.log" >"$work/nginx-$1.log" 2>&1 &
  pid=$!
  ready "http://127.0.0.1:8261/ready?max-age=0"
  load "$1" "http://127.0.0.1:8261/callgrind?max-age=86400&size=$size"
  kill -QUIT "$pid" # a graceful exit, so callgrind writes its counts
  wait "$pid" || true
  sed -n 's/^summary: //p' "$out"
}

declare -A per_hit
line="body $size B:"
for s in $systems; do
  if [ "$s" = nginx ] && ! command -v nginx >/dev/null; then
    line="$line nginx skipped (not installed);"
    continue
  fi
  base=$("count_$s" 1000)
  more=$("count_$s" $((1000 + n)))
  per_hit[$s]=$(((more - base) / n))
  line="$line $s ${per_hit[$s]} instructions per hit ($base for 1000 hits, $more for $((1000 + n)));"
done
if [ -n "${per_hit[corral]:-}" ] && [ -n "${per_hit[nginx]:-}" ]; then
  line="$line corral/nginx $(awk -v c="${per_hit[corral]}" -v x="${per_hit[nginx]}" 'BEGIN { printf "%.2f", c / x }')"
fi
echo "$line (callgrind, user space)"
