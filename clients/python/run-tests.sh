#!/usr/bin/env bash
# The Python SDK's tests, against real `baton serve` processes (memory and Redis backends).
#
# Run from anywhere (CI runs it from the repository root) after `cargo build` or `cargo test`
# built target/debug/baton (or set BATON_BIN). Needs python3 >= 3.9 and redis-server on PATH
# (BATON_TEST_BACKENDS=memory skips Redis). Creates or reuses the venv target/python-venv.
# Extra arguments go to pytest (e.g. -k cancel, -x). Exits non-zero on any failure, and when
# pytest collected no tests at all (its exit code 5).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"

bin="${BATON_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/baton}"
if [ ! -x "$bin" ]; then
    echo "run-tests.sh: no baton binary at $bin: run 'cargo build -p baton' (or 'cargo test') first, or set BATON_BIN" >&2
    exit 1
fi
export BATON_BIN="$bin"

python="${PYTHON:-python3}"
venv="$root/target/python-venv"
if [ ! -x "$venv/bin/python" ]; then
    if ! "$python" -m venv "$venv"; then
        # Debian's python3 has venv in a package of its own.
        echo "run-tests.sh: $python -m venv failed; installing python3-venv" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update && apt-get install -y python3-venv </dev/null
        rm -rf "$venv"
        "$python" -m venv "$venv"
    fi
fi

# Install (again) only when pyproject.toml or the checkout's path changed since the last install.
stamp="$venv/.baton-client-installed"
want="$(sha256sum clients/python/pyproject.toml | cut -d' ' -f1) $root"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "clients/python[test]"
    echo "$want" > "$stamp"
fi

set +e
"$venv/bin/python" -m pytest clients/python/tests -p no:cacheprovider "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
    echo "run-tests.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$code"
