#!/usr/bin/env bash
# Runs the incident-triage example's end-to-end tests:
#   browser    headless Chromium (browser-tests/triage.test.mjs), on the in-memory backend and on
#              a Redis standalone server it starts on a free port: start a run; reload mid-stream
#              resumes with no duplicate or missing event; a second device follows the same run;
#              Stop shows cancelled on both; a phone (412×915, touch) fits its screen at 412 and
#              360 px and a tap on Stop cancels the run on it and on a desktop page.
#              Screenshots: target/incident-triage-screenshots/.
#   processes  two example processes on one Redis (tests/two_processes.rs, which starts its own
#              redis-server on a free port): SIGKILL of the producing process → producer_lost,
#              command FAILED, pointer released, a new run succeeds.
#
#   examples/incident-triage/run-tests.sh              # both
#   examples/incident-triage/run-tests.sh browser      # one of them
#
# Needs redis-server and redis-cli, Node.js ≥ 18 with npm; installs Debian's chromium with apt-get
# when missing (CHROMIUM overrides the binary). Never touches a Redis on 6379.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# Cargo's target dir: CARGO_TARGET_DIR (a relative one is relative to $ROOT, where cargo runs).
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
export SCREENSHOTS="${SCREENSHOTS:-$ROOT/target/incident-triage-screenshots}"
log() { printf '\n==> %s\n' "$*"; }
WHAT=("$@")
[ ${#WHAT[@]} -eq 0 ] && WHAT=(browser processes)

for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool not found: apt-get install -y redis-server redis-tools" >&2; exit 1; }
done

for what in "${WHAT[@]}"; do
  case "$what" in
    browser)
      node "$ROOT/scripts/chromium.mjs" install
      export CHROMIUM="${CHROMIUM:-$(command -v chromium)}"
      if [ ! -d "$HERE/browser-tests/node_modules/playwright-core" ]; then
        log "npm ci (examples/incident-triage/browser-tests/)"
        (cd "$HERE/browser-tests" && npm ci --no-audit --no-fund)
      fi
      log "cargo build -p incident-triage --locked"
      (cd "$ROOT" && cargo build -p incident-triage --locked)
      export TRIAGE_BIN="$TARGET/debug/incident-triage"
      log "browser tests in headless Chromium ($("$CHROMIUM" --version 2>/dev/null | head -1))"
      node "$HERE/browser-tests/triage.test.mjs" memory redis
      ;;
    processes)
      log "two processes on one Redis, SIGKILL of the producer"
      (cd "$ROOT" && cargo test -p incident-triage --locked --test two_processes -- --nocapture)
      ;;
    *) echo "unknown test set: $what (use browser or processes)" >&2; exit 2 ;;
  esac
done
log "incident-triage end-to-end tests passed (${WHAT[*]})"
