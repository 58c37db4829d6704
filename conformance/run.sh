#!/usr/bin/env bash
# Runs, against `baton serve` on each backend, the public Durable Streams server conformance suite
# (conformance.test.mjs), the official TypeScript client (clients.test.mjs), the Python client
# (python/test_client.py) and a headless-Chromium EventSource test (browser/eventsource.mjs), on:
# the in-memory backend, a Redis standalone server and a 3-master Redis Cluster (the Redis
# processes are started here on free ports, with throwaway directories, and stopped at the end).
#
#   conformance/run.sh                      # all three backends
#   conformance/run.sh memory cluster       # some of them
#
# Environment: BATON_BIN (a built `baton` binary; default: `cargo build -p baton --locked` and
# use target/debug/baton), CARGO_TARGET_DIR (honoured when building).
# Prints one summary line per backend and exits non-zero when any test fails on any backend.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$HERE"

BACKENDS=("$@")
[ ${#BACKENDS[@]} -gt 0 ] || BACKENDS=(memory standalone cluster)
LONG_POLL_TIMEOUT_MS=2000

log() { printf '\n==> %s\n' "$*"; }

if [ ! -d node_modules/@durable-streams/server-conformance-tests ]; then
  log "npm ci (conformance/)"
  npm ci --no-audit --no-fund
fi

# The Python client (durable-streams on PyPI) in a virtualenv here.
if [ ! -x python/.venv/bin/python ]; then
  log "python venv (conformance/python/.venv) with $(cat python/requirements.txt)"
  if ! python3 -m venv python/.venv; then
    # Debian's python3 ships venv separately.
    rm -rf python/.venv
    if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get update -qq </dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv </dev/null >/dev/null
    python3 -m venv python/.venv
  fi
  python/.venv/bin/pip install --quiet --disable-pip-version-check -r python/requirements.txt
fi

# Headless Chromium for the EventSource test (Debian package; scripts/chromium.mjs).
node "$ROOT/scripts/chromium.mjs" install "for the EventSource test"

if [ -z "${BATON_BIN:-}" ]; then
  log "cargo build -p baton --locked"
  (cd "$ROOT" && cargo build -p baton --locked)
  BATON_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/baton"
fi
[ -x "$BATON_BIN" ] || { echo "baton binary not found at $BATON_BIN" >&2; exit 1; }

WORK="$(mktemp -d -t baton-conformance.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# A TCP port on 127.0.0.1 nobody listens on.
free_port() {
  local p
  while :; do
    p=$(( 20000 + RANDOM % 40000 ))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
}

# A port p for a Cluster node: p and its cluster bus port p + 10000 both free (redis-server
# exits when it cannot bind the bus port), drawn from 12000-21999 so that neither is in the
# kernel's ephemeral range (32768-60999), as baton-testkit does.
free_cluster_port() {
  local p
  while :; do
    p=$(( 12000 + RANDOM % 10000 ))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 10000))") 2>/dev/null; then
      echo "$p"; return
    fi
  done
}

