#!/usr/bin/env bash
# What a rate limit costs: 1 KiB cache hits through a route with no limit
# and through one with a per-address limit that counts hits
# (count_hits: true, a rate no load reaches, so every request is checked
# and allowed), without Redis (the local counter) and with Redis (one
# script call per request). corral on core 0, oha on core 1, 64
# connections, 10 s per run, alternating, RUNS runs each (default 3).
# Loopback only; every load bounded (oha -z under timeout). Needs oha and
# redis-server.
#
#   bench/limits.sh [RUNS]
set -euo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
runs=${1:-3}
cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
cores=$(nproc)
on_server=() on_client=()
if [ "$cores" -ge 2 ]; then on_server=(taskset -c 0) on_client=(taskset -c 1); fi

redis_port=6393 origin=127.0.0.1:3903
"${on_client[@]}" redis-server --port $redis_port --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
"${on_client[@]}" target/release/demo-origin $origin 2>"$work/origin.log" &
pids+=($!)
start() { # name port admin redis-section
  cat >"$work/$1.yaml" <<YAML
listen: 127.0.0.1:$2
admin: 127.0.0.1:$3
cache: { memory: 256MiB }
$4
routes:
  - name: free
    match: { path_prefix: /free }
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
  - name: limited
    match: { path_prefix: /limited }
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
    limits: [{ name: per-ip, key: ip, rate: 1000000/s, count_hits: true }]
YAML
  CORRAL_LOG=warn "${on_server[@]}" target/release/corral serve --config "$work/$1.yaml" >"$work/$1.log" 2>&1 &
  pids+=($!)
  local deadline=$((SECONDS + 20))
  until curl -sf "http://127.0.0.1:$3/readyz" 2>/dev/null | grep -q "$5"; do
    [ $SECONDS -lt $deadline ] || { echo "corral $1 did not start"; cat "$work/$1.log"; exit 1; }
    sleep 0.1
  done
}
until redis-cli -p $redis_port ping >/dev/null 2>&1; do sleep 0.1; done
start local 8131 9131 "" ready
start shared 8132 9132 "redis: { url: \"redis://127.0.0.1:$redis_port/0\" }" '"redis":"connected"'

rps() { # url -> requests per second and p99 ms
  local out=$work/oha.json
  timeout -k 5 30 "${on_client[@]}" oha --no-tui --worker-threads 1 -c 64 -z 10s \
    --output-format json -o "$out" "$1" >/dev/null 2>&1 || true
  python3 -c "
import json,sys
d=json.load(open('$out'))
s=d['summary']; p=d['latencyPercentiles']
codes=d.get('statusCodeDistribution',{})
print(f\"{s['requestsPerSec']:.0f} req/s  p99 {p['p99']*1000:.2f} ms  statuses {codes}\")"
}
for port in 8131 8132; do
  for path in free limited; do curl -sf -o /dev/null "http://127.0.0.1:$port/$path/x?size=1024&max-age=3600"; done
done
for run in $(seq 1 "$runs"); do
  for mode in "local 8131" "shared 8132"; do
    set -- $mode
    for path in free limited; do
      echo "run $run  $1  $path: $(rps "http://127.0.0.1:$2/$path/x?size=1024&max-age=3600")"
    done
  done
done
echo "origin requests: $(curl -s "http://$origin/__hits?path=/free/x") /free, $(curl -s "http://$origin/__hits?path=/limited/x") /limited"
echo "redis commands: $(redis-cli -p $redis_port info commandstats | grep -E 'evalsha|eval' | tr '\r\n' '  ')"
