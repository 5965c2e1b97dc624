#!/usr/bin/env bash
# corral's memory benchmark: is `cache.memory` a real bound?
#
#   bench/memory.sh [KEYS] [MEMORY]        (defaults: 1000000 keys, 64MiB)
#
# Starts the demo origin and one release corral with `cache.memory: MEMORY`,
# sends KEYS GETs of distinct, cacheable keys, each with 1 KiB of request
# headers (bench/src/bin/memory-load.rs, 32 keep-alive connections), and
# prints corral's resident memory (RSS) every tenth of the way, its L1 and
# side-table bytes from /metrics, and the verdict against the target
# RSS <= MEMORY + 64 MiB. Loopback only; the load is bounded by KEYS and by
# `timeout`. Knob: BENCH_NO_BUILD=1 uses the binaries in target/release.
set -euo pipefail
cd "$(dirname "$0")/.."
keys=${1:-1000000}
memory=${2:-64MiB}
origin_port=3960
port=8190
admin=9190

if [ -z "${BENCH_NO_BUILD:-}" ]; then
  cargo build --release --locked -p corral -p corral-bench >&2
fi
work=$(mktemp -d /tmp/corral-memory.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

target/release/demo-origin "127.0.0.1:$origin_port" >"$work/origin.log" 2>&1 &
pids+=($!)
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:$port
admin: 127.0.0.1:$admin
cache: { memory: $memory, max_object_size: 1MiB }
routes:
  - name: memory
    match: { path_prefix: / }
    upstream: http://127.0.0.1:$origin_port
YAML
CORRAL_LOG=warn target/release/corral serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
corral=$!
pids+=($corral)
for _ in $(seq 100); do
  curl -fsS "http://127.0.0.1:$admin/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
idle=$(awk '/VmRSS/ {printf "%.1f", $2/1024}' "/proc/$corral/status")
echo "corral $(git rev-parse --short HEAD), cache.memory $memory, $keys keys with 1 KiB request headers"
echo "rss_mib at start: $idle"
timeout 1800 target/release/memory-load "127.0.0.1:$port" "$corral" "$keys" 32 1024 | tee "$work/load.tsv"
metrics=$(curl -fsS "http://127.0.0.1:$admin/metrics")
grep -E '^corral_(l1_entries|l1_bytes|l1_side_bytes|fill_buffer_bytes) ' <<<"$metrics" || true
python3 - "$memory" "$work/load.tsv" <<'PY'
import re, sys
units = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}
m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", sys.argv[1])
memory = int(m.group(1)) * units[m.group(2)] if m else int(sys.argv[1]) / 2**20
peak = float([l.split("\t")[1] for l in open(sys.argv[2]) if l.startswith("peak_rss_mib")][0])
target = memory + 64
verdict = "met" if peak <= target else "MISSED"
print(f"peak RSS {peak:.1f} MiB vs cache.memory {memory:.0f} MiB + 64 MiB = {target:.0f} MiB: {verdict}")
PY
