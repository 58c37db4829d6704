#!/usr/bin/env bash
# The TypeScript SDK's tests (CI calls this from the repository root): npm ci, tsc, then the
# node:test suites against real `baton serve` processes on the memory and Redis backends (the
# tests start their own redis-server on free ports).
#
#   clients/typescript/run-tests.sh
#
# Environment: BATON_BIN (a built baton binary; default <repo root>/target/debug/baton, built by
# `cargo test` / `cargo build -p baton`), BATON_TEST_BACKENDS (e.g. "memory"; default
# "memory,redis"). Exits non-zero when any test fails.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$HERE"

if ! command -v node >/dev/null 2>&1 || [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
  echo "clients/typescript: Node.js >= 20 with npm is required" >&2
  exit 1
fi
export BATON_BIN="${BATON_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/baton}"
if [ ! -x "$BATON_BIN" ]; then
  echo "clients/typescript: no baton binary at $BATON_BIN (run cargo build -p baton, or set BATON_BIN)" >&2
  exit 1
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "clients/typescript: redis-server is required (Debian package redis-server)" >&2
  exit 1
fi

echo "==> npm ci (clients/typescript)"
npm ci --no-audit --no-fund
echo "==> tsc"
npm run --silent build
echo "==> node --test (baton: $BATON_BIN)"
node --test --test-concurrency=3 test/*.test.mjs
