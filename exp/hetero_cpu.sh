#!/usr/bin/env bash
# Heterogeneity measured on one machine (exp/hetero_cpu.py): the planner's plan and four alternatives on two
# emulated device types (exp/clusters/cpu_hetero.yaml), predicted with this machine's device profile and run side
# by side, round robin. Prints the table and writes <OUT>/hetero_summary.json.
#
#   bash exp/hetero_cpu.sh                                   # -> runs/hetero_cpu-<time>/ (30-75 min on 2 cores)
#   OUT=runs/h STEPS=8 REPEATS=1 bash exp/hetero_cpu.sh      # shorter
#   PROFILE=/tmp/mine.yaml bash exp/hetero_cpu.sh            # a profile of this machine taken before
#
# Without PROFILE it first profiles this machine (`schedule.py profile --nominal measured`, ~2 min) into
# <OUT>/profile.yaml and then each emulated type under its own throttle into <OUT>/profile_<type>.yaml (~2-3 min
# each), right before the runs they predict: a shared host's rates drift (two profiles of this VM an hour apart
# differ up to 2x), a profile predicts only the machine it measured, and an emulated rank's Generator steps cost
# more CPU after each of its throttle's pauses than back to back (exp/bench_throttle.py). A type is profiled beside
# CO_LOAD peer processes (default: the cluster's ranks less one) under the type's throttle, as a run's other ranks are
# busy beside each of its ranks on this host (`schedule.py profile --co-load`): CO_LOAD_TRAINERS of them (default:
# half the cluster's ranks, the trainers beside a rollout rank in an even split) train, the rest decode. With
# trainers, a type's profile also times its replica's decode step beside the same co-load with the trainers of each
# emulated type in turn (decode_beside), and the planner prices a rollout rank by the trainers a split puts beside it.
# Each type is priced at its fractions of its own profile; with PROFILE, every type at its fractions of that one.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-exp/tiny-model}"
OUT="${OUT:-runs/hetero_cpu-$(date +%Y%m%d-%H%M%S)}"
PROFILE="${PROFILE:-}"
CLUSTER="${CLUSTER:-exp/clusters/cpu_hetero.yaml}"
STEPS="${STEPS:-12}"
REPEATS="${REPEATS:-3}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1
PROFILES=()
if [[ -z "$PROFILE" ]]; then
  # this machine (the link and every type's training), then each emulated type under its own throttle (its
  # Generator steps padded as its rollout ranks' are); a resumed experiment keeps the profiles it was predicted with
  mkdir -p "$OUT"
  [[ -e "$OUT/profile.yaml" ]] \
    || "$PYTHON" schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu --nominal measured --out "$OUT/profile.yaml"
  PROFILES+=(--profile "$OUT/profile.yaml")
  ranks=$("$PYTHON" -c "import sys, yaml; print(sum(m['gpus'] * m.get('count', 1) for m in yaml.safe_load(open(sys.argv[1]))['machines']))" "$CLUSTER")
  CO_LOAD="${CO_LOAD:-$((ranks - 1))}"
  CO_LOAD_TRAINERS="${CO_LOAD_TRAINERS:-$((ranks / 2 < CO_LOAD ? ranks / 2 : CO_LOAD))}"
  for type in $("$PYTHON" -c "import sys, yaml; print(' '.join(yaml.safe_load(open(sys.argv[1]))['gpu_types']))" "$CLUSTER"); do
    [[ -e "$OUT/profile_$type.yaml" ]] \
      || "$PYTHON" schedule.py profile --cluster "$CLUSTER" --gpu-type "$type" --nominal measured --co-load "$CO_LOAD" \
        --co-load-trainers "$CO_LOAD_TRAINERS" --out "$OUT/profile_$type.yaml"
    PROFILES+=(--profile "$OUT/profile_$type.yaml")
  done
else
  PROFILES+=(--profile "$PROFILE")
fi
"$PYTHON" exp/hetero_cpu.py --model "$MODEL" --cluster "$CLUSTER" --out "$OUT" "${PROFILES[@]}" --steps "$STEPS" \
  --repeats "$REPEATS" "$@"
