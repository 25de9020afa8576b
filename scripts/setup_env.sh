#!/usr/bin/env bash
# Create a virtual environment (if missing) with MindSpore, then install mindzero into it with its test and
# example extras, the way a user installs it beside the MindSpore they have: MindSpore first, then mindzero with
# its dependencies resolved by pip, which must leave that MindSpore as it is (checked, and so must the wheel and
# the sdist built from this checkout: scripts/install_check.py; the run fails otherwise).
#
#   bash scripts/setup_env.sh                      # .venv with the default MindSpore (mindzero/core/versions.py)
#   bash scripts/setup_env.sh --mindspore 2.8.0    # .venv-mindspore-2.8.0 with MindSpore 2.8.0
#
# Also installs mindone's trainers without its dependencies (CAME and Muon for the optimizer tests), and Debian's
# openmpi-bin for the mpirun launch tests when mpirun is missing (needs root and apt).
# Prints the environment's directory as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
MINDSPORE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --mindspore) MINDSPORE="${2:-}"; shift 2 || { echo "setup_env.sh: --mindspore needs a version" >&2; exit 2; } ;;
    --mindspore=*) MINDSPORE="${1#--mindspore=}"; shift ;;
    *) echo "setup_env.sh: unknown argument '$1' (accepted: --mindspore VERSION)" >&2; exit 2 ;;
  esac
done
if [ -z "$MINDSPORE" ]; then
  VENV=.venv
  MINDSPORE=$(python3 -c 'import runpy; print(runpy.run_path("mindzero/core/versions.py")["DEFAULT_MINDSPORE"])')
else
  if ! [[ "$MINDSPORE" =~ ^[0-9]+\.[0-9]+\.[0-9]+([.a-z0-9]*)$ ]]; then
    echo "setup_env.sh: --mindspore '$MINDSPORE' is not a release number such as 2.8.0" >&2
    exit 2
  fi
  VENV=".venv-mindspore-$MINDSPORE"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# MindSpore as the user has it, then mindzero: pip must not replace the MindSpore already there
"${PIP[@]}" "mindspore==$MINDSPORE" "numpy<2"
"${PIP[@]}" -e ".[test,examples]"
got=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("mindspore"))')
if [ "$got" != "$MINDSPORE" ]; then
  echo "setup_env.sh: installing mindzero changed MindSpore $MINDSPORE into $got" >&2
  exit 1
fi
# the wheel and the sdist of this checkout would leave it too (pip's dry run; nothing changes)
"$VENV/bin/python" scripts/install_check.py --python "$VENV/bin/python" >&2
# mindone's trainers (CAME, Muon) for the optimizer tests: its own dependencies (transformers, opencv, ...) are not
# needed there (tests/support/optimizers.py loads the trainer modules from their files)
"${PIP[@]}" --no-deps "mindone==0.5.0"
if ! command -v mpirun >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing openmpi-bin (for the mpirun launch tests)" >&2
    (apt-get install -y -q openmpi-bin >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q openmpi-bin >/dev/null; })
  else
    echo "warning: mpirun not found and cannot apt-get install openmpi-bin here; the mpirun tests will fail" >&2
  fi
fi
echo "$VENV"
