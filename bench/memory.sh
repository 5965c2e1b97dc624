#!/usr/bin/env bash
# corral's memory benchmark: is `cache.memory` a real bound?
#
#   bench/memory.sh [KEYS] [MEMORY]        (defaults: 1000000 keys, 64MiB)
#
# Starts the demo origin and one release corral with `cache.memory: MEMORY`,
# sends KEYS GETs of distinct, cacheable keys, each with 1 KiB of request
# headers (bench/src/bin/memory-load.rs, 32 keep-alive connections), and
# prints corral's resident memory (RSS) every tenth of the way, its L1 and
# side-table bytes from /metrics, what it holds at the end with its memfds
# (sealed bodies, which RSS does not show), and the verdict against the
# target: peak RSS and held memory <= MEMORY + 64 MiB. Loopback only; the load is bounded by KEYS and by
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
grep -E '^corral_(l1_entries|l1_bytes|l1_side_bytes|fill_buffer_bytes|post_buffer_bytes|ahead_buffer_bytes|sealed_bodies|sealed_bytes) ' <<<"$metrics" || true
# What the process holds beyond RSS: sealed bodies are memfds read with
# sendfile, so their pages are in the machine's Shmem, not in VmRSS. Held =
# VmRSS - RssShmem + the size of every memfd it keeps open.
memfd_bytes=0
for fd in /proc/$corral/fd/*; do
  case "$(readlink "$fd" 2>/dev/null)" in
    /memfd:*) memfd_bytes=$((memfd_bytes + $(stat -Lc %s "$fd" 2>/dev/null || echo 0))) ;;
  esac
done
rss_kb=$(awk '/^VmRSS/ {print $2}' "/proc/$corral/status")
shmem_kb=$(awk '/^RssShmem/ {print $2}' "/proc/$corral/status")
held_mib=$(python3 -c "print(f'{($rss_kb - ${shmem_kb:-0}) / 1024 + $memfd_bytes / 2**20:.1f}')")
echo "at end: rss_mib $((rss_kb / 1024)), memfd_mib $((memfd_bytes / 1048576)), held_mib $held_mib (RSS without shared pages, plus memfds)"
echo "held_mib_end	$held_mib" >>"$work/load.tsv"
python3 - "$memory" "$work/load.tsv" <<'PY'
import re, sys
units = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}
m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", sys.argv[1])
memory = int(m.group(1)) * units[m.group(2)] if m else int(sys.argv[1]) / 2**20
lines = open(sys.argv[2]).read().splitlines()
peak = float([l.split("\t")[1] for l in lines if l.startswith("peak_rss_mib")][0])
held = float([l.split("\t")[1] for l in lines if l.startswith("held_mib_end")][0])
target = memory + 64
worst = max(peak, held)
verdict = "met" if worst <= target else "MISSED"
print(f"peak RSS {peak:.1f} MiB, held at end (memfds included) {held:.1f} MiB vs cache.memory {memory:.0f} MiB + 64 MiB = {target:.0f} MiB: {verdict}")
PY
