#!/usr/bin/env bash
# What Redis does per origin fill, per hit and per purge, as a function of
# the number of corral instances (issue 16's scaling note). N instances
# share one Redis node, or with CLUSTER=1 a six-node Cluster (3 primaries,
# 1 replica each, `redis.cluster`); for each of K cold keys every instance
# sends C concurrent GETs (origin delay 200 ms), then H hits each on the
# first key; then one POST per key purges it. Measured before and after
# each phase: INFO commandstats summed over the primaries (commands by name,
# including those a script runs; replicas only replay them) and, on a
# cluster, CLUSTER INFO's bus counters summed over every node:
# `publishshard` (a sharded fill notice, SPUBLISH, goes to the other nodes
# of its shard) and `publish` (a classic PUBLISH, the purge notice, goes to
# every other node). Loopback only, every load bounded (oha -n). Needs oha,
# redis-server (or $REDIS_SERVER, e.g. a valkey-server), redis-cli.
#
#   bench/redis_cost.sh "1 5 20" [C] [H] [K]
#   CLUSTER=1 bench/redis_cost.sh "1 5 20" 20 200 10
set -euo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
counts=${1:-"1 5 20"}
conc=${2:-20}
hits=${3:-200}
keys=${4:-1}
server=${REDIS_SERVER:-redis-server}
cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
base=7400 origin=127.0.0.1:3906
if [ "${CLUSTER:-0}" = 1 ]; then nodes=6; else nodes=1; fi
addrs=() seeds=()
for i in $(seq 0 $((nodes - 1))); do
  p=$((base + i)); mkdir -p "$work/n$i"
  cluster_args=()
  [ "$nodes" = 1 ] || cluster_args=(--cluster-enabled yes --cluster-config-file nodes.conf
    --cluster-node-timeout 2000 --cluster-port $((base + 100 + i)) --repl-diskless-sync-delay 0)
  "$server" --port $p --bind 127.0.0.1 --save "" --appendonly no --dir "$work/n$i" "${cluster_args[@]}" \
    >"$work/n$i.log" 2>&1 &
  pids+=($!); addrs+=("127.0.0.1:$p"); seeds+=("redis://127.0.0.1:$p")
done
for i in $(seq 0 $((nodes - 1))); do until redis-cli -p $((base + i)) ping >/dev/null 2>&1; do sleep 0.1; done; done
if [ "$nodes" = 1 ]; then
  redis_yaml="{ url: \"${seeds[0]}/0\" }"
else
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$work/create.log" 2>&1
  deadline=$((SECONDS + 30))
  for i in $(seq 0 $((nodes - 1))); do
    until redis-cli -p $((base + i)) cluster info | grep -q cluster_state:ok; do
      [ $SECONDS -lt $deadline ] || { echo "the cluster did not form"; exit 1; }; sleep 0.1
    done
  done
  redis_yaml="{ cluster: [$(IFS=,; echo "${seeds[*]}")] }"
fi
target/release/demo-origin $origin 2>"$work/origin.log" &
pids+=($!)
# This script's own probes and replication traffic are left out.
stats() {
  for i in $(seq 0 $((nodes - 1))); do
    if redis-cli -p $((base + i)) role | head -1 | grep -q master; then
      redis-cli -p $((base + i)) info commandstats | tr -d '\r' | sed -n 's/^cmdstat_\([a-z|]*\):calls=\([0-9]*\).*/\1 \2/p'
    fi
    [ "$nodes" = 1 ] || redis-cli -p $((base + i)) cluster info | tr -d '\r' |
      sed -n 's/^cluster_stats_messages_\(publish[a-z]*\)_sent:\([0-9]*\)/bus-\1 \2/p'
  done | grep -Ev '^(info|cluster\|info|role|replconf|psync|ping) ' |
    awk '{s[$1]+=$2} END {for (k in s) print k, s[k]}' | sort
}
delta() { join -a2 -e0 -o 0,1.2,2.2 "$1" "$2" | awk '$3-$2>0 {printf "%s=%d ", $1, $3-$2; if ($1 !~ /^bus-/) t+=$3-$2} END {printf "commands=%d", t}'; }
max=0; for n in $counts; do [ "$n" -gt "$max" ] && max=$n; done
for i in $(seq 0 $((max - 1))); do
  cat >"$work/c$i.yaml" <<YAML
listen: 127.0.0.1:$((8400 + i))
admin: 127.0.0.1:$((9400 + i))
cache: { memory: 32MiB }
redis: $redis_yaml
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
  until curl -sf "http://127.0.0.1:$((9400 + i))/readyz" 2>/dev/null | grep -q '"redis":"connected"'; do
    [ $SECONDS -lt $deadline ] || { echo "corral $i did not start"; exit 1; }
    sleep 0.1
  done
done
q="max-age=3600&delay=200&size=1024"
for n in $counts; do
  tag="cost-$n-$RANDOM"
  stats >"$work/b"
  for k in $(seq 1 "$keys"); do
    for i in $(seq 0 $((n - 1))); do
      timeout 60 oha --no-tui -n "$conc" -c "$conc" "http://127.0.0.1:$((8400 + i))/$tag-$k?$q" >/dev/null 2>&1 &
    done
    for j in $(jobs -p | tail -n "$n"); do wait "$j" 2>/dev/null || true; done
  done
  stats >"$work/a"
  fill=$(delta "$work/b" "$work/a")
  origin_hits=$(curl -s "http://$origin/__stats?prefix=/$tag-")
  stats >"$work/b"
  for i in $(seq 0 $((n - 1))); do
    timeout 60 oha --no-tui -n "$hits" -c 10 "http://127.0.0.1:$((8400 + i))/$tag-1?$q" >/dev/null 2>&1
  done
  stats >"$work/a"
  hit=$(delta "$work/b" "$work/a")
  stats >"$work/b"
  for k in $(seq 1 "$keys"); do
    curl -sf -X POST -o /dev/null "http://127.0.0.1:8400/$tag-$k?max-age=3600&size=16"
  done
  stats >"$work/a"
  purge=$(delta "$work/b" "$work/a")
  echo "instances $n: $keys fill(s) ($((n * conc)) callers each; origin $origin_hits): $fill"
  echo "instances $n: $((n * hits)) hits: $hit"
  echo "instances $n: $keys purge(s): $purge"
done
