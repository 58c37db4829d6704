#!/usr/bin/env bash
# Runs the dashboard test (dashboard.test.mjs) in headless Chromium against `baton serve`: in
# memory, on a Redis standalone server (started by the test on a free port; needs redis-server and
# redis-cli), and with a bearer token; the stream browser, workers and bulk actions at desktop and
# phone widths (ops, ops-redis); odd stream paths followed exactly (links);
# a bulk cancel past one call's 10,000 (bulk-large); the queue's cron schedules (schedules). Screenshots go to target/dashboard-screenshots/.
#
#   dashboard-tests/run.sh                 # memory, redis, auth, ops, ops-redis, links, bulk-large, schedules
#   dashboard-tests/run.sh memory          # some of them
#
# Environment: BATON_BIN (a built `baton`; default: `cargo build -p baton --locked` and use
# ${CARGO_TARGET_DIR:-target}/debug/baton), CHROMIUM (default: /usr/bin/chromium, installed with
# apt-get when missing).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
log() { printf '\n==> %s\n' "$*"; }

node "$ROOT/scripts/chromium.mjs" install
export CHROMIUM="${CHROMIUM:-$(command -v chromium)}"

if [ ! -d "$HERE/node_modules/playwright-core" ]; then
  log "npm ci (dashboard-tests/)"
  (cd "$HERE" && npm ci --no-audit --no-fund)
fi

if [ -z "${BATON_BIN:-}" ]; then
  log "cargo build -p baton --locked"
  (cd "$ROOT" && cargo build -p baton --locked)
  BATON_BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/baton"
fi
[ -x "$BATON_BIN" ] || { echo "baton binary not found at $BATON_BIN" >&2; exit 1; }
export BATON_BIN

log "dashboard in headless Chromium ($("$CHROMIUM" --version 2>/dev/null | head -1))"
node "$HERE/dashboard.test.mjs" "$@"
