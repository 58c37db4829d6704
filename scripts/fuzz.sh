#!/usr/bin/env bash
# Fuzzes the HTTP API of `baton serve` with schemathesis (PyPI) against its own /openapi.json.
#
#   bash scripts/fuzz.sh            # 150 s of fuzzing (FUZZ_SECONDS overrides; at least 120 in CI)
#
# Starts `baton serve` (in-memory backend, built-in `default` queue) on a free port, runs
# schemathesis with the checks `not_a_server_error` and `response_schema_conformance`, then
# checks that the server is still alive and answering. Fails on any 5xx, any response that does
# not match the spec, a request that hangs past REQUEST_TIMEOUT, or a crash.
#
# schemathesis is installed into a virtualenv under target/ (pinned below) when missing.
set -euo pipefail

cd "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

FUZZ_SECONDS="${FUZZ_SECONDS:-150}"
REQUEST_TIMEOUT="${REQUEST_TIMEOUT:-15}"
SCHEMATHESIS_VERSION="4.32.5"
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
VENV="${FUZZ_VENV:-$TARGET_DIR/fuzz-venv}"
OUT="$TARGET_DIR/fuzz"
mkdir -p "$OUT"

log() { printf '\n==> %s\n' "$*"; }

if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
  log "installing schemathesis $SCHEMATHESIS_VERSION into $VENV"
  if ! python3 -m venv "$VENV"; then
    log "python3 -m venv failed; installing python3-venv"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update && apt-get install -y python3-venv </dev/null
    python3 -m venv "$VENV"
  fi
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

log "building baton"
cargo build --quiet --locked -p baton --bin baton
BATON="$TARGET_DIR/debug/baton"

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
BASE="http://127.0.0.1:$PORT"
log "starting baton serve on $BASE (in memory)"
# Short live-read timings so long-poll and SSE requests end well within REQUEST_TIMEOUT. A token
# is configured (and sent with every request) so the auth layer is fuzzed too.
TOKEN="fuzz-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
env -u BATON_REDIS -u BATON_REDIS_CLUSTER -u BATON_CONFIG BATON_ADMIN_TOKEN="$TOKEN" \
  "$BATON" serve --listen "127.0.0.1:$PORT" --long-poll-timeout 1s --sse-cycle 2s --sse-heartbeat 1s \
  >"$OUT/serve.out" 2>"$OUT/serve.err" &
SERVER_PID=$!
stop_server() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }
trap stop_server EXIT

for _ in $(seq 1 100); do
  if curl -fsS "$BASE/healthz" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "baton serve exited at startup:" >&2; cat "$OUT/serve.err" >&2; exit 1; fi
  sleep 0.1
done

log "schemathesis for ${FUZZ_SECONDS}s against $BASE/openapi.json"
status=0
"$VENV/bin/schemathesis" run "$BASE/openapi.json" \
  --checks not_a_server_error,response_schema_conformance \
  --header "Authorization: Bearer $TOKEN" \
  --max-time "$FUZZ_SECONDS" \
  --request-timeout "$REQUEST_TIMEOUT" \
  --workers 1 \
  --suppress-health-check all \
  --no-color \
  --report junit --report-dir "$OUT" \
  || status=$?

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "baton serve died during fuzzing; its stderr:" >&2
  tail -50 "$OUT/serve.err" >&2
  exit 1
fi
if ! curl -fsS --max-time 5 "$BASE/healthz" >/dev/null; then
  echo "baton serve stopped answering after fuzzing" >&2
  exit 1
fi
if [ "$status" -ne 0 ]; then
  echo "schemathesis found problems (exit $status); see above and $OUT" >&2
  exit "$status"
fi
log "fuzzing passed: no 5xx, no schema violation, no hang, no crash"