wait_port() { # port, what[, pid: give up as soon as that process has exited]
  for _ in $(seq 1 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then break; fi
    sleep 0.05
  done
  echo "$2 did not listen on port $1" >&2
  return 1
}

start_redis() { # port, extra args...
  local port=$1; shift
  mkdir -p "$WORK/redis-$port"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK/redis-$port" \
    --logfile "$WORK/redis-$port/log" "$@" &
  local pid=$!
  PIDS+=("$pid")
  wait_port "$port" "redis-server" "$pid" || { tail -3 "$WORK/redis-$port/log" >&2; return 1; }
}

start_cluster() { # sets CLUSTER_URLS to the comma-separated node URLs (no subshell: PIDS must keep the nodes)
  local ports=() urls=() addrs=()
  for _ in 1 2 3; do
    # A port taken between the check and the bind (ours or the bus port): try another.
    local p started=0
    for _ in 1 2 3 4 5; do
      p=$(free_cluster_port)
      if start_redis "$p" --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 >&2; then
        started=1; break
      fi
    done
    [ "$started" -eq 1 ] || { echo "could not start a Redis Cluster node" >&2; return 1; }
    ports+=("$p"); urls+=("redis://127.0.0.1:$p"); addrs+=("127.0.0.1:$p")
  done
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes </dev/null >"$WORK/cluster-create.log" 2>&1 \
    || { cat "$WORK/cluster-create.log" >&2; return 1; }
  for _ in $(seq 1 600); do
    local ok=0
    for p in "${ports[@]}"; do
      if redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; then ok=$((ok + 1)); fi
    done
    if [ "$ok" -eq 3 ]; then CLUSTER_URLS=$(IFS=,; echo "${urls[*]}"); return 0; fi
    sleep 0.05
  done
  echo "Redis Cluster did not become ok" >&2
  return 1
}

SUMMARY=()
FAILED=0
for backend in "${BACKENDS[@]}"; do
  args=()
  case "$backend" in
    memory) ;;
    standalone) port=$(free_port); start_redis "$port"; args=(--redis "redis://127.0.0.1:$port") ;;
    cluster) start_cluster; args=(--redis-cluster "$CLUSTER_URLS") ;;
    *) echo "unknown backend $backend (use memory, standalone, cluster)" >&2; exit 2 ;;
  esac
  http_port=$(free_port)
  log "baton serve on $backend (port $http_port)"
  "$BATON_BIN" serve --listen "127.0.0.1:$http_port" --long-poll-timeout "${LONG_POLL_TIMEOUT_MS}ms" \
    --allow-loopback-webhooks "${args[@]}" \
    >"$WORK/baton-$backend.log" 2>&1 &
  baton_pid=$!
  PIDS+=("$baton_pid")
  wait_port "$http_port" "baton serve" || { cat "$WORK/baton-$backend.log" >&2; exit 1; }
  head -1 "$WORK/baton-$backend.log"
  result="$WORK/results-$backend.json"
  set +e
  # SUBSCRIPTIONS=1: the suite's "Reserved subscription APIs" tests run too (their webhook
  # receivers listen on 127.0.0.1, hence --allow-loopback-webhooks above).
  CONFORMANCE_BASE_URL="http://127.0.0.1:$http_port" LONG_POLL_TIMEOUT_MS=$LONG_POLL_TIMEOUT_MS SUBSCRIPTIONS=1 \
    npx vitest run conformance.test.mjs --reporter=default --reporter=json --outputFile.json="$result"
  status=$?
  CONFORMANCE_BASE_URL="http://127.0.0.1:$http_port" npx vitest run clients.test.mjs
  ts_status=$?
  CONFORMANCE_BASE_URL="http://127.0.0.1:$http_port" python/.venv/bin/python python/test_client.py
  py_status=$?
  # The EventSource test needs connections cycled every second: a second server on the same backend.
  es_port=$(free_port)
  "$BATON_BIN" serve --listen "127.0.0.1:$es_port" --sse-cycle 1s --allow-loopback-webhooks "${args[@]}" >"$WORK/baton-$backend-es.log" 2>&1 &
  es_pid=$!
  PIDS+=("$es_pid")
  wait_port "$es_port" "baton serve (EventSource)"
  BATON_URL="http://127.0.0.1:$es_port" node browser/eventsource.mjs
  es_status=$?
  kill "$es_pid" 2>/dev/null; wait "$es_pid" 2>/dev/null
  set -e
  counts=$(node -e '
    const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
    console.log(`${r.numPassedTests} passed, ${r.numFailedTests} failed, ${r.numPendingTests + r.numTodoTests} skipped (of ${r.numTotalTests})`);
  ' "$result" 2>/dev/null || echo "no results")
  verdict() { if [ "$1" -eq 0 ]; then echo "ok"; else echo "FAILED"; fi; }
  SUMMARY+=("$backend: conformance $counts; TS client $(verdict $ts_status); Python client $(verdict $py_status); Chromium EventSource $(verdict $es_status)")
  if [ "$status" -ne 0 ] || [ "$ts_status" -ne 0 ] || [ "$py_status" -ne 0 ] || [ "$es_status" -ne 0 ]; then
    FAILED=1
    echo "---- baton serve log ($backend), last 50 lines ----"
    tail -50 "$WORK/baton-$backend.log"
  fi
  kill "$baton_pid" 2>/dev/null || true
  wait "$baton_pid" 2>/dev/null || true
done

log "conformance summary"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
