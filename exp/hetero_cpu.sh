#!/usr/bin/env bash
# Heterogeneity measured on one machine (exp/hetero_cpu.py): the planner's plan and four alternatives on two
# emulated device types (exp/clusters/cpu_hetero.yaml), predicted with this machine's device profile and run side
# by side, round robin. Prints the table and writes <OUT>/hetero_summary.json.
#
#   bash exp/hetero_cpu.sh                                   # -> runs/hetero_cpu-<time>/ (~40 min on 2 cores)
#   OUT=runs/h STEPS=8 REPEATS=1 bash exp/hetero_cpu.sh      # shorter
#   PROFILE=/tmp/mine.yaml bash exp/hetero_cpu.sh            # another profile of this machine
#
# The profile must be this machine's (`python schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu
# --nominal measured --out exp/profiles/cpu.yaml`, ~3 min, on a quiet machine): the prediction prices every emulated
# type at its fractions of it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-exp/tiny-model}"
OUT="${OUT:-runs/hetero_cpu-$(date +%Y%m%d-%H%M%S)}"
PROFILE="${PROFILE:-exp/profiles/cpu.yaml}"
STEPS="${STEPS:-12}"
REPEATS="${REPEATS:-2}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1
"$PYTHON" exp/hetero_cpu.py --model "$MODEL" --out "$OUT" --profile "$PROFILE" --steps "$STEPS" --repeats "$REPEATS" "$@"
"$PYTHON" exp/plot_hetero.py "$OUT/hetero_summary.json" --out "$OUT/hetero.png"
