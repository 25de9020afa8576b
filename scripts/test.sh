#!/usr/bin/env bash
# The test suite: install, then run every tier (unit, one-process, multi-rank msrun on CPU).
# Default: the suite CI runs, in .venv with the default MindSpore. `--full` adds the tests marked `full` (4-rank
# parity and sharded-init launches, ...; docs/testing.md). Other arguments go to pytest; with a path among them
# (`bash scripts/test.sh tests/unit`), pytest runs just that.
#
# `--mindspore VERSION` runs in .venv-mindspore-VERSION with that MindSpore (made by scripts/setup_env.sh, which
# checks that installing mindzero left it in place) and, without a path, the suite's core: the pure tier, the
# one-process tier but for its two longest modules (test_one_process.py, whose stages at group size 1 the parity
# launch runs at 2 ranks, and the planner's test_fit.py), and the launches of parity (every stage, flat and owner
# mode, fp32 and param_dtype, accumulation, PyNative), the optimizers, checkpoints (saved, resumed, merged),
# sharded initialisation and Model.train (docs/backends.md has the versions measured).
#
# Without a path, in two lanes at once:
# - the launches that keep both cores busy with their ranks (one module at a time: their ranks compile side by side);
# - beside them, the launches that mostly wait (ranks that are killed, hang to a timeout or fail on purpose, short
#   example runs, checkpoint faults, the planner's rehearsals: about half a core on average), one at a time, and
#   when they end, the one-process and pure tests two at a time (pytest-xdist, one module per worker: each test
#   compiles on one core), beside what remains of the first lane.
# The second lane's output is printed as it runs, the first lane's when it ends (it is written to a file meanwhile).
set -euo pipefail
cd "$(dirname "$0")/.."
MINDSPORE=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --mindspore) MINDSPORE="${2:-}"; shift 2 || { echo "test.sh: --mindspore needs a version" >&2; exit 2; } ;;
    --mindspore=*) MINDSPORE="${1#--mindspore=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
set -- ${ARGS[@]+"${ARGS[@]}"}
if [ -n "$MINDSPORE" ]; then
  VENV=$(bash scripts/setup_env.sh --mindspore "$MINDSPORE" | tail -n 1)
else
  VENV=$(bash scripts/setup_env.sh | tail -n 1)
fi
echo "MindSpore $("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("mindspore"))') in $VENV"
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15)
for arg in "$@"; do
  if [[ "$arg" == tests* ]]; then
    exec "${PYTEST[@]}" "$@"
  fi
done
if [ -n "$MINDSPORE" ]; then  # the suite's core
  BUSY=(tests/multirank/test_parity.py tests/multirank/test_optimizers.py tests/multirank/test_checkpoint.py
        tests/multirank/test_sharded_init.py)
  BESIDE=(tests/multirank/test_model_train.py)
  SINGLE=(tests/single tests/unit --ignore=tests/single/test_one_process.py --ignore=tests/single/test_fit.py)
else
  SINGLE=(tests/single tests/unit)
  BUSY=(tests/multirank/test_parity.py tests/multirank/test_optimizers.py tests/multirank/test_checkpoint.py
        tests/multirank/test_hybrid.py tests/multirank/test_sharded_init.py tests/multirank/test_quant.py)
  BESIDE=(tests/multirank/test_launcher.py tests/multirank/test_launch.py tests/multirank/test_faults.py
          tests/multirank/test_fit.py tests/multirank/test_example.py tests/multirank/test_model_train.py
          tests/multirank/test_offload.py tests/multirank/test_env.py)
  every=$(find tests/multirank -name 'test_*.py' | sort)
  listed=$(printf '%s\n' "${BUSY[@]}" "${BESIDE[@]}" | sort)
  if [[ "$every" != "$listed" ]]; then
    echo "scripts/test.sh: every module of tests/multirank must be in one lane (BUSY or BESIDE):" >&2
    diff <(echo "$every") <(echo "$listed") >&2 || true
    exit 2
  fi
fi
busy_log=$(mktemp "${TMPDIR:-/tmp}/mindzero_busy_lane.XXXXXX")
echo "the busy lane (${BUSY[*]}) writes to $busy_log until it ends"
status=0
"${PYTEST[@]}" "${BUSY[@]}" "$@" > "$busy_log" 2>&1 &
busy=$!
trap 'kill "$busy" 2>/dev/null || true' EXIT  # an interrupted run leaves no lane behind
"${PYTEST[@]}" "${BESIDE[@]}" "$@" || status=$?
"${PYTEST[@]}" -n 2 --dist loadfile "${SINGLE[@]}" "$@" || status=$((status ? status : $?))
busy_status=0
wait "$busy" || busy_status=$?
echo "=== the busy lane (${BUSY[*]}) ==="
cat "$busy_log"
rm -f "$busy_log"
exit $((status ? status : busy_status))
