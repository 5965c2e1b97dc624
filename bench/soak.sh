#!/usr/bin/env bash
# corral's soak benchmark: three instances sharing one Redis under a steady
# load, with origin outages, every answer checked.
#
#   bench/soak.sh [CYCLES] [RATE]        (defaults: 1 cycle, 1500 req/s)
#
# One cycle is 60 s of normal traffic, a 30 s origin outage (every request
# answered 503) and 60 s more: 2.5 minutes. The load (bench/src/bin/soak-load.rs)
# spreads RATE requests per second over the instances, Zipf over 5,000 keys
# with 1-5 s TTLs, stale-while-revalidate 5 s and stale-if-error 60 s, and
# checks every body (its own key's, whole), every Age and every status.
# It prints each second's answers and origin requests, each minute's RSS per
# instance, and origin requests per second before, during and after the
# outages. A long soak for memory: `bench/soak.sh 12` (30 minutes).
#
# Redis is restarted (killed, and started again empty on its port) 58 s into
# the run, 2 s before the first outage: correlated failures are the usual
# kind. The seconds around both are printed again with their 503s per
# second. SOAK_REDIS_RESTART_AT=S moves the restart to S seconds; 0 leaves
# Redis alone. SOAK_REDIS=sentinel runs a master, a replica and three
# sentinels instead (corral follows the master they name), and at that
# moment kills the master for good: a failover, not a restart.
# SOAK_REDIS=cluster runs a six-node Cluster (three primaries, a replica
# each) and kills the first primary for good instead.
#
# SOAK_OUTAGE=slow makes each outage a hang (the origin takes every request
# and answers 30 s later) instead of 503s, and SOAK_CLIENTS=N spreads the
# load over N loopback source addresses (N callers to corral's circuit and
# back-off, as clients not behind a load balancer); the client gives up on a
# request after 20 s (`timeouts`), and `5xx_with_stale` counts 5xx answers
# for keys that had a stale copy to serve.
#
# Loopback only; bounded by CYCLES. Knob: BENCH_NO_BUILD=1 uses the binaries
# in target/release.
set -euo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
cycles=${1:-1}
rate=${2:-1500}
redis_port=6397
origin_port=3970
ports=(8197 8198 8199)
admins=(9197 9198 9199)
export PATH="$PATH:/usr/sbin:/sbin"

if [ -z "${BENCH_NO_BUILD:-}" ]; then
  cargo build --release --locked -p corral -p corral-bench >&2
