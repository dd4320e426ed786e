#!/usr/bin/env bash
# The CPU demo: 4 processes (2 rollout + 2 data-parallel train ranks) train the shipped tiny model with
# asynchronous GRPO (η = 4) on synthetic arithmetic (exp/configs/cpu_demo.yaml, <= 270 s of training),
# then summarise the run with exp/compare.py (table + PNGs in <run>/compare/).
#
#   bash exp/cpu_demo.sh                         # -> runs/cpu_demo-<time>/
#   RUN=runs/mydemo NPROC=3 bash exp/cpu_demo.sh train.total_steps=50 max_staleness=2
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
NPROC="${NPROC:-4}"
RUN="${RUN:-runs/cpu_demo-$(date +%Y%m%d-%H%M%S)}"
MODEL="${MODEL:-exp/tiny-model}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
if [[ -e "$RUN/metrics.jsonl" ]]; then
  echo "error: $RUN already holds a run (metrics.jsonl appends); pick another RUN=" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py config=cpu_demo \
  model.path="$MODEL" logging.run_dir="$(dirname "$RUN")" logging.run_name="$(basename "$RUN")" "$@"
"$PYTHON" exp/compare.py "$RUN" --out "$RUN/compare"
