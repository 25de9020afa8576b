#!/usr/bin/env bash
# The test suite: install, then run every tier (unit, one-process, multi-rank msrun on CPU).
# Default: the suite CI runs. `--full` adds the tests marked `full` (4-rank parity and sharded-init launches, ...;
# docs/testing.md). Other arguments go to pytest; with a path among them (`bash scripts/test.sh tests/unit`), pytest
# runs just that.
#
# Without a path: every module on two pytest-xdist workers, one module per worker at a time (a module's launches
# share its fixtures), the longest first (tests/conftest.py). A launch alone leaves the cores idle about half of
# the time it takes (starting and ending its processes); a second module beside it fills them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)
for arg in "$@"; do
  if [[ "$arg" == tests* ]]; then
    exec "${PYTEST[@]}" "$@"
  fi
done
exec "${PYTEST[@]}" -n 2 --dist loadfile tests/multirank tests/single tests/unit "$@"
