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
# every other node). Loopback only, every load bounded (oha -n). Needs oha, jq,
# redis-server (or $REDIS_SERVER, e.g. a valkey-server), redis-cli.
#
#   bench/redis_cost.sh "1 5 20" [C] [H] [K]
#   CLUSTER=1 bench/redis_cost.sh "1 5 20" 20 200 10
#   DELAY=1000 bench/redis_cost.sh "1 5 20 40" 50 0 10   # a 1 s origin
#
# A lab of hundreds of instances on one machine (an idle one is about
# 17 MiB resident, most of it the binary's pages, shared): `bench/fleet_lab.sh`
# runs this script at N up to 200 and tables what it prints. For each N it
# also prints the answers' status codes and client errors (oha's), the
# instances' memory (RSS, PSS) summed from /proc (idle, and after the
# fills), Redis's connected clients, how many instances led, waited, or
# read the entry once it was in L2 (their `corral_lease_total`), and at the
# end the warnings the instances logged. The instances start together;
# each must be ready (Redis connected) within 60 s + 0.5 s per instance.
#
# DELAY: the origin's delay in ms (200). CORRAL / DEMO_ORIGIN: binaries to
# run instead of building the release ones (e.g. another commit's build,
# to measure before and after). PORT_OFFSET: added to every port, so two
# runs on one machine do not meet. H = 0 skips the hit phase. OP_TIMEOUT:
# `redis.op_timeout` (default 50ms); on a loaded machine or with debug
# builds, raise it, or waiters time out on Redis and fetch alone.
# LOG_DIR: a folder to keep the instances' logs and oha's JSON summaries in.
# WARMUP=1: one fill before the first N is counted (scripts loaded).
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
delay=${DELAY:-200}
off=${PORT_OFFSET:-0}
corral=${CORRAL:-target/release/corral}
demo_origin=${DEMO_ORIGIN:-target/release/demo-origin}
[ -n "${CORRAL:-}" ] || cargo build --release -q -p corral -p corral-bench
work=$(mktemp -d)
pids=() cpids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
  if [ -n "${LOG_DIR:-}" ]; then mkdir -p "$LOG_DIR" && cp -r "$work"/*.log "$work"/oha "$LOG_DIR"/ 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
base=$((7400 + off)) origin=127.0.0.1:$((3906 + off))
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
  redis_yaml="{ url: \"${seeds[0]}/0\", op_timeout: ${OP_TIMEOUT:-50ms} }"
else
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >"$work/create.log" 2>&1
  deadline=$((SECONDS + 30))
  for i in $(seq 0 $((nodes - 1))); do
    until redis-cli -p $((base + i)) cluster info | grep -q cluster_state:ok; do
      [ $SECONDS -lt $deadline ] || { echo "the cluster did not form"; exit 1; }; sleep 0.1
    done
  done
  redis_yaml="{ cluster: [$(IFS=,; echo "${seeds[*]}")], op_timeout: ${OP_TIMEOUT:-50ms} }"
fi
"$demo_origin" $origin 2>"$work/origin.log" &
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
# `commands` is every command counted; `fill` leaves out the instances'
# heartbeats (every 2 s each: one script of 5 commands and itself, the
# only ZADD a fill phase sees), which are not the fill's.
delta() { join -a2 -e0 -o 0,1.2,2.2 "$1" "$2" | awk '$3-$2>0 {printf "%s=%d ", $1, $3-$2; if ($1 !~ /^bus-/) t+=$3-$2; if ($1 == "zadd") z=$3-$2} END {printf "commands=%d fill=%d", t, t - 6 * z}'; }
max=0; for n in $counts; do [ "$n" -gt "$max" ] && max=$n; done
# File descriptors: Redis holds a few connections per instance, and every
# process here inherits this shell's limit (oha: C sockets; an instance:
# its callers, Redis and the origin).
need=$((max * 8 + conc * 4 + 256))
if [ "$(ulimit -n)" -lt "$need" ]; then ulimit -n "$(ulimit -Hn)" 2>/dev/null || true; fi
[ "$(ulimit -n)" -ge "$need" ] || { echo "ulimit -n is $(ulimit -n); $max instances need about $need"; exit 1; }
mkdir -p "$work/oha"
for i in $(seq 0 $((max - 1))); do
  cat >"$work/c$i.yaml" <<YAML
listen: 127.0.0.1:$((8400 + off + i))
admin: 127.0.0.1:$((9400 + off + i))
cache: { memory: 32MiB }
redis: $redis_yaml
routes:
  - name: api
    upstream: http://$origin
    cache: { early_refresh_beta: 0 }
YAML
done
started=$(date +%s.%N)
for i in $(seq 0 $((max - 1))); do
  CORRAL_LOG=warn "$corral" serve --config "$work/c$i.yaml" >"$work/c$i.log" 2>&1 &
  pids+=($!) cpids+=($!)
done
deadline=$((SECONDS + 60 + max / 2))
for i in $(seq 0 $((max - 1))); do
  until curl -sf "http://127.0.0.1:$((9400 + off + i))/readyz" 2>/dev/null | grep -q '"redis":"connected"'; do
    [ $SECONDS -lt $deadline ] || { echo "corral $i did not start"; exit 1; }
    kill -0 "${cpids[$i]}" 2>/dev/null || { echo "corral $i exited:"; tail -5 "$work/c$i.log"; exit 1; }
    sleep 0.1
  done
done
# Memory of every instance, summed (MiB), and its mean: resident (RSS,
# which counts the binary's shared pages in every process) and
# proportional (PSS, shared pages divided among their sharers: what the
# instances take from the machine together).
rss() {
  for p in "${cpids[@]}"; do awk '/^(Rss|Pss):/ {printf "%s ", $2} END {print ""}' "/proc/$p/smaps_rollup" 2>/dev/null || true; done |
    awk -v n="${#cpids[@]}" '{r+=$1; p+=$2} END {printf "RSS %.0f MiB summed over %d instances (mean %.1f), PSS %.0f MiB (mean %.1f)", r/1024, n, r/1024/n, p/1024, p/1024/n}'
}
# The instances' lease outcomes (`corral_lease_total`: acquired, led a
# fill; lost, waited on another's; ...), Redis errors by kind (a command
# that failed or passed op_timeout: that fill went on without Redis) and
# breaker openings, summed over the first $1.
leases() {
  for i in $(seq 0 $(($1 - 1))); do curl -s "http://127.0.0.1:$((9400 + off + i))/metrics" || true; done |
    sed -n -e 's/^corral_lease_total{outcome="\([a-z_]*\)"} \([0-9]*\)$/\1 \2/p' \
      -e 's/^corral_redis_errors_total{kind="\([a-z_]*\)"} \([0-9]*\)$/redis-error-\1 \2/p' \
      -e 's/^corral_redis_breaker_opened_total \([0-9]*\)$/breaker-opened \1/p' |
    awk '{s[$1]+=$2} END {for (k in s) print k, s[k]}' | sort
}
clients() { redis-cli -p "$base" info clients | tr -d '\r' | sed -n 's/^connected_clients:/connected clients /p'; }
echo "$max instances ready in $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}') s; memory $(rss); Redis $(clients); ulimit -n $(ulimit -n)"
q="max-age=3600&delay=$delay&size=1024"
# WARMUP=1: one fill on the first instance before any is counted, so the
# first N measured does not carry the scripts' first loads (SCRIPT LOAD).
[ "${WARMUP:-0}" = 0 ] || curl -sf -o /dev/null "http://127.0.0.1:$((8400 + off))/warmup-$RANDOM?$q" || true
for n in $counts; do
  tag="cost-$n-$RANDOM"
  leases "$n" >"$work/lb"
  stats >"$work/b"
  t0=$(date +%s.%N)
  for k in $(seq 1 "$keys"); do
    # Wait for these loads by pid: `jobs -p` forgets a job that ended, and
    # its tail would then name an instance.
    loads=()
    for i in $(seq 0 $((n - 1))); do
      timeout 60 oha --no-tui -n "$conc" -c "$conc" --output-format json -o "$work/oha/$tag-$k-$i.json" \
        "http://127.0.0.1:$((8400 + off + i))/$tag-$k?$q" >/dev/null 2>&1 &
      loads+=($!)
    done
    for j in "${loads[@]}"; do wait "$j" 2>/dev/null || true; done
  done
  per_key=$(awk -v a="$t0" -v b="$(date +%s.%N)" -v k="$keys" 'BEGIN {printf "%.2f", (b - a) / k}')
  stats >"$work/a"
  fill=$(delta "$work/b" "$work/a")
  # Per key: instances that led, that waited on a leader, and the rest of
  # the n (those that came once the entry was in L2 and read it).
  leases "$n" >"$work/la"
  split=$(join -a2 -e0 -o 0,1.2,2.2 "$work/lb" "$work/la" | awk -v n="$n" -v k="$keys" '
    $1 ~ /^(redis-error-|breaker-)/ {if ($3 > $2) e = e sprintf(" %s=%d", $1, $3 - $2); next}
    {d[$1] = $3 - $2; t += $3 - $2}
    END {printf "leases per key: led %.1f waited %.1f read %.1f (other outcomes %d);%s", d["acquired"] / k, d["lost"] / k,
      n - (d["acquired"] + d["lost"]) / k, t - d["acquired"] - d["lost"], (e == "" ? " no Redis errors" : e)}')
  # What the callers got: status codes and client errors summed over every
  # oha run of this N (a run that wrote nothing counts as missing).
  answers=$(cat "$work/oha/$tag"-*.json 2>/dev/null | jq -rs --argjson want $((n * keys)) '
    (map(.statusCodeDistribution // {} | to_entries[]) | group_by(.key) | map("\(.[0].key)=\(map(.value) | add)") | join(" ")) as $codes
    | (map(.errorDistribution // {} | to_entries[] | .value) | add // 0) as $errors
    | "answers \($codes) client-errors=\($errors)" + (if length < $want then " missing-runs=\($want - length)" else "" end)')
  origin_hits=$(curl -s "http://$origin/__stats?prefix=/$tag-")
  stats >"$work/b"
  for i in $(seq 0 $((n - 1))); do
    [ "$hits" = 0 ] || timeout 60 oha --no-tui -n "$hits" -c 10 "http://127.0.0.1:$((8400 + off + i))/$tag-1?$q" >/dev/null 2>&1
  done
  stats >"$work/a"
  hit=$(delta "$work/b" "$work/a")
  stats >"$work/b"
  for k in $(seq 1 "$keys"); do
    curl -sf -X POST -o /dev/null "http://127.0.0.1:$((8400 + off))/$tag-$k?max-age=3600&size=16"
  done
  stats >"$work/a"
  purge=$(delta "$work/b" "$work/a")
  total=${fill##*fill=}
  echo "instances $n: $keys fill(s) ($((n * conc)) callers each, origin ${delay} ms; origin $origin_hits): $fill per-fill(heartbeats left out)=$(awk -v t="$total" -v k="$keys" 'BEGIN {printf "%.1f", t / k}')"
  echo "instances $n: $split"
  echo "instances $n: $answers; ${per_key} s a key; memory $(rss); Redis $(clients)"
  echo "instances $n: $((n * hits)) hits: $hit"
  echo "instances $n: $keys purge(s): $purge"
done
# What the instances logged at warn and above, by message.
warned=$(cat "$work"/c*.log | grep -c . || true)
echo "instance log lines (warn and above): $warned"
[ "$warned" = 0 ] || cat "$work"/c*.log | sed -n 's/.*"message":"\([^"]*\)".*/\1/p' | sort | uniq -c | sort -rn | head -10
