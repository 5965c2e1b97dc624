#!/usr/bin/env bash
# The CPU pool: what a fill's compression costs the hits beside it, and
# what a miss nobody reads compressed pays.
#
#   bench/cpu_pool.sh            # needs target/release/corral, nginx, curl, python3
#
# 1. Hit latency during a large compressed fill. corral runs one worker
#    (`server.runtime: per_core`, `workers: 1`) on a route with
#    `compression: { encodings: [br, gzip, zstd] }`. One connection asks a
#    small stored key every 2 ms (keep-alive, one request at a time) while
#    another fetches a cold 13 MB JSON answer accepting every coding (so
#    every coding is made as it arrives). Printed: the hits' max, p99 and
#    p50 latency while the fill ran, for `cpu_threads` 0 (every job on the
#    serving thread, as before the pool) and the default (half the cores),
#    then the same with `runtime: shared` and two workers.
# 2. Compression CPU per 8 MB miss: corral's CPU time (utime + stime from
#    /proc) for a cold 8 MB JSON key asked by a HEAD (accepting every
#    coding), by a GET accepting none, and by a GET accepting every coding
#    (what every miss paid before codings were made on demand), with the
#    bytes compressed (corral_compression_bytes_in_total, all codings).
# 3. A flood of large misses beside a victim's new connections. An
#    attacker on two connections asks cold 8 MB keys (a new query each,
#    so each is a miss) as fast as they come back, for 10 s: by HEAD, and
#    then by GET accepting every coding (each such fill makes every
#    coding as it arrives). Meanwhile a victim opens a new connection
#    every 100 ms and asks the small key once. Printed: the victim's
#    answers by status (000: refused or reset), what corral counted as
#    shed (corral_overload_shed_total), the attacker's misses, and the
#    CPU pool's jobs, with `server.overload` at its default (90%).
# Loopback only: ports 3981 (origin), 8281/9281 (corral).
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in nginx curl python3; do
  command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done
bin=${CORRAL_BIN:-target/release/corral}
[ -x "$bin" ] || { echo "build first: cargo build --release -p corral" >&2; exit 1; }
work=$(mktemp -d /tmp/corral-cpu-pool.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
user_line=""
[ "$(id -u)" -ne 0 ] || user_line="user root;"

# The documents: small.json (1 KiB), and 13 MB / 8 MB JSON arrays of
# records (compressible as real API answers are: about 8:1 with gzip).
python3 - "$work/docs" <<'PY'
import json, os, random, sys
out = sys.argv[1]
os.makedirs(out)
rnd = random.Random(47)
words = "cache proxy origin stampede flight lease redis entry vary stale fresh".split()
def doc(target):
    records, size = [], 2
    while size < target:
        r = {"id": rnd.randrange(10**9), "name": " ".join(rnd.choice(words) for _ in range(3)),
             "price": round(rnd.uniform(0, 1000), 2), "tags": rnd.sample(words, 3),
             "active": rnd.random() < 0.5}
        records.append(r)
        size += len(json.dumps(r)) + 1
    return json.dumps({"items": records})
open(os.path.join(out, "small.json"), "w").write(doc(1024))
open(os.path.join(out, "big13.json"), "w").write(doc(13_000_000))
open(os.path.join(out, "big8.json"), "w").write(doc(8_000_000))
PY

mkdir -p "$work/nginx/tmp"
cat >"$work/nginx/nginx.conf" <<NGINX
$user_line
worker_processes 1;
daemon off;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $work/nginx/tmp/client;
  proxy_temp_path $work/nginx/tmp/proxy;
  fastcgi_temp_path $work/nginx/tmp/fastcgi;
  uwsgi_temp_path $work/nginx/tmp/uwsgi;
  scgi_temp_path $work/nginx/tmp/scgi;
  server {
    listen 127.0.0.1:3981;
    location / { root $work/docs; default_type application/json; add_header Cache-Control "max-age=86400"; }
  }
}
NGINX
nginx -p "$work/nginx/" -c "$work/nginx/nginx.conf" -e "$work/nginx/error.log" &
pids+=($!)
ready() { for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }
ready http://127.0.0.1:3981/small.json

