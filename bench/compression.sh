#!/usr/bin/env bash
# Compression (issue 29): what corral's store-time compression costs and
# saves on a JSON corpus, and a compressed hit against nginx's `gzip on`
# in front of proxy_cache (which compresses on every hit).
#
#   bench/compression.sh            # needs target/release/corral, nginx, oha, curl, python3
#
# 1. Cost and ratio. A corpus of 100 JSON documents (4 to 64 KiB, records
#    of ids, names, tags and numbers) is served by nginx as static files;
#    corral, with one coding at a time (`compression: { encodings: [C],
#    min_size: 0 }`), stores each once; its own counters
#    (corral_compression_bytes_in_total, _bytes_out_total,
#    _microseconds_total) give the ratio and the speed of the real code.
# 2. Hits. One 16 KiB document, `Accept-Encoding: gzip`, 50 keep-alive
#    connections for 10 s with oha; the server on core 0, oha on core 1:
#    corral (`compression:` default, one worker thread) against nginx
#    proxy_cache with `gzip on; gzip_comp_level 6` (the level corral
#    stores at). Prints req/s, the server's CPU seconds per 10k answers
#    and the bytes of one answer.
# Loopback only: ports 3971 (corpus), 8271/9271 (corral), 8272 (nginx).
set -euo pipefail
# Every instance seals what it shares through Redis with this key (a config
# with redis: needs one); the HMAC is part of what is measured.
export CORRAL_REDIS_AUTH_KEY="${CORRAL_REDIS_AUTH_KEY:-bench-fleet-key-0123456789abcdef0123}"
cd "$(dirname "$0")/.."
for tool in nginx oha curl python3 taskset; do
  command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done
[ -x target/release/corral ] || { echo "build first: cargo build --release -p corral" >&2; exit 1; }
work=$(mktemp -d /tmp/corral-compression.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
user_line=""
[ "$(id -u)" -ne 0 ] || user_line="user root;"

python3 - "$work/corpus" <<'PY'
import json, os, random, sys
out = sys.argv[1]
os.makedirs(out)
rnd = random.Random(29)
words = "cache proxy origin stampede flight lease redis entry vary stale fresh".split()
for i in range(100):
    target = 4096 + (i * 61440) // 99
    records, size = [], 2
    while size < target:
        r = {"id": rnd.randrange(10**9), "name": " ".join(rnd.choice(words) for _ in range(3)),
             "price": round(rnd.uniform(0, 1000), 2), "tags": rnd.sample(words, 3),
             "active": rnd.random() < 0.5}
        records.append(r)
        size += len(json.dumps(r)) + 1
    with open(os.path.join(out, f"{i}.json"), "w") as f:
        json.dump({"items": records, "page": i}, f)
PY

ready() { for _ in $(seq 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done; echo "no answer from $1" >&2; return 1; }

# The corpus origin, and nginx's own proxy_cache + gzip in front of it.
mkdir -p "$work/nginx/tmp" "$work/nginx/cache"
cat >"$work/nginx/nginx.conf" <<NGINX
$user_line
worker_processes 1;
daemon off;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx/tmp/client;
  proxy_temp_path $work/nginx/tmp/proxy;
  fastcgi_temp_path $work/nginx/tmp/fastcgi;
  uwsgi_temp_path $work/nginx/tmp/uwsgi;
  scgi_temp_path $work/nginx/tmp/scgi;
  proxy_cache_path $work/nginx/cache levels=1:2 keys_zone=c:16m max_size=256m;
  server {
    listen 127.0.0.1:3971;
    location / { root $work/corpus; default_type application/json; add_header Cache-Control "max-age=86400"; }
  }
  server {
    listen 127.0.0.1:8272;
    gzip on; gzip_comp_level 6; gzip_types application/json; gzip_proxied any; gzip_min_length 1024;
    location / { proxy_pass http://127.0.0.1:3971; proxy_http_version 1.1; proxy_cache c; }
  }
}
NGINX
taskset -c 0 nginx -p "$work/nginx/" -c "$work/nginx/nginx.conf" -e "$work/nginx/error.log" &
pids+=($!)
ready http://127.0.0.1:3971/0.json

start_corral() { # compression yaml -> pid in $corral_pid
  cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8271
admin: 127.0.0.1:9271
cache: { memory: 256MiB }
routes:
  - name: bench
    upstream: http://127.0.0.1:3971
    compression: $1
YAML
  CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 taskset -c 0 target/release/corral serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
  corral_pid=$!
  pids+=("$corral_pid")
  ready http://127.0.0.1:9271/healthz
}
stop_corral() { kill -INT "$corral_pid"; wait "$corral_pid" 2>/dev/null || true; }
metric() { curl -sf http://127.0.0.1:9271/metrics | awk -v n="$1" '$1 ~ "^"n"[{ ]" { s += $NF } END { printf "%.0f", s }'; }
metricf() { curl -sf http://127.0.0.1:9271/metrics | awk -v n="$1" '$1 ~ "^"n"[{ ]" { s += $NF } END { printf "%.6f", s }'; }

echo "## Store-time compression of a JSON corpus (100 documents, $(du -sk "$work/corpus" | cut -f1) KiB)"
echo
echo "| coding | ratio (in / out) | MB/s compressed (one core) |"
echo "| --- | --- | --- |"
for coding in gzip br zstd; do
  start_corral "{ encodings: [$coding], min_size: 0 }"
  for i in $(seq 0 99); do curl -sf -o /dev/null "http://127.0.0.1:8271/$i.json"; done
  in=$(metric corral_compression_bytes_in_total)
  out=$(metric corral_compression_bytes_out_total)
  secs=$(metricf corral_compression_duration_seconds_sum)
  stop_corral
  awk -v c="$coding" -v i="$in" -v o="$out" -v t="$secs" \
    'BEGIN { printf "| %s | %.2f | %.0f |\n", c, i / o, i / t / 1e6 }'
done

cpu() { awk '{ print $14 + $15 }' "/proc/$1/stat"; } # utime + stime, clock ticks
hits() { # name url pid
  local url=$2 pid=$3 before after
  curl -sf -o /dev/null -H 'Accept-Encoding: gzip' "$url" # the miss
  curl -sf -o /dev/null -H 'Accept-Encoding: gzip' "$url"
  bytes=$(curl -sf -H 'Accept-Encoding: gzip' "$url" | wc -c)
  before=$(cpu "$pid")
  timeout 60 taskset -c 1 oha --no-tui --worker-threads 1 --output-format json -o "$work/oha.json" \
    -z 10s -c 50 -H 'Accept-Encoding: gzip' "$url" >/dev/null
  after=$(cpu "$pid")
  python3 - "$1" "$bytes" "$before" "$after" "$(getconf CLK_TCK)" "$work/oha.json" <<'PY'
import json, sys
name, size, b, a, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
r = json.load(open(sys.argv[6]))
n = sum(r["statusCodeDistribution"].values())
rps = r["summary"]["requestsPerSec"]
print(f"| {name} | {rps:,.0f} | {(a - b) / hz / n * 10000:.2f} | {size} |")
PY
}
echo
echo "## A compressed 16 KiB hit (Accept-Encoding: gzip)"
echo
echo "| server | req/s | CPU s per 10k answers | bytes per answer |"
echo "| --- | --- | --- | --- |"
doc=20.json # about 16.5 KiB
start_corral "{}"
hits corral "http://127.0.0.1:8271/$doc" "$corral_pid"
stop_corral
worker=$(pgrep -P "${pids[0]}" | head -1)
hits "nginx gzip on" "http://127.0.0.1:8272/$doc" "$worker"
