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
# glibc's allocator tuned for compiling: a step's compile spends about a tenth of its time in malloc and free; with
# a per-thread cache of up to 65535 freed chunks of each size and no fastbins, a stage-3 step compiles about a tenth
# faster, for 8% more peak memory (docs/performance.md). The test processes and the ranks they launch inherit it;
# a value already set wins.
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.mxfast=0:glibc.malloc.tcache_count=65535}"
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
