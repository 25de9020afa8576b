#!/usr/bin/env bash
# The main job: install, then train a small GPT with ZeRO stages 0-3 on 2 CPU ranks (msrun) and print,
# per stage, the loss and the bytes each rank holds. Output and logs: runs/stages_demo/ (replaced on each run;
# see docs/example.md for the single-stage configs, resume and the merged model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
rm -rf runs/stages_demo
exec .venv/bin/python -m mindzero.launch.local -n 2 --timeout 1800 --out runs/stages_demo \
  examples/train_gpt.py --config examples/configs/stages_demo.yaml "$@"
