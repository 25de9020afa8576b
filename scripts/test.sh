#!/usr/bin/env bash
# The test suite: install, then run every tier (unit, one-process, multi-rank msrun on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
