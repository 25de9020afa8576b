#!/usr/bin/env bash
# The test suite: install, then run every tier (unit, one-process, multi-rank msrun on CPU).
# Default: the suite CI runs (under 30 minutes on 2 cores). `--full` adds the tests marked `full`
# (4-rank parity and sharded-init launches, ...; docs/testing.md); other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
