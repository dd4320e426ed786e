#!/usr/bin/env bash
# Acceptance 4 of issue 21 in one call: profile this machine (`schedule.py profile`, ~2 min), run the CPU demo right
# after it (exp/cpu_demo.sh, ~5 min), and predict the demo's step from the profile (exp/check_profile_prediction.py).
# The two are measured back to back because a shared host's rates drift: two profiles of this VM taken hours apart
# differ up to 2x in their training rate, and a profile predicts only the machine it measured.
#
#   bash exp/check_profile_demo.sh                   # -> runs/profile_check-<time>/{profile.yaml,demo/,prediction.json}
#   OUT=runs/mine bash exp/check_profile_demo.sh train.total_steps=80
# Exit status: check_profile_prediction.py's (0 when the predicted step is within 15% of the measured one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-runs/profile_check-$(date +%Y%m%d-%H%M%S)}"
if [[ -e "$OUT/demo" ]]; then
  echo "error: $OUT already holds a check (its demo/ exists); pick another OUT=" >&2
  exit 2
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1
"$PYTHON" schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu --nominal measured --out "$OUT/profile.yaml"
echo "demo -> $OUT/demo (log: $OUT/demo.log)"
RUN="$OUT/demo" PYTHON="$PYTHON" bash exp/cpu_demo.sh "$@" > "$OUT/demo.log" 2>&1 || {
  echo "error: the demo failed; see $OUT/demo.log" >&2
  tail -20 "$OUT/demo.log" >&2
  exit 1
}
grep -E '^\|' "$OUT/demo.log" || true
"$PYTHON" exp/check_profile_prediction.py "$OUT/demo" --profile "$OUT/profile.yaml" --json "$OUT/prediction.json"
