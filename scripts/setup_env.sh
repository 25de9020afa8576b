#!/usr/bin/env bash
# Create .venv (if missing) and install mindzero with its pinned dependencies into it; install
# OpenMPI (Debian's openmpi-bin) for the mpirun launch tests if mpirun is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
# mindone's trainers (CAME, Muon) for the optimizer tests: its own dependencies (transformers, opencv, ...) are not
# needed there (tests/support/optimizers.py loads the trainer modules from their files)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "mindone==0.5.0"
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing openmpi-bin (for the mpirun launch tests)"
    (apt-get install -y -q openmpi-bin >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q openmpi-bin >/dev/null; })
  else
    echo "warning: mpirun not found and cannot apt-get install openmpi-bin here; the mpirun tests will fail" >&2
  fi
fi
