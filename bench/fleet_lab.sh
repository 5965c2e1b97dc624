#!/usr/bin/env bash
# The fleet lab (issue 48): Redis commands per fill with up to 200 corral
# instances on one machine and one Redis, run RUNS times, as a table.
# Each run is one `bench/redis_cost.sh` with every N in NS (one fleet of
# max(NS) instances started together; an instance not loaded for a point
# sits idle, subscribed to the notice channels like the others): for each
# of K cold keys every one of N instances gets C concurrent GETs, no hit
# phase. Loopback only, every load bounded (oha -n).
#
#   bench/fleet_lab.sh [RUNS] [C] [K] ["NS"]
#   bench/fleet_lab.sh 2 5 10 "1 5 20 40 200"            # the defaults
#   DELAY=1000 bench/fleet_lab.sh 2 5 10 "1 40 200"     # a 1 s origin
#
# Per instance past the first is (cost(N) - cost(1)) / (N - 1), cost(1)
# from the same run: what each instance beyond the leader adds, whether it
# waited on the leader (its lease outcome `lost`, 3 commands) or came once
# the entry was in L2 and read it (2); the table says how many did which.
# C is per instance: 200 instances × C callers, each oha a process, all on
# the same cores as the instances and Redis; on 2 cores keep C small (5).
# What is measured is commands per fill and origin requests per key, not
# latency. An idle instance is about 17 MiB resident, under 2 MiB of it
# its own (PSS): 200 fit in 4 GiB.
#
# Environment: as bench/redis_cost.sh (DELAY, OP_TIMEOUT, CORRAL,
# DEMO_ORIGIN, REDIS_SERVER, LOG_DIR, WARMUP), with PORT_OFFSET 500,
# WARMUP 1 and OP_TIMEOUT 500ms by default here: 200 instances on 2 cores
# delay Redis replies past the 50 ms default, and an instance whose read
# times out fetches alone, which the origin column shows (with the
# "redis-error-timeout" count). On a machine loaded by other work, 500ms
# may not be enough either at 200 instances; 2s was.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-2}
conc=${2:-5}
keys=${3:-10}
counts=${4:-"1 5 20 40 200"}
export PORT_OFFSET=${PORT_OFFSET:-500} OP_TIMEOUT=${OP_TIMEOUT:-500ms} WARMUP=${WARMUP:-1}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$runs"); do
  echo "== run $r: bench/redis_cost.sh \"$counts\" $conc 0 $keys (DELAY=${DELAY:-200} OP_TIMEOUT=$OP_TIMEOUT)"
  log_dir=${LOG_DIR:+$LOG_DIR/run$r}
  LOG_DIR=$log_dir bench/redis_cost.sh "$counts" "$conc" 0 "$keys" | tee "$out/run$r.txt"
done
echo
echo "origin ${DELAY:-200} ms, $keys cold keys, $conc callers per instance, op_timeout $OP_TIMEOUT; one column per run"
echo
awk -v runs="$runs" '
  FNR == 1 { r++ }
  /^instances [0-9]+: [0-9]+ fill/ {
    n = $2; sub(":", "", n); seen[n] = 1
    match($0, /per-fill\(heartbeats left out\)=[0-9.]+/); cost[n, r] = substr($0, RSTART + 30, RLENGTH - 30)
    match($0, /hits=[0-9]+ paths=[0-9]+ max=[0-9]+/); split(substr($0, RSTART, RLENGTH), f, /[ =]/)
    origin[n, r] = sprintf("%.1f (max %d)", f[2] / f[4], f[6])
  }
  /^instances [0-9]+: leases per key/ {
    n = $2; sub(":", "", n)
    split_[n, r] = sprintf("%s + %s + %s", $7, $9, $11)
    e = $0; sub(/^[^;]*; */, "", e); errs[n, r] = e
  }
  /^instances [0-9]+: answers/ {
    n = $2; sub(":", "", n)
    match($0, /answers [^;]*/); ans[n, r] = substr($0, RSTART + 8, RLENGTH - 8)
  }
  END {
    printf "| instances | commands per fill | per instance past the first | instances per key: led + waited + read | origin requests per key | answers, Redis errors |\n"
    printf "| --- | --- | --- | --- | --- | --- |\n"
    for (n = 1; n <= 100000; n++) {
      if (!(n in seen)) continue
      c = w = o = a = l = ""
      for (i = 1; i <= runs; i++) {
        sep = (i > 1 ? " / " : "")
        c = c sep cost[n, i]
        w = w sep (n > 1 && ((1, i) in cost) ? sprintf("%.2f", (cost[n, i] - cost[1, i]) / (n - 1)) : "")
        o = o sep origin[n, i]
        l = l sep split_[n, i]
        a = a sep ans[n, i] ", " errs[n, i]
      }
      if (n == 1) w = ""
      printf "| %d | %s | %s | %s | %s | %s |\n", n, c, w, l, o, a
    }
  }' "$out"/run*.txt
