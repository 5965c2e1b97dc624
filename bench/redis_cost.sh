#!/usr/bin/env bash
# What Redis does per origin fill and per hit, as a function of the number
# of corral instances (issue 16's scaling note): N instances share one
# Redis; every instance sends C concurrent GETs for one cold key (origin
# delay 200 ms), then H hits each. Redis's INFO commandstats before and
# after each phase gives the commands (by name) and PUBLISH calls;
# messages delivered = what each PUBLISH returned, summed by Redis in
# pubsub stats is not kept, so fill notices delivered are counted as
# PUBLISH x subscribers of that channel (printed by PUBSUB NUMSUB during
# the fill). Loopback only, every load bounded (oha -n). Needs oha,
# redis-server, redis-cli.
#
#   bench/redis_cost.sh "1 5 20" [C] [H]
set -euo pipefail
cd "$(dirname "$0")/.."
counts=${1:-"1 5 20"}
conc=${2:-20}
hits=${3:-200}
cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
rport=6395 origin=127.0.0.1:3905
redis-server --port $rport --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
target/release/demo-origin $origin 2>"$work/origin.log" &
pids+=($!)
until redis-cli -p $rport ping >/dev/null 2>&1; do sleep 0.1; done
stats() { redis-cli -p $rport info commandstats | tr -d '\r' | sed -n 's/^cmdstat_\([a-z|]*\):calls=\([0-9]*\).*/\1 \2/p' | sort; }
delta() { # before after -> "cmd n ..." for changed counts
  join -a2 -e0 -o 0,1.2,2.2 "$1" "$2" | awk '$3-$2>0 {printf "%s=%d ", $1, $3-$2; t+=$3-$2} END {printf "total=%d", t}'
}
max=0; for n in $counts; do [ "$n" -gt "$max" ] && max=$n; done
for i in $(seq 0 $((max - 1))); do
  cat >"$work/c$i.yaml" <<YAML
listen: 127.0.0.1:$((8300 + i))
admin: 127.0.0.1:$((9300 + i))
cache: { memory: 32MiB }
redis: { url: "redis://127.0.0.1:$rport/0" }
routes:
  - name: api
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
YAML
  CORRAL_LOG=warn target/release/corral serve --config "$work/c$i.yaml" >"$work/c$i.log" 2>&1 &
  pids+=($!)
done
deadline=$((SECONDS + 60))
for i in $(seq 0 $((max - 1))); do
  until curl -sf "http://127.0.0.1:$((9300 + i))/readyz" 2>/dev/null | grep -q '"redis":"connected"'; do
    [ $SECONDS -lt $deadline ] || { echo "corral $i did not start"; exit 1; }
    sleep 0.1
  done
done
for n in $counts; do
  key="/cost-$n-$RANDOM?max-age=3600&delay=200&size=1024"
  stats >"$work/b"
  for i in $(seq 0 $((n - 1))); do
    timeout 60 oha --no-tui -n "$conc" -c "$conc" "http://127.0.0.1:$((8300 + i))$key" >/dev/null 2>&1 &
  done
  wait_oha=$(jobs -p | tail -n "$n"); for j in $wait_oha; do wait "$j" 2>/dev/null || true; done
  stats >"$work/a"
  fill=$(delta "$work/b" "$work/a")
  origin_hits=$(curl -s "http://$origin/__hits?path=${key%%\?*}")
  stats >"$work/b"
  for i in $(seq 0 $((n - 1))); do
    timeout 60 oha --no-tui -n "$hits" -c 10 "http://127.0.0.1:$((8300 + i))$key" >/dev/null 2>&1
  done
  stats >"$work/a"
  hit=$(delta "$work/b" "$work/a")
  echo "instances $n: one fill ($((n * conc)) callers, origin requests $origin_hits): $fill"
  echo "instances $n: $((n * hits)) hits: $hit"
done
