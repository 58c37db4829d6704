#!/usr/bin/env bash
# Benchmark of the HTTP worker protocol against in-process handlers, on one Redis, in one run
# (not part of CI's test run; results go to docs/benchmarks.md by hand).
#
#   bash scripts/bench-workers.sh   # ROUNDS=3 COUNT=5000 CONCURRENCY=64 WORKERS=4 override
#
# Starts its own redis-server (no persistence) and a release `baton serve --no-workers` with a
# queue `bench` (no handlers) on it, then, ROUNDS times in turn:
#   1. `baton bench workers --rounds 1`: COUNT no-op commands drained by a command service in
#      the bench process (CONCURRENCY handlers), then COUNT more drained twice through that
#      `baton serve`'s HTTP worker protocol by a Rust load generator playing WORKERS SDK-style
#      workers that share CONCURRENCY slots (each claims up to its free slots and settles what
#      finished while it claims again: each command in its own request, then everything
#      finished since the last settlement in one request);
#   2. the Python SDK's worker (clients/python/bench.py, concurrency CONCURRENCY) draining COUNT
#      commands of the same queue.
# Prints each measurement as a JSON line, then a summary with the ratios to in-process.
set -euo pipefail

cd "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

ROUNDS="${ROUNDS:-3}"
COUNT="${COUNT:-5000}"
CONCURRENCY="${CONCURRENCY:-64}"
WORKERS="${WORKERS:-4}"
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
OUT="$TARGET_DIR/bench-workers"
mkdir -p "$OUT"
log() { printf '==> %s\n' "$*" >&2; }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

log "building baton (release)"
cargo build --quiet --release --locked -p baton --bin baton
BATON="$TARGET_DIR/release/baton"

log "the Python SDK (clients/python/run-tests.sh's venv)"
VENV="$TARGET_DIR/python-venv"
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e clients/python

REDIS_PORT="$(free_port)"
redis-server --port "$REDIS_PORT" --save "" --appendonly no --daemonize no >"$OUT/redis.log" 2>&1 &
REDIS_PID=$!
PORT="$(free_port)"
cat >"$OUT/baton.toml" <<EOF
[queues.bench]
concurrency = $CONCURRENCY
EOF
env -u BATON_REDIS -u BATON_REDIS_CLUSTER -u BATON_CONFIG -u BATON_ADMIN_TOKEN \
  "$BATON" serve --listen "127.0.0.1:$PORT" --redis "redis://127.0.0.1:$REDIS_PORT" --no-workers \
  --config "$OUT/baton.toml" >"$OUT/serve.out" 2>"$OUT/serve.err" &
SERVER_PID=$!
cleanup() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  kill "$REDIS_PID" 2>/dev/null || true
  wait "$REDIS_PID" 2>/dev/null || true
}
trap cleanup EXIT
for _ in $(seq 1 100); do
  if curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1; then break; fi
  sleep 0.1
done
log "redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/') on :$REDIS_PORT, baton serve on :$PORT; $(nproc) CPUs"

RESULTS="$OUT/results.jsonl"
: >"$RESULTS"
for r in $(seq 1 "$ROUNDS"); do
  log "round $r/$ROUNDS: in-process, then the Rust HTTP worker"
  "$BATON" bench workers --redis "redis://127.0.0.1:$REDIS_PORT" --server "http://127.0.0.1:$PORT" \
    --queue bench --count "$COUNT" --concurrency "$CONCURRENCY" --workers "$WORKERS" --rounds 1 --quiet --json |
    python3 -c '
import json, sys
doc = json.load(sys.stdin)
for row in doc["results"]:
    print(json.dumps({"side": row["name"], "count": row["ops"], "concurrency": row["concurrency"],
                      "seconds": round(row["seconds"], 3), "per_second": round(row["ops_per_sec"], 1),
                      "p50_ms": round(row["p50_ms"], 3), "p99_ms": round(row["p99_ms"], 3)}))
' | tee -a "$RESULTS"
  log "round $r/$ROUNDS: the Python SDK worker"
  "$VENV/bin/python" clients/python/bench.py --url "http://127.0.0.1:$PORT" --queue bench \
    --count "$COUNT" --concurrency "$CONCURRENCY" |
    python3 -c '
import json, sys
row = json.loads(sys.stdin.read().strip().splitlines()[-1])
print(json.dumps({"side": "python sdk", "count": row["count"], "concurrency": row["concurrency"],
                  "seconds": round(row["seconds"], 3), "per_second": round(row["per_second"], 1)}))
' | tee -a "$RESULTS"
done

python3 - "$RESULTS" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["side"], []).append(r["per_second"])
ref = statistics.median(by["in-process"])
print("\nside                 median/s   runs                      ratio to in-process")
for side in ("in-process", "http, settle each", "http, settle batch", "python sdk"):
    v = by.get(side, [])
    if v:
        m = statistics.median(v)
        print(f"{side:<20} {m:>9.0f}   {', '.join(f'{x:.0f}' for x in v):<25} {m / ref:.2f}")
EOF
