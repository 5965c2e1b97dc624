#!/usr/bin/env bash
# The public HTTP caching test suite (https://cache-tests.fyi, github.com/
# http-tests/cache-tests) run through corral, and its score counted by the
# suite's own rules: required and optimal tests that pass, required tests
# that fail, informational checks answered yes.
#
#   bench/cache-tests.sh [SUITE_DIR]
#   ROUTE_YAML='cache: { heuristic_freshness: true }' bench/cache-tests.sh DIR
#   SURROGATE=1 bench/cache-tests.sh DIR   # also count Surrogate-Control's tests
#
# SUITE_DIR is a checkout of the suite (default: a fresh shallow clone, which
# needs github.com; `npm install` is run in it when node_modules is missing).
# corral (target/release/corral: cargo build --release -p corral) runs with
# its defaults (64 MiB of cache) and one route to the suite's origin server, both on loopback
# (ports 3970 and 8270/9270, or ORIGIN_PORT, PORT, ADMIN_PORT). The results
# JSON is kept in RESULTS (default /tmp/corral-cache-tests.json). Needs node
# and npm. The suite's command line appends its Surrogate-Control tests; the
# count leaves them out unless SURROGATE=1, as the suite's 365 does.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
suite=${1:-}
origin_port=${ORIGIN_PORT:-3970}
port=${PORT:-8270}
admin_port=${ADMIN_PORT:-9270}
results=${RESULTS:-/tmp/corral-cache-tests.json}
work=$(mktemp -d /tmp/corral-cache-tests.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # Gone before the next run binds the same ports.
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
for tool in node npm curl; do command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }; done
[ -x target/release/corral ] || { echo "build first: cargo build --release -p corral" >&2; exit 1; }
if [ -z "$suite" ]; then
  git clone -q --depth 1 https://github.com/http-tests/cache-tests "$work/suite"
  suite=$work/suite
fi
suite=$(cd "$suite" && pwd)
# The engine (cli.mjs, server/) moved from the suite's root into
# test-engine/ in July 2023; either layout runs.
if [ -f "$suite/test-engine/cli.mjs" ]; then
  engine=$suite/test-engine
else
  engine=$suite
fi
[ -f "$engine/cli.mjs" ] && [ -f "$engine/server/server.mjs" ] && [ -f "$suite/tests/index.mjs" ] \
  || { echo "$suite is not a cache-tests checkout (no cli.mjs, server/server.mjs and tests/index.mjs)" >&2; exit 1; }
[ -d "$suite/node_modules" ] || (cd "$suite" && npm install --no-audit --no-fund --omit=dev >/dev/null)

(cd "$suite" && exec env npm_config_pidfile="$work/origin.pid" npm_config_protocol=http \
  npm_config_port="$origin_port" node "$engine/server/server.mjs") >"$work/origin.log" 2>&1 &
pids+=($!)
cat >"$work/corral.yaml" <<YAML
listen: 127.0.0.1:$port
admin: 127.0.0.1:$admin_port
cache: { memory: 64MiB }
routes:
  - name: cache-tests
    upstream: http://127.0.0.1:$origin_port
$(printf '%s\n' "${ROUTE_YAML:-}" | sed 's/^/    /')
YAML
CORRAL_LOG=warn target/release/corral serve --config "$work/corral.yaml" >"$work/corral.log" 2>&1 &
corral_pid=$!
pids+=("$corral_pid")
for _ in $(seq 100); do
  curl -sf -o /dev/null "http://127.0.0.1:$admin_port/healthz" \
    && curl -s -o /dev/null "http://127.0.0.1:$origin_port/" && break
  sleep 0.1
done
# The corral started here, not another one still on the port.
kill -0 "$corral_pid" 2>/dev/null && curl -sf -o /dev/null "http://127.0.0.1:$admin_port/healthz" \
  || { echo "corral did not start:" >&2; cat "$work/corral.log" >&2; exit 1; }

(cd "$suite" && npm_package_config_id= npm_config_base="http://127.0.0.1:$port" \
  timeout 600 node --no-warnings "$engine/cli.mjs") >"$results"
kill -0 "$corral_pid" 2>/dev/null || { echo "corral exited during the run:" >&2; cat "$work/corral.log" >&2; exit 1; }

cat >"$work/tally.mjs" <<'JS'
// The suite's rules (lib/display.mjs determineTestResult): a required or
// optimal test passes when its result is true; a check says yes or no; a
// test whose dependency did not pass is a dependency failure.
import fs from 'fs'
import { pathToFileURL } from 'url'
const [suite, resultsFile, withSurrogate] = process.argv.slice(2)
const tests = (await import(pathToFileURL(`${suite}/tests/index.mjs`))).default.slice()
if (withSurrogate === '1') tests.push((await import(pathToFileURL(`${suite}/tests/surrogate-control.mjs`))).default)
const results = JSON.parse(fs.readFileSync(resultsFile))
const byId = {}
for (const s of tests) for (const t of s.tests) byId[t.id] = t
function outcome (id) {
  const t = byId[id]
  const r = results[id]
  if (t === undefined || r === undefined) return 'untested'
  for (const d of t.depends_on || []) if (!['pass', 'yes'].includes(outcome(d))) return 'dependency-failure'
  if (r[0] === 'Setup') return 'setup-failure'
  const kind = t.kind || 'required'
  if (kind === 'check') return r === true ? 'yes' : 'no'
  if (r === true) return 'pass'
  return kind === 'required' ? 'FAIL' : 'optimal-miss'
}
const counts = {}
const notable = []
let total = 0
for (const s of tests) {
  for (const t of s.tests) {
    if (t.browser_only) continue
    total++
    const o = outcome(t.id)
    counts[o] = (counts[o] || 0) + 1
    if (['FAIL', 'optimal-miss', 'setup-failure'].includes(o)) {
      notable.push(`${o}\t${t.id}\t${JSON.stringify(results[t.id])}`)
    }
  }
}
console.log(`${total} tests: ${counts.pass || 0} passed, ${counts.FAIL || 0} required failures, ` +
  `${counts.yes || 0} checks yes, ${counts.no || 0} checks no, ${counts['optimal-miss'] || 0} optimal misses, ` +
  `${counts['setup-failure'] || 0} setup failures, ${counts['dependency-failure'] || 0} dependency failures`)
console.log(notable.sort().join('\n'))
JS
node "$work/tally.mjs" "$suite" "$results" "${SURROGATE:-0}"
