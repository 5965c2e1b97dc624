#!/usr/bin/env bash
# corral's load benchmark: corral, nginx proxy_cache and Varnish side by side
# on this machine, every scenario run twice, results in bench/results/latest.md
# (raw oha JSON in bench/results/raw/, not committed). See bench/README.md.
#
#   bench/run.sh
#
# Loopback only; every load is bounded (oha -z or -n, under `timeout`); the
# whole run takes about 8 minutes plus the build. Servers are pinned to core 0 and oha to
# core 1, one core per server (nginx worker_processes 1, varnishd
# thread_pools=1, corral TOKIO_WORKER_THREADS=1). Missing nginx / varnish /
# redis-server are installed with apt-get when run as root on Debian; a
# system that cannot be installed is skipped, not fatal.
#
# Knobs (environment): BENCH_SYSTEMS="corral nginx varnish",
# BENCH_SCENARIOS="hit capacity stampede ttfb fleet hotset failing swr", BENCH_RUNS=2,
# BENCH_DURATION=10s, BENCH_NO_BUILD=1 (use the binaries in target/release),
# BENCH_OUT=FILE (write the table there instead of bench/results/latest.md).
set -uo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
root=$PWD
bench=$root/bench
results=$bench/results
raw=$results/raw
export PATH="$PATH:/usr/sbin:/sbin"

systems=(${BENCH_SYSTEMS:-corral nginx varnish})
scenarios=" ${BENCH_SCENARIOS:-hit capacity stampede ttfb fleet hotset failing swr} "
runs=${BENCH_RUNS:-2}
duration=${BENCH_DURATION:-10s}
secs=${duration%s}

ORIGIN_PORT=3950
ORIGIN=127.0.0.1:$ORIGIN_PORT
REDIS_PORT=6395
declare -A port=([corral]=8150 [nginx]=8151 [varnish]=8152)
declare -A fleet_base=([corral]=8160 [nginx]=8170)

log() { printf '[%4ds] %s\n' "$SECONDS" "$*" >&2; }
die() { log "error: $*"; exit 1; }
has() { command -v "$1" >/dev/null 2>&1; }
enabled() { [[ " ${systems[*]} " == *" $1 "* ]]; }
drop_system() {
  local s=$1 why=$2 kept=() x
  log "skipping $s: $why"
  for x in "${systems[@]}"; do [ "$x" = "$s" ] || kept+=("$x"); done
  systems=("${kept[@]}")
  printf '{"scenario":"skip","system":"%s","reason":"%s"}\n' "$s" "$why" >>"$raw/records.jsonl"
}