fi
command -v redis-server >/dev/null || { echo "soak.sh needs redis-server" >&2; exit 1; }
work=$(mktemp -d /tmp/corral-soak.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

restart_at=${SOAK_REDIS_RESTART_AT:-58}
mode=${SOAK_REDIS:-node}
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
redis_pid=$!
pids+=($redis_pid)
redis_yaml="{ url: \"redis://127.0.0.1:$redis_port/0\", op_timeout: 100ms }"
if [ "$mode" = sentinel ]; then
  replica_port=$((redis_port - 1))
  redis-server --port "$replica_port" --bind 127.0.0.1 --save "" --appendonly no \
    --replicaof 127.0.0.1 "$redis_port" >"$work/replica.log" 2>&1 &
  pids+=($!)
  nodes=()
  for s in 0 1 2; do
    sport=$((26397 + s))
    cat >"$work/sentinel$s.conf" <<CONF
port $sport
bind 127.0.0.1
sentinel monitor soak 127.0.0.1 $redis_port 2
sentinel down-after-milliseconds soak 1000
sentinel failover-timeout soak 5000
CONF
    redis-server "$work/sentinel$s.conf" --sentinel >"$work/sentinel$s.log" 2>&1 &
    pids+=($!)
    nodes+=("redis://127.0.0.1:$sport")
  done
  # Formed: every sentinel knows the replica and the two others.
  for _ in $(seq 300); do
    formed=1
    for s in 0 1 2; do
      r=$(redis-cli -p $((26397 + s)) sentinel replicas soak 2>/dev/null | grep -c "^$replica_port$" || true)
      o=$(redis-cli -p $((26397 + s)) sentinel sentinels soak 2>/dev/null | grep -c '^name$' || true)
      [ "$r" -ge 1 ] && [ "$o" -ge 2 ] || formed=0
    done
    [ "$formed" = 1 ] && break
    sleep 0.1
  done
  [ "$formed" = 1 ] || { echo "the sentinels did not form" >&2; exit 1; }
  redis_yaml="{ sentinel: { master: soak, nodes: [$(IFS=,; echo "${nodes[*]}")] }, op_timeout: 100ms }"
elif [ "$mode" = cluster ]; then
  command -v redis-cli >/dev/null || { echo "SOAK_REDIS=cluster needs redis-cli" >&2; exit 1; }
  addrs=() seeds=()
  for n in 0 1 2 3 4 5; do
    port=$((7301 + n))
    mkdir -p "$work/node$n"
    (cd "$work/node$n" && exec redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
      --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000 \
      --repl-diskless-sync-delay 0 >"$work/node$n/log" 2>&1) &
    [ "$n" = 0 ] && redis_pid=$!
    pids+=($!)
    addrs+=("127.0.0.1:$port")
    seeds+=("redis://127.0.0.1:$port")
  done
  for n in 0 1 2 3 4 5; do
    for _ in $(seq 100); do redis-cli -p $((7301 + n)) ping >/dev/null 2>&1 && break; sleep 0.05; done
  done
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$work/create.log" 2>&1 \
    || { cat "$work/create.log" >&2; exit 1; }
  for _ in $(seq 300); do
    ok=0
    for n in 0 1 2 3 4 5; do
      redis-cli -p $((7301 + n)) cluster info 2>/dev/null | grep -q 'cluster_state:ok' && ok=$((ok + 1))
    done
    [ "$ok" = 6 ] && break
    sleep 0.1
  done
  [ "$ok" = 6 ] || { echo "the cluster did not form" >&2; exit 1; }
  redis_yaml="{ cluster: [$(IFS=,; echo "${seeds[*]}")], op_timeout: 100ms }"
fi
target/release/demo-origin "127.0.0.1:$origin_port" >"$work/origin.log" 2>&1 &
pids+=($!)
corrals=()
for i in 0 1 2; do
  cat >"$work/corral$i.yaml" <<YAML
listen: 127.0.0.1:${ports[$i]}
admin: 127.0.0.1:${admins[$i]}
cache: { memory: 64MiB, max_object_size: 1MiB }
redis: $redis_yaml
routes:
  - name: soak
    match: { path_prefix: / }
    upstream: http://127.0.0.1:$origin_port
YAML
  CORRAL_LOG=warn target/release/corral serve --config "$work/corral$i.yaml" >"$work/corral$i.log" 2>&1 &
  corrals+=($!)
  pids+=($!)
done
for a in "${admins[@]}"; do
  for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$a/readyz" 2>/dev/null | grep -q '"redis":"connected"' && break
    sleep 0.1
  done
done
echo "corral $(git rev-parse --short HEAD): 3 instances, one Redis, $rate req/s, $cycles cycle(s) of 60 s + 30 s outage + 60 s"
instances="127.0.0.1:${ports[0]},127.0.0.1:${ports[1]},127.0.0.1:${ports[2]}"
pidlist=$(IFS=,; echo "${corrals[*]}")
if [ "$restart_at" -gt 0 ] && [ "$mode" != node ]; then
  ( sleep "$restart_at"; kill -9 "$redis_pid" ) &
  pids+=($!)
  echo "The $mode's first primary is killed at ${restart_at} s (its replica is promoted); the first origin outage starts at 60 s"
elif [ "$restart_at" -gt 0 ]; then
  # The restarted server replaces this subshell (exec), so cleanup stops it.
  (
    sleep "$restart_at"
    kill "$redis_pid"
    while kill -0 "$redis_pid" 2>/dev/null; do sleep 0.01; done
    exec redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >>"$work/redis.log" 2>&1
  ) &
  pids+=($!)
  echo "Redis is restarted empty at ${restart_at} s; the first origin outage starts at 60 s"
fi
status=0
timeout $((cycles * 150 + 60)) target/release/soak-load "$instances" "127.0.0.1:$origin_port" "$pidlist" "$rate" 5000 60 30 60 "$cycles" \
  | tee "$work/seconds.tsv" || status=$?
if [ "$restart_at" -gt 0 ]; then
  echo
  echo "around the Redis $( [ "$mode" = node ] && echo restart || echo failover ) (${restart_at} s) and the outage (60 s): origin requests and 503s per second"
  awk -v from=$((restart_at - 5)) -v to=$((restart_at + 12)) -F'\t' '
    $1 ~ /^[0-9]+$/ { d = $6 - last; last = $6; if ($1 >= from && $1 <= to) printf "t=%s\t%s\tanswers %s\torigin %s\t503 %s\n", $1, $2, $3, $4, d }
  ' "$work/seconds.tsv"
fi
exit "$status"
