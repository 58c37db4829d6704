#!/usr/bin/env bash
# Open-loop benchmark of Baton's command service against BullMQ, on one Redis, in one run
# (not part of CI's test run; results go to docs/benchmarks.md by hand).
#
#   bash scripts/bench-bullmq.sh [N [C [ROUNDS]]]   # defaults 20000 64 3; BATCH=100 overrides
#
# The shape of BullMQ's own benchmark, on each side:
#   add:   N jobs / commands added in batches of BATCH, one batch call in flight, nothing
#          consuming (BullMQ: Queue.addBulk; Baton: CommandStore::submit_many);
#   drain: then a consumer with concurrency C and a no-op handler drains them, timed from its
#          start until all N are done in Redis (BullMQ: a Worker, counting its 'completed'
#          events; Baton: a command service, until the queue counts exactly N SUCCEEDED).
# Both sides keep finished jobs (BullMQ's default; Baton keeps SUCCEEDED states).
#
# Starts its own redis-server (no persistence) on a free port, installs BullMQ (pinned in
# scripts/bullmq-bench/package-lock.json) with `npm ci` into $TARGET_DIR/bullmq-bench, builds
# the release `baton`, then runs ROUNDS interleaved rounds — BullMQ (scripts/bullmq-bench/
# bench.mjs), FLUSHALL, Baton (`baton bench commands --open-loop`), FLUSHALL — printing each
# measurement as a JSON line, then the medians side by side with the ratio Baton / BullMQ and
# the Redis calls per job (INFO commandstats; commands that scripts run count too) and the CPU
# per job of redis-server (INFO cpu) and of each side's own process (its rusage), add and drain
# together: on one machine the two share the cores, so CPU per job bounds the rate.
set -euo pipefail

cd "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

N="${1:-20000}"
C="${2:-64}"
ROUNDS="${3:-3}"
BATCH="${BATCH:-100}"
for v in "$N" "$C" "$ROUNDS" "$BATCH"; do
  case "$v" in
    '' | *[!0-9]* | 0) echo "usage: bash scripts/bench-bullmq.sh [N [C [ROUNDS]]] (positive integers; BATCH=n too), got '$v'" >&2; exit 2 ;;
  esac
done
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
mkdir -p "$TARGET_DIR/bench-bullmq"
OUT="$(cd "$TARGET_DIR/bench-bullmq" && pwd)"
log() { printf '==> %s\n' "$*" >&2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

for tool in node npm redis-server redis-cli python3 cargo; do
  command -v "$tool" >/dev/null || { echo "bench-bullmq.sh: $tool is not installed (needed: node 18+, npm, redis-server, redis-cli, python3, cargo)" >&2; exit 2; }
done

log "building baton (release)"
cargo build --quiet --release --locked -p baton --bin baton
BATON="$TARGET_DIR/release/baton"

log "BullMQ (scripts/bullmq-bench, npm ci into $OUT/node)"
NODE_DIR="$OUT/node"
mkdir -p "$NODE_DIR"
cp scripts/bullmq-bench/package.json scripts/bullmq-bench/package-lock.json scripts/bullmq-bench/bench.mjs "$NODE_DIR/"
if ! cmp -s scripts/bullmq-bench/package-lock.json "$NODE_DIR/node_modules/.package-lock.json.installed" 2>/dev/null; then
  if ! (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error >"$OUT/npm.log" 2>&1); then
    echo "bench-bullmq.sh: npm ci failed (is the npm registry reachable?); its output: $OUT/npm.log" >&2
    tail -5 "$OUT/npm.log" >&2
    exit 1
  fi
  cp scripts/bullmq-bench/package-lock.json "$NODE_DIR/node_modules/.package-lock.json.installed"
fi
BULLMQ_VERSION="$(cd "$NODE_DIR" && node -p 'require("bullmq/package.json").version')"

REDIS_PORT="$(free_port)"
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!
cleanup() {
  kill "$REDIS_PID" 2>/dev/null || true
  wait "$REDIS_PID" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 1 100); do
  if redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then break; fi
  sleep 0.1
done
redis-cli -p "$REDIS_PORT" ping >/dev/null || { echo "bench-bullmq.sh: redis-server did not start; see $OUT/redis.log" >&2; exit 1; }
log "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on :$REDIS_PORT; BullMQ $BULLMQ_VERSION, node $(node --version); $(nproc) CPUs; N=$N C=$C batch=$BATCH rounds=$ROUNDS"

RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
# redis-server's CPU seconds so far (user + system).
redis_cpu() { redis-cli -p "$REDIS_PORT" info cpu | tr -d '\r' | awk -F: '/^used_cpu_(user|system|sys):/ { s += $2 } END { printf "%.6f", s }'; }
# Runs a command with its stdout passed on, and writes its CPU seconds (user + system, its
# children included) to the file named first.
cpu_run() {
  python3 -c '
import resource, subprocess, sys
r = subprocess.run(sys.argv[2:]).returncode
u = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write(f"{u.ru_utime + u.ru_stime:.6f}")
sys.exit(r)
' "$@"
}
# Appends the CPU figures of the run that ended to the JSON line on stdin.
with_cpu() {
  python3 -c '
import json, sys
row = json.loads(sys.stdin.read())
n = row["count"]
row["redis_cpu_us_per_job"] = round((float(sys.argv[2]) - float(sys.argv[1])) * 1e6 / n, 2)
row["client_cpu_us_per_job"] = round(float(open(sys.argv[3]).read()) * 1e6 / n, 2)
print(json.dumps(row))
' "$@"
}
for r in $(seq 1 "$ROUNDS"); do
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  log "round $r/$ROUNDS: BullMQ"
  before="$(redis_cpu)"
  line="$(cd "$NODE_DIR" && cpu_run "$OUT/client.cpu" node bench.mjs --port "$REDIS_PORT" --count "$N" \
    --concurrency "$C" --batch "$BATCH")"
  after="$(redis_cpu)"
  printf '%s\n' "$line" | with_cpu "$before" "$after" "$OUT/client.cpu" | tee -a "$RESULTS"
  redis-cli -p "$REDIS_PORT" flushall >/dev/null
  log "round $r/$ROUNDS: Baton"
  before="$(redis_cpu)"
  json="$(cpu_run "$OUT/client.cpu" "$BATON" bench commands --open-loop --redis "redis://127.0.0.1:$REDIS_PORT" \
    --count "$N" --concurrency "$C" --batch "$BATCH" --quiet --json 2>>"$OUT/baton.log")"
  after="$(redis_cpu)"
  printf '%s\n' "$json" |
    python3 -c '
