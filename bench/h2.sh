#!/usr/bin/env bash
# Cache hits over HTTP/2 (h2c, prior knowledge): req/s of one hot key for
# two corral binaries, alternated, so that a change to how HTTP/2 is
# served can be compared on one machine in one sitting.
#
#   bench/h2.sh BEFORE_BIN AFTER_BIN [runs] [seconds]
#
# Both binaries are release builds; the demo origin is
# target/release/demo-origin (or $DEMO_ORIGIN). corral runs on core 0 with
# one worker, oha on core 1 with one thread (as bench/run.sh does), 50
# connections, each with up to 10 streams at once. Loopback only; every
# load is bounded by -z and `timeout`. Prints one line per run.
set -euo pipefail
before=$1 after=$2 runs=${3:-2} secs=${4:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
origin_bin=${DEMO_ORIGIN:-$root/target/release/demo-origin}
work=$(mktemp -d /tmp/corral-h2-bench.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
pin() { if command -v taskset >/dev/null && [ "$(nproc)" -ge 2 ]; then taskset -c "$1" "${@:2}"; else "${@:2}"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_200() {
  local deadline=$((SECONDS + 20))
  until [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ]; do
    [ $SECONDS -lt $deadline ] || { echo "no 200 from $1" >&2; exit 1; }
    sleep 0.1
  done
}

origin=127.0.0.1:$(free_port)
TOKIO_WORKER_THREADS=1 pin 0 "$origin_bin" "$origin" >"$work/origin.log" 2>&1 &
pids+=($!)
wait_200 "http://$origin/__hits"

measure() { # label binary run
  local port admin pid
  port=$(free_port) admin=$(free_port)
  sed -e "s/@PORT@/$port/" -e "s/@ADMIN_PORT@/$admin/" -e "s/@ORIGIN@/$origin/" \
    "$root/bench/corral/single.yaml.tmpl" >"$work/corral.yaml"
  CORRAL_LOG=warn TOKIO_WORKER_THREADS=1 pin 0 "$2" serve --config "$work/corral.yaml" \
    >"$work/corral-$1-$3.log" 2>&1 &
  pid=$!
  wait_200 "http://127.0.0.1:$admin/healthz"
  local url="http://127.0.0.1:$port/h2/hit-$1-$3?max-age=86400&size=1024"
  curl -s -o /dev/null "$url"
  curl -s -o /dev/null "$url"
  pin 1 timeout -k 5 $((secs + 20)) oha --no-tui --worker-threads 1 --http2 -c 50 -p 10 \
    -z "${secs}s" --output-format json -o "$work/oha.json" "$url" >/dev/null
  python3 - "$work/oha.json" "$1" "$3" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
s = d["summary"]; codes = d.get("statusCodeDistribution", {})
other = sum(v for k, v in codes.items() if k != "200")
print(f"{sys.argv[2]} run {sys.argv[3]}: {s['requestsPerSec']:,.0f} req/s, "
      f"p50 {d['latencyPercentiles']['p50']*1000:.2f} ms, p99 {d['latencyPercentiles']['p99']*1000:.2f} ms, "
      f"non-200 {other}")
PY
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

for run in $(seq "$runs"); do
  if [ $((run % 2)) -eq 1 ]; then
    measure before "$before" "$run"; measure after "$after" "$run"
  else
    measure after "$after" "$run"; measure before "$before" "$run"
  fi
done
