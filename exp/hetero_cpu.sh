#!/usr/bin/env bash
# Heterogeneity measured on one machine (exp/hetero_cpu.py): the planner's plan and four alternatives on two
# emulated device types (exp/clusters/cpu_hetero.yaml), predicted with this machine's device profile and run side
# by side, round robin. Prints the table and writes <OUT>/hetero_summary.json.
#
#   bash exp/hetero_cpu.sh                                   # -> runs/hetero_cpu-<time>/ (~45 min on 2 cores)
#   OUT=runs/h STEPS=8 REPEATS=1 bash exp/hetero_cpu.sh      # shorter
#   PROFILE=/tmp/mine.yaml bash exp/hetero_cpu.sh            # a profile of this machine taken before
#
# Without PROFILE it first profiles this machine (`schedule.py profile --nominal measured`, ~2 min) into
# <OUT>/profile.yaml, right before the runs it predicts: a shared host's rates drift (two profiles of this VM an hour
# apart differ up to 2x), and a profile predicts only the machine it measured. Every emulated type is priced at its
# fractions of that profile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-exp/tiny-model}"
OUT="${OUT:-runs/hetero_cpu-$(date +%Y%m%d-%H%M%S)}"
PROFILE="${PROFILE:-}"
STEPS="${STEPS:-12}"
REPEATS="${REPEATS:-2}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1
if [[ -z "$PROFILE" ]]; then
  if [[ -e "$OUT/profile.yaml" ]]; then
    PROFILE="$OUT/profile.yaml"  # a resumed experiment keeps the profile it was predicted with
  else
    mkdir -p "$OUT"
    "$PYTHON" schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu --nominal measured --out "$OUT/profile.yaml"
    PROFILE="$OUT/profile.yaml"
  fi
fi
"$PYTHON" exp/hetero_cpu.py --model "$MODEL" --out "$OUT" --profile "$PROFILE" --steps "$STEPS" --repeats "$REPEATS" "$@"
"$PYTHON" exp/plot_hetero.py "$OUT/hetero_summary.json" --out "$OUT/hetero.png"
