#!/usr/bin/env bash
# Staleness sweep on CPU: η ∈ {0, 1, 2, 4, 8}, one rollout rank and one trainer rank, each pinned to its own core.
#
#   bash exp/staleness_sweep_cpu.sh                       # -> runs/staleness_sweep_cpu-<time>/eta<k>/, then the table
#   SWEEP=runs/mysweep ETAS="0 4" STEPS=20 bash exp/staleness_sweep_cpu.sh extra.key=value ...
#
# η = 0 is synchronous RL: the trainer waits for the batch, then the rollout rank waits for the new weights.
# With η ≥ 1 generation of the next batches overlaps training, so on two cores trained tokens/s approaches
# min(1/t_gen, 1/t_train) instead of 1/(t_gen + t_train). Both ranks use one thread (HEXRL_THREADS=1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODEL="${MODEL:-exp/tiny-model}"
SWEEP="${SWEEP:-runs/staleness_sweep_cpu-$(date +%Y%m%d-%H%M%S)}"
ETAS="${ETAS:-0 1 2 4 8}"
REPEATS="${REPEATS:-1}"                   # >1: the η list is run that many times, interleaved (eta<k>_r<i>)
STEPS="${STEPS:-12}"                      # optimizer steps per run
SECONDS_PER_RUN="${SECONDS_PER_RUN:-60}"  # train.max_train_seconds: a run stops at whichever comes first
# Rollout slots. A decode round of the tiny model costs about the same at 6 or 32 sequences, so the slot
# count sets generation time per step: 10 slots (~80 rounds for 32 samples) take about as long as one
# training step on one core, the balance where asynchrony pays most (up to 2x); 32 slots make the run
# trainer-bound and η barely matters. (Measured: η=4/η=0 = 1.65x with 6 slots, 1.96x with 10.)
ROLLOUT_BATCH="${ROLLOUT_BATCH:-10}"
CORES="${CORES:-0 1}"                     # taskset core of local rank 0 (trainer) and local rank 1 (rollout)
PYTHON="${PYTHON:-.venv/bin/python}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
if [[ -e "$SWEEP" ]]; then
  echo "error: $SWEEP already exists (metrics.jsonl files append); pick another SWEEP=" >&2
  exit 2
fi
read -r -a core_list <<< "$CORES"
if (( ${#core_list[@]} != 2 )) || (( $(nproc --all) < 2 )); then
  echo "error: the pinned sweep needs two cores, CORES='$CORES' on a machine with $(nproc --all)" >&2
  exit 2
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1 HEXRL_THREADS=1
export HEXRL_PIN_CORES="$CORES" HEXRL_PYTHON="$PYTHON"
mkdir -p "$SWEEP"
echo "sweep: $SWEEP  (etas: $ETAS; $STEPS steps or ${SECONDS_PER_RUN}s each; cores: trainer ${core_list[0]}, rollout ${core_list[1]})"
for (( rep = 1; rep <= REPEATS; rep++ )); do
for eta in $ETAS; do
  name="eta$eta"; (( REPEATS > 1 )) && name="eta${eta}_r$rep"
  echo "== $name"
  # rank 0 trains, rank 1 generates (plan.num_rollout=1 on a world of 2)
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 --no-python exp/pin.sh train.py \
    model.path="$MODEL" plan.num_rollout=1 staleness.max_staleness="$eta" \
    train.total_steps="$STEPS" train.max_train_seconds="$SECONDS_PER_RUN" \
    train.prompts_per_step=4 rollout.samples_per_prompt=8 rollout.max_batch_size="$ROLLOUT_BATCH" rollout.max_new_tokens=32 \
    rollout.max_queued_groups=64 data.num_test=32 logging.eval_every=0 logging.progress=false \
    logging.run_dir="$SWEEP" logging.run_name="$name" "$@" > "$SWEEP/$name.log" 2>&1 \
    || { echo "error: $name failed; last lines of $SWEEP/$name.log:" >&2; tail -n 20 "$SWEEP/$name.log" >&2; exit 1; }
  grep -h "eval @" "$SWEEP/$name.log" || true
done
done
"$PYTHON" exp/compare.py "$SWEEP" --group-by staleness.max_staleness
