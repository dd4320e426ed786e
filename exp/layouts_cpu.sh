#!/usr/bin/env bash
# Trainer layouts on CPU: the planner (schedule.py) makes a plan with a forced trainer layout DP x TP x PP,
# train.py runs it, exp/compare.py tabulates the runs and exp/validate_simulator.py sets the simulator's
# predictions next to what was measured.
#
#   bash exp/layouts_cpu.sh                              # -> runs/layouts_cpu-<time>/<layout>/ (+ plan_<layout>.json)
#   LAYOUTS="1,1,1:2 2,1,1:3" STEPS=20 bash exp/layouts_cpu.sh
#
# LAYOUTS holds "dp,tp,pp:nproc" items: the trainer layout and the number of processes (the planner gives the
# remaining processes to rollout). Every rank uses one thread; with more ranks than cores they share cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-exp/tiny-model}"
OUT="${OUT:-runs/layouts_cpu-$(date +%Y%m%d-%H%M%S)}"
LAYOUTS="${LAYOUTS:-1,1,1:2 2,1,1:3 1,2,1:3 1,1,2:3}"
STEPS="${STEPS:-10}"
SECONDS_PER_RUN="${SECONDS_PER_RUN:-60}"
ETA="${ETA:-4}"
# the workload, shared by the planner's inputs and the runs
PROMPTS=4 SAMPLES=8 MAX_BATCH=32 MAX_NEW=32

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
if [[ -e "$OUT" ]]; then
  echo "error: $OUT already exists (metrics.jsonl files append); pick another OUT=" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1 HEXRL_THREADS=1
mkdir -p "$OUT"
for item in $LAYOUTS; do
  layout="${item%%:*}" nproc="${item##*:}"
  name="dp${layout%%,*}_tp$(echo "$layout" | cut -d, -f2)_pp${layout##*,}_n$nproc"
  echo "== $name: planning"
  "$PYTHON" schedule.py --cluster exp/clusters/cpu.yaml --model "$MODEL" --nproc "$nproc" --train-layout "$layout" \
    --prompts "$PROMPTS" --samples "$SAMPLES" --prompt-len 20 --gen-mean 30 --eta "$ETA" --max-batch "$MAX_BATCH" \
    --precision fp32 --ppo-minibatches 1 --microbatch-tokens 8192 --out "$OUT/plan_$name.json" --quiet
  echo "== $name: training"
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train.py \
    model.path="$MODEL" plan="$OUT/plan_$name.json" staleness.max_staleness="$ETA" \
    train.total_steps="$STEPS" train.max_train_seconds="$SECONDS_PER_RUN" \
    train.prompts_per_step="$PROMPTS" rollout.samples_per_prompt="$SAMPLES" rollout.max_batch_size="$MAX_BATCH" \
    rollout.max_new_tokens="$MAX_NEW" rollout.max_queued_groups=64 data.num_test=32 logging.eval_every=0 \
    logging.progress=false logging.run_dir="$OUT" logging.run_name="$name" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "error: $name failed; last lines of $OUT/$name.log:" >&2; tail -n 20 "$OUT/$name.log" >&2; exit 1; }
done
"$PYTHON" exp/compare.py "$OUT"
if [[ -f exp/validate_simulator.py ]]; then
  "$PYTHON" exp/validate_simulator.py "$OUT"
fi
