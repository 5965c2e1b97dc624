#!/usr/bin/env bash
# TLS to the upstream, HTTP/1.1 pool vs one h2 connection: requests
# corral passes through (cache off) to an nginx origin over TLS, 1 KiB
# answers, 64 connections, 10 s per run, RUNS runs each (default 3).
# corral on core 0; nginx (1 worker) and oha on core 1. Loopback only;
# every load bounded (oha -z under timeout). Needs oha, nginx, openssl.
#
#   bench/upstream_tls.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
export PATH=$PATH:/usr/sbin
cargo build --release -q -p corral
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
on_server=() on_client=()
if [ "$(nproc)" -ge 2 ]; then on_server=(taskset -c 0) on_client=(taskset -c 1); fi

# A CA, and a certificate for localhost it signs.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=bench-ca -keyout "$work/ca.key" -out "$work/ca.pem" >/dev/null 2>&1
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
  -keyout "$work/key.pem" -out "$work/leaf.csr" >/dev/null 2>&1
printf 'subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n' >"$work/ext"
openssl x509 -req -in "$work/leaf.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" -CAcreateserial \
  -days 2 -extfile "$work/ext" -out "$work/cert.pem" >/dev/null 2>&1
body=$(head -c 1024 /dev/zero | tr '\0' x)
cat >"$work/nginx.conf" <<NGINX
worker_processes 1;
pid $work/nginx.pid;
error_log $work/nginx.err;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:3943 ssl http2;
    ssl_certificate $work/cert.pem;
    ssl_certificate_key $work/key.pem;
    location / { return 200 "$body"; }
  }
}
NGINX
"${on_client[@]}" nginx -c "$work/nginx.conf" -g 'daemon off;' &
pids+=($!)
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:8143
admin: 127.0.0.1:9143
cache: { memory: 64MiB }
routes:
  - name: h1
    match: { path_prefix: /h1 }
    upstream: https://localhost:3943
    tls: { ca_file: $work/ca.pem }
    cache: { enabled: false }
  - name: h2
    match: { path_prefix: /h2 }
    upstream: https://localhost:3943
    tls: { ca_file: $work/ca.pem }
    upstream_http2: true
    cache: { enabled: false }
YAML
CORRAL_LOG=warn "${on_server[@]}" target/release/corral serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
pids+=($!)
deadline=$((SECONDS + 20))
until curl -sf -o /dev/null http://127.0.0.1:8143/h1/x && curl -sf -o /dev/null http://127.0.0.1:8143/h2/x; do
  [ $SECONDS -lt $deadline ] || { echo "not ready"; cat "$work/corral.log" "$work/nginx.err"; exit 1; }
  sleep 0.2
done
rps() {
  local out=$work/oha.json
  timeout -k 5 30 "${on_client[@]}" oha --no-tui --worker-threads 1 -c 64 -z 10s \
    --output-format json -o "$out" "$1" >/dev/null 2>&1 || true
  python3 -c "
import json
d=json.load(open('$out')); s=d['summary']; p=d['latencyPercentiles']
print(f\"{s['requestsPerSec']:.0f} req/s  p50 {p['p50']*1000:.2f} ms  p99 {p['p99']*1000:.2f} ms  statuses {d.get('statusCodeDistribution',{})}\")"
}
conns() { ss -tn state established "( dport = :3943 )" | tail -n +2 | wc -l; }
for run in $(seq 1 "$runs"); do
  for proto in h1 h2; do
    echo "run $run  $proto: $(rps "http://127.0.0.1:8143/$proto/x")  upstream connections after: $(conns)"
  done
done