import json, sys
rows = {row["name"]: row for row in json.load(sys.stdin)["results"]}
add, drain = rows["commands add"], rows["commands drain"]
print(json.dumps({"side": "baton", "count": add["ops"], "concurrency": drain["concurrency"],
                  "batch": int(sys.argv[1]),
                  "add_seconds": add["seconds"], "add_per_second": add["ops_per_sec"],
                  "drain_seconds": drain["seconds"], "drain_per_second": drain["ops_per_sec"],
                  "add_calls_per_job": {k: round(v, 3) for k, v in (add["redis_calls_per_op"] or {}).items()},
                  "drain_calls_per_job": {k: round(v, 3) for k, v in (drain["redis_calls_per_op"] or {}).items()}}))
' "$BATCH" | with_cpu "$before" "$after" "$OUT/client.cpu" | tee -a "$RESULTS"
done

python3 - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
side = {s: [r for r in rows if r["side"] == s] for s in ("bullmq", "baton")}
print(f"\nopen loop, {rows[0]['count']} jobs, concurrency {rows[0]['concurrency']}, batch {rows[0]['batch']}, "
      f"rounds: {len(side['baton'])} (median; each round's value in brackets)")
print(f"{'':<22} {'BullMQ':>10} {'Baton':>10} {'Baton/BullMQ':>13}")
for key, label in (("add_per_second", "add (jobs/s)"), ("drain_per_second", "processing (jobs/s)")):
    m = {s: statistics.median(r[key] for r in side[s]) for s in side}
    print(f"{label:<22} {m['bullmq']:>10.0f} {m['baton']:>10.0f} {m['baton'] / m['bullmq']:>13.2f}"
          f"   [BullMQ {', '.join(f'{r[key]:.0f}' for r in side['bullmq'])}; Baton {', '.join(f'{r[key]:.0f}' for r in side['baton'])}]")
print("\nCPU per job, add and drain together (µs; median):")
for key, label in (("redis_cpu_us_per_job", "redis-server"), ("client_cpu_us_per_job", "client process")):
    m = {s: statistics.median(r[key] for r in side[s]) for s in side}
    print(f"  {label:<20} BullMQ {m['bullmq']:>7.1f}   Baton {m['baton']:>7.1f}   Baton/BullMQ {m['baton'] / m['bullmq']:.2f}")
print("\nRedis calls per job (INFO commandstats, last round; commands run by scripts count too):")
for s, label in (("bullmq", "BullMQ"), ("baton", "Baton")):
    last = side[s][-1]
    for phase in ("add", "drain"):
        calls = last[f"{phase}_calls_per_job"]
        each = ", ".join(f"{k} {v:.2f}" for k, v in sorted(calls.items(), key=lambda kv: (-kv[1], kv[0])))
        print(f"  {label:<6} {phase:<5} total {sum(calls.values()):.2f}: {each}")
EOF
