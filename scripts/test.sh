#!/usr/bin/env bash
# The test suite: install, then run every tier (unit, one-process, multi-rank msrun on CPU).
# Default: the suite CI runs. `--full` adds the tests marked `full` (4-rank parity and sharded-init launches, ...;
# docs/testing.md). Other arguments go to pytest; with a path among them (`bash scripts/test.sh tests/unit`), pytest
# runs just that.
#
# Without a path: the multi-rank launches first (each keeps both cores busy with its ranks), then the one-process
# and pure tests two at a time (pytest-xdist, one module per worker: each test compiles on one core).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)
for arg in "$@"; do
  if [[ "$arg" == tests* ]]; then
    exec "${PYTEST[@]}" "$@"
  fi
done
status=0
"${PYTEST[@]}" tests/multirank "$@" || status=$?
"${PYTEST[@]}" -n 2 --dist loadfile tests/single tests/unit "$@" || status=$((status ? status : $?))
exit "$status"
