#!/usr/bin/env bash
# Verify mindzero's GPU/Ascend path on a machine that has one: the parity suite and the benchmark on the
# real primitives (ReduceScatter, op-group and dp-group collectives), with a report.
#
#   bash scripts/verify_accelerator.sh GPU|Ascend [OUT_DIR]
#
# Needs MindSpore for that device already installed in the active Python (or in .venv), with mindzero and its
# test extras (pip install -e ".[test]"); this script installs nothing. Every worker started by the tests and
# benchmarks calls mindzero.start_data_parallel(), which sets the device MINDZERO_DEVICE names.
# Writes OUT_DIR/report.md (default runs/verify_accelerator): the environment report of 2 launched ranks
# (mindzero-env --ranks 2: versions, devices, each collective run and checked, stages 0-3 trained against
# stage 0), the test summary, the benchmark table; the raw logs beside it (docs/cluster.md says how to read it).
# Exit status: non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE="${1:-}"
case "$DEVICE" in
  GPU|Ascend) ;;
  *) echo "usage: bash scripts/verify_accelerator.sh GPU|Ascend [OUT_DIR] (got device '${DEVICE}')" >&2; exit 2 ;;
esac
OUT="${2:-runs/verify_accelerator}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 )}"
mkdir -p "$OUT"
export MINDZERO_DEVICE="$DEVICE"
"$PY" - "$DEVICE" <<'PYEOF' || { echo "MindSpore cannot run on $DEVICE in $PY; install MindSpore for $DEVICE first" >&2; exit 2; }
import sys
import mindspore as ms
ms.set_device(sys.argv[1])
from mindspore import Tensor, ops
import numpy as np
print("mindspore", ms.__version__, "on", sys.argv[1], ops.add(Tensor(np.ones(2, np.float32)), 1).asnumpy())
PYEOF
status=0
"$PY" -m mindzero.env --ranks 2 --device "$DEVICE" --json > "$OUT/env.json" 2> "$OUT/env.log" || status=1
"$PY" -c 'import json, sys; from mindzero.env import format_report; print(format_report(json.load(open(sys.argv[1]))))' \
  "$OUT/env.json" > "$OUT/env.txt" 2>> "$OUT/env.log" || status=1
# the multi-rank parity tests: every stage, fused and unfused, mixed precision, accumulation, hybrid 2x2,
# checkpoints; on an accelerator World.emulated is False, so each runs the real primitives
"$PY" -m pytest -q -p no:cacheprovider tests/multirank/test_parity.py tests/multirank/test_hybrid.py \
  tests/multirank/test_checkpoint.py -rfEs --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1 || status=1
"$PY" benchmarks/zero_bench.py --worlds 2 --out "$OUT/zero_bench" > "$OUT/bench.log" 2>&1 || status=1
{
  echo "# mindzero on $DEVICE: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "- host: $(uname -n), python: $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  echo "- mindspore: $("$PY" -c 'import mindspore as ms; print(ms.__version__)')"
  echo "- mindzero commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo "## Environment and checks of 2 launched ranks (env.txt, env.json: mindzero-env --ranks 2)"
  echo '```'
  cat "$OUT/env.txt"
  echo '```'
  echo
  echo "## Parity tests (tests.log, tests.xml)"
  echo '```'
  tail -n 40 "$OUT/tests.log"
  echo '```'
  echo
  echo "## Benchmark (zero_bench/results.md)"
  if [ -f "$OUT/zero_bench/results.md" ]; then cat "$OUT/zero_bench/results.md"; else echo "failed: see bench.log"; tail -n 20 "$OUT/bench.log"; fi
} > "$OUT/report.md"
echo "report: $OUT/report.md (exit $status)"
exit $status
