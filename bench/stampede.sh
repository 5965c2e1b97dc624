#!/usr/bin/env bash
# The lab as a benchmark: 5 corral instances sharing one Redis, 200
# concurrent requests on each (1000 in all) for one cold key whose origin
# answer takes 300 ms. Prints origin hits and latency percentiles.
# Loopback only; every load is bounded (-n 200 per instance). Needs oha
# (`cargo install oha`) and redis-server.
#
#   bench/stampede.sh [RUNS]        (default 3 runs, each on a new cold key)
#   bench/stampede.sh RUNS ttfb     the same crowd on a 5 MB answer the origin
#                                   trickles out over 2 s: each instance's
#                                   first and last body byte (ttfb-load),
#                                   and the Redis commands the fill cost.
#                                   A body within l2_max_object_size reaches
#                                   the waiting instances as it arrives
#                                   (relayed through a Redis stream); a
#                                   larger one is fetched by each instance.
#                                   TTFB_SIZE=BYTES sets the body (default
#                                   5 MB, over redis.l2_max_object_size's 1 MiB)
set -euo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
runs=${1:-3}
mode=${2:-oha}
cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

redis_port=6391 origin=127.0.0.1:3901
redis-server --port $redis_port --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
target/release/demo-origin $origin 2>"$work/origin.log" &
pids+=($!)
for i in 0 1 2 3 4; do
  cat >"$work/corral$i.yaml" <<YAML
listen: 127.0.0.1:810$i
admin: 127.0.0.1:910$i
cache: { memory: 256MiB, max_object_size: 8MiB }
redis: { url: "redis://127.0.0.1:$redis_port/0" }
routes:
  - name: api
    match: { path_prefix: / }
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
YAML
  CORRAL_LOG=warn target/release/corral serve --config "$work/corral$i.yaml" >"$work/corral$i.log" 2>&1 &
  pids+=($!)
done
deadline=$((SECONDS + 20))
for i in 0 1 2 3 4; do
  # Ready, and connected to Redis (corral serves before it is, alone).
  until curl -sf "http://127.0.0.1:910$i/readyz" 2>/dev/null | grep -q '"redis":"connected"'; do
    [ $SECONDS -lt $deadline ] || { echo "corral $i did not start"; cat "$work/corral$i.log"; exit 1; }
    sleep 0.1
  done
done
until redis-cli -p $redis_port ping >/dev/null 2>&1; do sleep 0.1; done

if [ "$mode" = ttfb ]; then
  ulimit -n 65536 2>/dev/null || true
  for run in $(seq 1 "$runs"); do
    path="/ttfb/$run-$RANDOM"
    redis-cli -p $redis_port config resetstat >/dev/null
    for i in 0 1 2 3 4; do
      timeout 90 target/release/ttfb-load 127.0.0.1:810$i "$path?size=${TTFB_SIZE:-5242880}&trickle=2000&max-age=60" 200 60 \
        >"$work/ttfb$i.json" &
    done
    wait $(jobs -p | tail -5) 2>/dev/null || true
    sleep 0.2
    echo "run $run: origin hits $(curl -s "http://$origin/__hits?path=$path")"
    for i in 0 1 2 3 4; do echo "  instance $i: $(cat "$work/ttfb$i.json")"; done
    # What the fill cost Redis, by command (scripts: the leases, the entry,
    # the relayed body's parts; xread: the waiting instances' reads of it).
    echo "  redis commands: $(redis-cli -p $redis_port info commandstats | tr -d '\r' | sed -n 's/^cmdstat_\([a-z|]*\):calls=\([0-9]*\).*/\1=\2/p' | tr '\n' ' ')"
  done
  exit 0
fi

for run in $(seq 1 "$runs"); do
  path="/cold/$run-$RANDOM"
  for i in 0 1 2 3 4; do
    oha -n 200 -c 200 --no-tui --output-format json \
      "http://127.0.0.1:810$i$path?delay=300&max-age=60&size=1024" >"$work/oha$i.json" &
  done
  wait $(jobs -p | tail -5) 2>/dev/null || true
  sleep 0.2
  hits=$(curl -s "http://$origin/__hits?path=$path")
  leases=$(redis-cli -p $redis_port --scan --pattern '*:lease:*' | wc -l)
  python3 - "$work" "$run" "$hits" "$leases" <<'PY'
import json, sys
work, run, hits, leases = sys.argv[1], sys.argv[2], sys.argv[3].strip(), sys.argv[4].strip()
p50s, p99s, maxs, ok, total = [], [], [], 0, 0
for i in range(5):
    d = json.load(open(f"{work}/oha{i}.json"))
    lp = d["latencyPercentiles"]
    p50s.append(lp["p50"]); p99s.append(lp["p99"]); maxs.append(d["summary"]["slowest"])
    codes = d.get("statusCodeDistribution", {})
    ok += codes.get("200", 0); total += sum(codes.values())
ms = lambda s: f"{s*1000:.0f} ms"
print(f"run {run}: origin hits {hits}, 200s {ok}/{total}, leases left {leases}, "
      f"p50 {ms(sorted(p50s)[2])} (median of instances), p99 {ms(max(p99s))} (worst instance), max {ms(max(maxs))}")
PY
done