start_corral() { # cpu_threads line (may be empty) [runtime] [workers] -> pid in $corral_pid
  cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8281
admin: 127.0.0.1:9281
server:
  runtime: ${2:-per_core}
  workers: ${3:-1}
  $1
cache: { memory: 512MiB, max_object_size: 32MiB, fill_memory: 256MiB }
routes:
  - name: bench
    upstream: http://127.0.0.1:3981
    compression: { encodings: [br, gzip, zstd] }
YAML
  CORRAL_LOG=warn "$bin" serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
  corral_pid=$!
  pids+=("$corral_pid")
  ready http://127.0.0.1:9281/healthz
}
stop_corral() { kill -INT "$corral_pid"; wait "$corral_pid" 2>/dev/null || true; }
metricf() { curl -sf http://127.0.0.1:9281/metrics | awk -v n="$1" -v l="$2" '$1 ~ "^"n"[{ ]" && $1 ~ l { s += $NF } END { printf "%.3f", s }'; }
metricn() { curl -sf http://127.0.0.1:9281/metrics | awk -v n="$1" '$1 ~ "^"n"[{ ]" { s += $NF } END { printf "%d", s }'; } # a counter, summed
cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; } # utime + stime, clock ticks

probe() { # label: small hits every 2 ms on one connection while the 13 MB fill runs
  python3 - "$1" <<'PY'
import http.client, sys, threading, time
label = sys.argv[1]
c = http.client.HTTPConnection("127.0.0.1", 8281)
for _ in range(3):  # stored, then warm
    c.request("GET", "/small.json"); c.getresponse().read()
done = threading.Event()
took = []
def fill():
    f = http.client.HTTPConnection("127.0.0.1", 8281, timeout=120)
    f.request("GET", "/big13.json", headers={"Accept-Encoding": "br, gzip, zstd"})
    r = f.getresponse()
    n = len(r.read())
    took.append((time.monotonic(), n, r.getheader("content-encoding")))
    done.set()
lat = []
t = threading.Thread(target=fill)
started = time.monotonic()
t.start()
while not done.is_set() and time.monotonic() - started < 120:
    s = time.monotonic()
    c.request("GET", "/small.json")
    r = c.getresponse(); r.read()
    lat.append((time.monotonic() - s) * 1000)
    time.sleep(max(0, 0.002 - (time.monotonic() - s)))
t.join()
lat.sort()
fill_s = took[0][0] - started
p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]
print(f"| {label} | {len(lat)} | {lat[-1]:.1f} | {p(0.99):.1f} | {p(0.5):.2f} | {fill_s:.2f} ({took[0][2]}) |")
PY
}

echo "## Hit latency while a 13 MB JSON answer is filled and compressed (br, gzip, zstd)"
echo
echo "Hits of a 1 KiB key every 2 ms on one connection; ms."
echo
echo "| runtime, cpu_threads | hits | max | p99 | p50 | fill s (coding) |"
echo "| --- | --- | --- | --- | --- | --- |"
for runtime in "per_core 1" "shared 2"; do
  set -- $runtime
  for threads in 0 default; do
    line=""
    [ "$threads" = default ] || line="cpu_threads: $threads"
    start_corral "$line" "$1" "$2"
    probe "$1 ×$2, $threads"
    stop_corral
  done
done

miss() { # label method accept path
  start_corral ""
  local before after
  before=$(cpu "$corral_pid")
  local args=(-sf -o /dev/null)
  [ "$2" != HEAD ] || args+=(-I)
  [ -z "$3" ] || args+=(-H "Accept-Encoding: $3")
  curl "${args[@]}" "http://127.0.0.1:8281/$4"
  sleep 1 # a coding made on demand, if any, has ended
  after=$(cpu "$corral_pid")
  comp=$(metricf corral_compression_bytes_in_total 'coding=')
  stop_corral
  awk -v l="$1" -v b="$before" -v a="$after" -v hz="$(getconf CLK_TCK)" -v c="$comp" \
    'BEGIN { printf "| %s | %.2f | %.1f |\n", l, (a - b) / hz, c / 1e6 }'
}
echo
echo "## CPU per 8 MB miss (corral's whole process, and its compression jobs)"
echo
echo "| miss | process CPU s | MB compressed |"
echo "| --- | --- | --- |"
miss "HEAD, Accept-Encoding: br, gzip, zstd" HEAD "br, gzip, zstd" big8.json
miss "GET, no Accept-Encoding" GET "" big8.json
miss "GET, Accept-Encoding: br, gzip, zstd (every coding made)" GET "br, gzip, zstd" big8.json

flood() { # label method accept
  start_corral "" per_core 1
  python3 - "$1" "$2" "$3" <<'PY'
import http.client, socket, sys, threading, time
label, method, accept = sys.argv[1], sys.argv[2], sys.argv[3]
stop = time.monotonic() + 10
asked = [0]
def attacker(n):
    c = http.client.HTTPConnection("127.0.0.1", 8281, timeout=60)
    i = 0
    while time.monotonic() < stop:
        i += 1
        c.request(method, f"/big8.json?a={n}-{i}", headers={"Accept-Encoding": accept})
        c.getresponse().read()
        asked[0] += 1
threads = [threading.Thread(target=attacker, args=(n,)) for n in range(2)]
for t in threads: t.start()
statuses = {}
while time.monotonic() < stop:
    s = time.monotonic()
    try:
        v = http.client.HTTPConnection("127.0.0.1", 8281, timeout=5)
        v.request("GET", "/small.json")
        r = v.getresponse(); r.read()
        code = str(r.status)
        v.close()
    except (OSError, http.client.HTTPException):
        code = "000"
    statuses[code] = statuses.get(code, 0) + 1
    time.sleep(max(0, 0.1 - (time.monotonic() - s)))
for t in threads: t.join()
shown = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
print(f"| {label} | {shown} |", end="")
print(f" {asked[0]} |", end="")
PY
  echo " $(metricn corral_overload_shed_total) | $(metricn corral_cpu_jobs_total) |"
  stop_corral
}
echo
echo "## A flood of 8 MB misses beside a victim's new connections (10 s, one worker)"
echo
echo "| attacker | victim's answers | attacker's misses | shed | CPU pool jobs |"
echo "| --- | --- | --- | --- | --- |"
curl -sf -o /dev/null http://127.0.0.1:3981/small.json
flood "HEAD, Accept-Encoding: br, gzip, zstd" HEAD "br, gzip, zstd"
flood "GET, Accept-Encoding: br, gzip, zstd" GET "br, gzip, zstd"