# ---------------------------------------------------------------- processes
work=$(mktemp -d /tmp/corral-bench.XXXXXX)
chmod 755 "$work" # varnishd's jailed child must reach its working directory
declare -A pid_of=()
stop() { # name...: TERM, then KILL after 5 s
  local n p
  for n in "$@"; do
    p=${pid_of[$n]:-}
    [ -n "$p" ] && kill -TERM "$p" 2>/dev/null
  done
  for n in "$@"; do
    p=${pid_of[$n]:-}
    [ -n "$p" ] || continue
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
    unset "pid_of[$n]"
  done
}
cleanup() {
  local names=("${!pid_of[@]}")
  [ ${#names[@]} -eq 0 ] || stop "${names[@]}"
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if [ "$(nproc)" -ge 2 ]; then
  on_server=(taskset -c 0) on_client=(taskset -c 1)
else
  log "fewer than 2 cores: not pinning"
  on_server=() on_client=()
fi

wait_ready() { # name url: until it answers 200 (20 s)
  local deadline=$((SECONDS + 20))
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "$2")" = 200 ]; do
    if [ $SECONDS -ge $deadline ] || ! kill -0 "${pid_of[$1]}" 2>/dev/null; then
      log "$1 did not start"; tail -20 "$work/$1.log" >&2; return 1
    fi
    sleep 0.1
  done
}

start_origin() {
  TOKIO_WORKER_THREADS=1 "${on_server[@]}" "$root/target/release/demo-origin" "$ORIGIN" >"$work/origin.log" 2>&1 &
  pid_of[origin]=$!
  wait_ready origin "http://$ORIGIN/__hits"
}

start_redis() {
  "${on_server[@]}" redis-server --port $REDIS_PORT --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
  pid_of[redis]=$!
  local deadline=$((SECONDS + 10))
  until redis-cli -p $REDIS_PORT ping >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { log "redis did not start"; return 1; }
    sleep 0.1
  done
}

start_corral() { # name template port admin_port
  sed -e "s/@PORT@/$3/" -e "s/@ADMIN_PORT@/$4/" -e "s/@ORIGIN@/$ORIGIN/" \
    -e "s/@REDIS_PORT@/$REDIS_PORT/" "$bench/corral/$2" >"$work/$1.yaml"
  CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 "${on_server[@]}" "$root/target/release/corral" serve \
    --config "$work/$1.yaml" >"$work/$1.log" 2>&1 &
  pid_of[$1]=$!
  wait_ready "$1" "http://127.0.0.1:$4/healthz"
}

start_nginx() { # name port
  local dir=$work/$1 user_line=""
  mkdir -p "$dir/tmp" "$dir/cache"
  [ "$(id -u)" -ne 0 ] || user_line="user root;" # workers must write the temp cache dir
  sed -e "s|@USER_LINE@|$user_line|" -e "s|@DIR@|$dir|g" -e "s|@PORT@|$2|" \
    -e "s|@ORIGIN@|$ORIGIN|" "$bench/nginx/nginx.conf.tmpl" >"$dir/nginx.conf"
  "${on_server[@]}" nginx -p "$dir/" -c "$dir/nginx.conf" -e "$dir/error.log" >"$work/$1.log" 2>&1 &
  pid_of[$1]=$!
  wait_ready "$1" "http://127.0.0.1:$2/$1/ready?max-age=0"
}

start_varnish() { # name port admin_port
  sed -e "s/\"3950\"/\"$ORIGIN_PORT\"/" "$bench/varnish/default.vcl" >"$work/$1.vcl"
  # thread_pool_min covers the 1000-connection stampede without queueing or
  # dropping sessions (Varnish holds a thread per active request).
  "${on_server[@]}" varnishd -F -n "$work/$1" -a "127.0.0.1:$2" -T "127.0.0.1:$3" \
    -f "$work/$1.vcl" -s malloc,256m -p thread_pools=1 -p thread_pool_min=1000 \
    -p thread_pool_max=5000 -p listen_depth=4096 >"$work/$1.log" 2>&1 &
  pid_of[$1]=$!
  wait_ready "$1" "http://127.0.0.1:$2/$1/ready?max-age=0"
}

# ------------------------------------------------------------- measurement
oha_run() { # out.json bound_seconds oha-args...: one bounded load on core 1
  local out=$1 bound=$2
  shift 2
  timeout -k 5 "$bound" "${on_client[@]}" oha --no-tui --worker-threads 1 \
    --output-format json -o "$out" "$@" >/dev/null 2>"$out.err"
  local rc=$?
  [ $rc -eq 0 ] || log "oha exited $rc: $out ($(head -c 300 "$out.err"))"
  [ -s "$out.err" ] || rm -f "$out.err"
  return 0
}
hits() { # the origin's request count for a path (-1 when it does not answer)
  local n
  n=$(curl -s "http://$ORIGIN/__hits?path=$1" | tr -d '\n')
  [[ "$n" =~ ^[0-9]+$ ]] && echo "$n" || echo -1
}
outage() { curl -s -o /dev/null -X POST "http://$ORIGIN/__outage?mode=$1"; }
record() { printf '%s\n' "$1" >>"$raw/records.jsonl"; }
cpu_ticks() { # pid: user+system clock ticks of the process and all its descendants
  local total=0 pid stat rest ppid fields
  declare -A parent=() ticks=()
  for stat in /proc/[0-9]*/stat; do
    read -r fields <"$stat" 2>/dev/null || continue
    pid=${fields%% *}
    rest=${fields##*) } # past "(comm) "; comm may hold spaces
    read -r _ ppid _ _ _ _ _ _ _ _ _ utime stime _ <<<"$rest"
    parent[$pid]=$ppid ticks[$pid]=$((utime + stime))
  done
  for pid in "${!ticks[@]}"; do
    local p=$pid
    while [ -n "$p" ] && [ "$p" != 0 ] && [ "$p" != "$1" ]; do p=${parent[$p]:-}; done
    [ "$p" != "$1" ] || total=$((total + ticks[$pid]))
  done
  echo "$total"
}
calm() { # system: for corral, waits (at most 10 s) until it no longer sheds load.
  # A run keeps its core busy past `server.overload` (90%), so corral is still
  # shedding for up to 0.5 s after it: the next run's fresh connections would be
  # told 503 and close, and a client that reconnects at once (oha does) keeps it
  # busy and shedding. Each run starts, as the first did, on a calm server:
  # every scenario calls it before its fill or its load.
  [ "$1" = corral ] || return 0
  local deadline=$((SECONDS + 10))
  while curl -s http://127.0.0.1:9150/metrics | grep -q '^corral_overloaded 1'; do
    [ $SECONDS -lt $deadline ] || { log "corral still sheds load after 10 s"; return 0; }
    sleep 0.1
  done
}
measured() { # system command...: the command (a load) on a calm system, and the
  # CPU seconds the system's processes and the load used during it
  # (server_cpu, client_cpu in $cpu_json)
  local s=$1 before after hz cb ca
  shift
  calm "$s"
  hz=$(getconf CLK_TCK)
  before=$(cpu_ticks "${pid_of[$s]}")
  cb=$(awk '{print $16 + $17}' /proc/$$/stat) # this shell's reaped children: the load
  "$@"
  ca=$(awk '{print $16 + $17}' /proc/$$/stat)
  after=$(cpu_ticks "${pid_of[$s]}")
  cpu_json="\"server_cpu\":$(awk -v a="$after" -v b="$before" -v h="$hz" 'BEGIN{printf "%.2f", (a-b)/h}'),\"client_cpu\":$(awk -v a="$ca" -v b="$cb" -v h="$hz" 'BEGIN{printf "%.2f", (a-b)/h}')"
}
oha_measured() { # system out.json bound oha-args...: oha_run, measured
  local s=$1
  shift
  measured "$s" oha_run "$@"
}
capacity_run() { # out.json bound port path: capacity-load (64 connections, one
  # request in flight on each) on core 1 for the run's duration
  local out=$1 rc
  timeout -k 5 "$2" "${on_client[@]}" "$root/target/release/capacity-load" \
    "127.0.0.1:$3" "$4" 64 1 "$secs" >"$out" 2>"$out.err"
  rc=$?
  [ $rc -eq 0 ] || log "capacity-load exited $rc: $out ($(head -c 300 "$out.err"))"
  [ -s "$out.err" ] || rm -f "$out.err"
}
order() { # run: systems in turn, the order reversed on even runs
  if [ $(($1 % 2)) -eq 1 ]; then printf '%s\n' "${systems[@]}"; else printf '%s\n' "${systems[@]}" | tac; fi
}
sample_headers() { # url out: one request's status and cache headers, for the report
  curl -s -D - -o /dev/null "$1" | tr -d '\r' | grep -iE '^(HTTP/|cache-status|x-cache|age|x-varnish)' |
    paste -sd' ' >"$2"
}

# --------------------------------------------------------------- preparing
mkdir -p "$raw"
rm -rf "${raw:?}"/*
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
log "work dir $work; systems: ${systems[*]}; scenarios:${scenarios% }"

install_pkg() { # package binary: apt-get install when missing and possible
  has "$2" && return 0
  if [ "$(id -u)" -ne 0 ] || ! has apt-get; then
    log "$2 is missing and $1 cannot be installed here (needs root on Debian)"; return 1
  fi
  if ! apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt-get update -qq >/dev/null 2>&1 || true
  fi
  if ! apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    log "no $1 package in the apt sources"; return 1
  fi
  log "installing $1"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >"$work/apt-$1.log" 2>&1 ||
    { log "apt-get install $1 failed: $(tail -3 "$work/apt-$1.log")"; return 1; }
  has "$2"
}
has oha || { log "installing oha"; cargo install oha --locked || die "cannot install oha"; }
has curl || die "curl is needed"
has python3 || die "python3 is needed (bench/hotset.py, bench/report.py)"
enabled nginx && { install_pkg nginx nginx || drop_system nginx "nginx could not be installed"; }
enabled varnish && { install_pkg varnish varnishd || drop_system varnish "varnish could not be installed"; }
redis_ok=1
[[ "$scenarios" != *" fleet "* ]] || install_pkg redis-server redis-server || redis_ok=0

# The commit the binaries are built from (other work may commit during the run).
head=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no -- Cargo.toml Cargo.lock crates bench/src 2>/dev/null)" ] ||
  head="$head with uncommitted changes"
if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then commit="built from commit $head"
else commit="already in target/release, not rebuilt (HEAD $head)"; fi
if [ "${BENCH_NO_BUILD:-0}" != 1 ]; then
  log "cargo build --release -p corral -p corral-bench"
  cargo build --release -q -p corral -p corral-bench || die "build failed"
fi
[ -x target/release/demo-origin ] || die "target/release/demo-origin is missing"
if enabled corral && [ ! -x target/release/corral ]; then drop_system corral "target/release/corral is missing"; fi
[ ${#systems[@]} -gt 0 ] || die "no system to measure"

start_origin || die "demo origin did not start"
for s in "${systems[@]}"; do
  case $s in
    corral) start_corral corral single.yaml.tmpl "${port[corral]}" 9150 || drop_system corral "did not start" ;;
    nginx) start_nginx nginx "${port[nginx]}" || drop_system nginx "did not start" ;;
    varnish) start_varnish varnish "${port[varnish]}" 6152 || drop_system varnish "did not start" ;;
  esac
done
tag=$$ # keys of this run, so a rerun never finds them cached

# --------------------------------------------------- (a) cache hit
if [[ "$scenarios" == *" hit "* ]]; then
  for size in 1024 65536; do
    for run in $(seq "$runs"); do
      for s in $(order "$run"); do
        path="/$s/hit/$size-$tag"
        url="http://127.0.0.1:${port[$s]}$path?max-age=86400&size=$size"
        curl -s -o /dev/null "$url"; curl -s -o /dev/null "$url"
        out=hit-$size-$s-$run.json
        log "(a) hit ${size} B: $s run $run"
        oha_measured "$s" "$raw/$out" $((secs + 20)) -z "$duration" -c 50 "$url"
        record "{\"scenario\":\"hit\",\"size\":$size,\"system\":\"$s\",\"run\":$run,\"oha\":[\"$out\"],\"origin_hits\":$(hits "$path"),$cpu_json}"
      done
    done
  done
fi

# ------------------------------------------- (a2) cache hit at capacity
# oha spends about as much CPU on an answer as the server does, so in (a)
# oha's core is full first and the servers are measured below capacity.
# capacity-load (bench/src/bin/capacity-load.rs) does little per answer:
# each server's core runs full, and req/s, p99 and CPU per answer are the
# server's own.
if [[ "$scenarios" == *" capacity "* ]]; then
  if [ ! -x target/release/capacity-load ]; then
    log "target/release/capacity-load is missing: (a2) skipped (cargo build --release -p corral-bench)"
  else
    for size in 1024 65536; do
      for run in $(seq "$runs"); do
        for s in $(order "$run"); do
          path="/$s/capacity/$size-$tag"
          target="$path?max-age=86400&size=$size"
          curl -s -o /dev/null "http://127.0.0.1:${port[$s]}$target"
          curl -s -o /dev/null "http://127.0.0.1:${port[$s]}$target"
          out=capacity-$size-$s-$run.json
          log "(a2) hit at capacity ${size} B: $s run $run"
          measured "$s" capacity_run "$raw/$out" $((secs + 20)) "${port[$s]}" "$target"
          record "{\"scenario\":\"capacity\",\"size\":$size,\"system\":\"$s\",\"run\":$run,\"capacity\":\"$out\",\"origin_hits\":$(hits "$path"),$cpu_json}"
        done
      done
    done
  fi
fi

# --------------------------------------------------- (b) stampede on a cold key
if [[ "$scenarios" == *" stampede "* ]]; then
  for run in $(seq "$runs"); do
    for s in $(order "$run"); do
      path="/$s/stampede/$run-$tag"
      out=stampede-$s-$run.json
      calm "$s"
      log "(b) stampede: $s run $run"
      oha_run "$raw/$out" 60 -n 1000 -c 1000 -t 30s \
        "http://127.0.0.1:${port[$s]}$path?delay=200&max-age=60&size=1024"
      sleep 0.3
      record "{\"scenario\":\"stampede\",\"system\":\"$s\",\"run\":$run,\"oha\":[\"$out\"],\"origin_hits\":$(hits "$path")}"
    done
  done
fi

# ------------------------------- (b2) time to first byte of a slow, large miss
# 1000 callers at once on a cold key whose 5 MB answer the origin trickles
# out over 2 s: does each caller get bytes as they arrive, or only once the
# whole answer is in?
if [[ "$scenarios" == *" ttfb "* ]]; then
  for run in $(seq "$runs"); do
    for s in $(order "$run"); do
      path="/$s/ttfb/$run-$tag"
      out=ttfb-$s-$run.json
      calm "$s"
      log "(b2) ttfb: $s run $run"
      timeout -k 5 90 "${on_client[@]}" "$root/target/release/ttfb-load" "127.0.0.1:${port[$s]}" \
        "$path?size=5242880&trickle=2000&max-age=60" 1000 60 >"$raw/$out" 2>"$raw/$out.err" ||
        log "ttfb-load exited $?: $(head -c 300 "$raw/$out.err")"
      sleep 0.3
      record "{\"scenario\":\"ttfb\",\"system\":\"$s\",\"run\":$run,\"ttfb\":\"$out\",\"origin_hits\":$(hits "$path")}"
    done
  done
fi

# --------------------------------------------------- (c) five instances
if [[ "$scenarios" == *" fleet "* ]]; then
  fleet=()
  if enabled corral; then
    if [ $redis_ok = 1 ] && start_redis; then
      ok=1
      for i in 0 1 2 3 4; do
        start_corral "corral-fleet$i" fleet.yaml.tmpl $((fleet_base[corral] + i)) $((9160 + i)) || ok=0
      done
      if [ $ok = 1 ]; then fleet+=(corral); else log "(c) corral fleet did not start: skipped"; fi
    else
      log "(c) no redis-server: corral fleet skipped"
      record '{"scenario":"skip","system":"corral fleet","reason":"redis-server missing"}'
    fi
  fi
  if enabled nginx; then
    ok=1
    for i in 0 1 2 3 4; do start_nginx "nginx-fleet$i" $((fleet_base[nginx] + i)) || ok=0; done
    if [ $ok = 1 ]; then fleet+=(nginx); else log "(c) nginx fleet did not start: skipped"; fi
  fi
  for run in $(seq "$runs"); do
    for s in "${fleet[@]}"; do
      path="/$s-fleet/$run-$tag"
      log "(c) five instances: $s run $run"
      outs=() bg=()
      for i in 0 1 2 3 4; do
        out=fleet-$s-$run-$i.json
        outs+=("\"$out\"")
        oha_run "$raw/$out" 60 -n 200 -c 200 -t 30s \
          "http://127.0.0.1:$((fleet_base[$s] + i))$path?delay=300&max-age=60&size=1024" &
        bg+=($!)
      done
      wait "${bg[@]}"
      sleep 0.3
      leases=null
      [ "$s" != corral ] || leases=$(redis-cli -p $REDIS_PORT --scan --pattern '*lease*' | wc -l)
      record "{\"scenario\":\"fleet\",\"system\":\"$s\",\"run\":$run,\"oha\":[$(IFS=,; echo "${outs[*]}")],\"origin_hits\":$(hits "$path"),\"leases_left\":$leases}"
    done
  done
  stop $(printf 'corral-fleet%s nginx-fleet%s ' 0 0 1 1 2 2 3 3 4 4) redis
fi

# --------------------------------------------------- (d) hot set, Zipf over 10,000 keys
if [[ "$scenarios" == *" hotset "* ]]; then
  for run in $(seq "$runs"); do
    for s in "${systems[@]}"; do
      python3 "$bench/hotset.py" "http://127.0.0.1:${port[$s]}/$s/hot/$run-$tag" >"$work/urls-$s-$run.txt"
    done
  done
  for run in $(seq "$runs"); do
    for s in $(order "$run"); do
      out=hotset-$s-$run.json
      log "(d) hot set (cold start): $s run $run"
      oha_measured "$s" "$raw/$out" $((secs + 30)) -z "$duration" -c 50 --urls-from-file "$work/urls-$s-$run.txt"
      stats=$(curl -s "http://$ORIGIN/__stats?prefix=/$s/hot/$run-$tag/")
      read -r h p m <<<"$(sed -E 's/hits=([0-9]+) paths=([0-9]+) max=([0-9]+)/\1 \2 \3/' <<<"$stats")"
      record "{\"scenario\":\"hotset\",\"system\":\"$s\",\"run\":$run,\"oha\":[\"$out\"],\"origin_hits\":${h:-null},\"keys_fetched\":${p:-null},\"max_per_key\":${m:-null},$cpu_json}"
    done
  done
fi

# --------------------------------------------------- (e) failing origin
if [[ "$scenarios" == *" failing "* ]]; then
  for run in $(seq "$runs"); do
    for s in $(order "$run"); do
      path="/$s/failing/$run-$tag"
      url="http://127.0.0.1:${port[$s]}$path?max-age=1&sie=60&size=1024"
      calm "$s" # the fill must not be shed
      fill=$(curl -s -o /dev/null -w '%{http_code}' "$url")
      sleep 2 # past max-age=1: stale from here on
      outage 503
      before=$(hits "$path")
      out=failing-$s-$run.json
      log "(e) failing origin: $s run $run"
      (sleep $((secs / 2)); sample_headers "$url" "$raw/failing-$s-$run.headers") &
      sampler=$!
      oha_run "$raw/$out" $((secs + 20)) -z "$duration" -c 50 "$url"
      wait $sampler
      after=$(hits "$path")
      outage off
      record "{\"scenario\":\"failing\",\"system\":\"$s\",\"run\":$run,\"oha\":[\"$out\"],\"fill_status\":\"$fill\",\"origin_hits\":$((after - before)),\"headers\":\"failing-$s-$run.headers\"}"
    done
  done
fi

# --------------------------------------------------- (f) stale-while-revalidate, 2 s origin
if [[ "$scenarios" == *" swr "* ]]; then
  for run in $(seq "$runs"); do
    for s in $(order "$run"); do
      path="/$s/swr/$run-$tag"
      url="http://127.0.0.1:${port[$s]}$path?delay=2000&max-age=1&swr=30&size=1024"
      calm "$s" # the fill must not be shed
      fill=$(curl -s -o /dev/null -w '%{http_code}' "$url") # takes 2 s
      sleep 2 # past max-age=1, within swr=30
      before=$(hits "$path")
      out=swr-$s-$run.json
      log "(f) stale-while-revalidate: $s run $run"
      (sleep $((secs / 2)); sample_headers "$url" "$raw/swr-$s-$run.headers") &
      sampler=$!
      oha_run "$raw/$out" $((secs + 20)) -z "$duration" -c 50 "$url"
      wait $sampler
      after=$(hits "$path")
      record "{\"scenario\":\"swr\",\"system\":\"$s\",\"run\":$run,\"oha\":[\"$out\"],\"fill_status\":\"$fill\",\"origin_hits\":$((after - before)),\"headers\":\"swr-$s-$run.headers\"}"
    done
  done
fi

# --------------------------------------------------------------- report
for n in "${!pid_of[@]}"; do
  kill -0 "${pid_of[$n]}" 2>/dev/null || log "warning: $n exited during the run: $(tail -3 "$work/$n.log")"
done
for s in corral nginx varnish; do [ ! -s "$work/$s.log" ] || cp "$work/$s.log" "$raw/$s.log"; done
[ ! -s "$work/nginx/error.log" ] || cp "$work/nginx/error.log" "$raw/nginx-error.log"
out_md=${BENCH_OUT:-$results/latest.md}
python3 "$bench/report.py" "$raw" "$out_md" --elapsed "$SECONDS" --duration "$duration" \
  --commit "$commit" ||
  die "report failed"
log "wrote $out_md in ${SECONDS}s"
