#!/usr/bin/env bash
# The simulator on runs it was not fitted on (issue 21, item 4): profile this machine (`schedule.py profile`, 2 min),
# then five CPU runs it must predict -- the trainer layouts of exp/layouts_cpu.sh (1x1x1 on 2 processes; dp 2, tp 2,
# pp 2 on 3) at eta 4 and the CPU demo's split (dp 2 + 2 rollout on 4) at eta 0 -- and predict each from the profile
# alone: `python exp/validate_simulator.py --profile <profile> <runs>` (no cost taken from any run; 15%).
#
#   bash exp/validate_simulator_cpu.sh            # -> runs/validate_cpu-<time>/{profile.yaml,layouts/,eta0/,validation.json}
#   STEPS=30 bash exp/validate_simulator_cpu.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-runs/validate_cpu-$(date +%Y%m%d-%H%M%S)}"
STEPS="${STEPS:-20}"
if [[ -e "$OUT" ]]; then
  echo "error: $OUT already exists; pick another OUT=" >&2
  exit 2
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
"$PYTHON" schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu --nominal measured --out "$OUT/profile.yaml"
OUT="$OUT/layouts" STEPS="$STEPS" SECONDS_PER_RUN=120 PYTHON="$PYTHON" bash exp/layouts_cpu.sh > "$OUT/layouts.log" 2>&1 \
  || { echo "error: exp/layouts_cpu.sh failed; see $OUT/layouts.log" >&2; tail -20 "$OUT/layouts.log" >&2; exit 1; }
OUT="$OUT/eta0" STEPS="$STEPS" SECONDS_PER_RUN=120 ETA=0 LAYOUTS="2,1,1:4" PYTHON="$PYTHON" bash exp/layouts_cpu.sh \
  > "$OUT/eta0.log" 2>&1 \
  || { echo "error: the eta 0 run failed; see $OUT/eta0.log" >&2; tail -20 "$OUT/eta0.log" >&2; exit 1; }
"$PYTHON" exp/validate_simulator.py --profile "$OUT/profile.yaml" "$OUT/layouts" "$OUT/eta0" --out "$OUT/validation.json"
