#!/usr/bin/env bash
# Every single-GPU check in one call (a lent GPU's time is short: <= ~10 min in all): the environment, tests/gpu/test_gpu.py
# (CUDA fp32 exactness, bf16, CUDA-graph decode and weight swaps, the trainer on CUDA, a colocated run), the
# colocated end-to-end run of the tiny model (exp/configs/gpu_single.yaml: a rollout and a train rank on this one GPU; it
# must learn >= 20 points within ~3 min of training, within the staleness bound, exactly once), an eta = 0 run
# (importance weights near 1: generator and trainer agree), one train step of the 1.5B config (random weights, the
# shipped shapes) measured against exp/estimate_memory.py, the weight hand-over of a 1.5B-shaped model from the train
# rank to a rollout rank on this GPU (pinned host memory vs CUDA IPC), and the rollout benchmark of the 1.5B shape's RL
# tail at batch 256 (tokens/s, GB/s, % of HBM peak).
#
#   OUT=runs/gpu_check_h200 bash exp/gpu_check.sh   # logs: $OUT/{env.txt,test_gpu.log,colocated*,memory.log,handover.log,bench.log}
#   GPU_CHECK_ON_CPU=1 OUT=/tmp/dry bash exp/gpu_check.sh  # dry run on CPU (CUDA hidden, shorter runs, no gain check)
#   WHEELS=.whl bash exp/gpu_check.sh   # a GPU machine without network: install the wheels in .whl (the packages
#                                       # requirements.txt adds to a CUDA image, e.g. datasets, math-verify) first
#   STAGES=bench bash exp/gpu_check.sh  # one phase only (bench or checks; default both), e.g. one call each
#
# Multi-GPU paths (NCCL between rollout and train ranks) need >= 2 GPUs: exp/gpu_single_node.sh. Each stage has its
# own time limit and a failing stage does not stop the next one; the exit code says whether all passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-runs/gpu_check}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
if [[ -n "${WHEELS:-}" ]]; then  # into a private folder: the image's own packages stay as they are
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
    "$WHEELS"/*.whl || { echo "error: could not install the wheels in $WHEELS" >&2; exit 2; }
  export PYTHONPATH="/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
TRAIN_S="${TRAIN_S:-90}"  # training seconds of the colocated run
MIN_GAIN="${MIN_GAIN:-20}"
MEMORY_ARGS=()  # the shipped 1.5B shapes
HANDOVER_ARGS=(--device cuda --replicas 1 --repeats 3 --bucket-mb 1024 --bench-shape 1536,28,8960,151936 --handover wire,shared)
# the acceptance row: the DeepSeek-R1-Distill-Qwen-1.5B shape's long-tailed RL batch of 256 slots, % of HBM peak.
# Four decode widths, not the nine powers of two: each is a compile of the 28-layer step (on the H200 the first
# compiles took ~50 s each), and the tail's few rows cost about the same at width 16 as at 1 there. The kernel
# profile names what bounds the row (at width 256 alone it ran at 84 ms per step, 1% of HBM: docs/generator.md).
BENCH_ARGS=(--models r1-1.5b --workloads rl-tail --batch 256 --bucket-widths 1,16,64,256 --kernel-profile 15)
if [[ "${GPU_CHECK_ON_CPU:-0}" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  TRAIN_S="${TRAIN_S_CPU:-40}"
  MIN_GAIN=-100  # 40 s of one CPU train rank proves the flow, not the learning
  # the 1.5B shapes at CPU size: one layer, short sequences; the hand-over at the benchmark's CPU model
  MEMORY_ARGS=(--layers 1 train.micro_batch_tokens=1024 train.prompts_per_step=2 rollout.samples_per_prompt=4
    rollout.max_new_tokens=200 rollout.max_seq_len=320 data.max_prompt_tokens=64)
  HANDOVER_ARGS=(--device cpu --replicas 1 --repeats 2 --handover wire,shared)
  BENCH_ARGS=(--models r1-1.5b --workloads rl-tail --batch 4 --layers 1 --max-new-tokens 48 --kernel-profile 15)
  # 2 cores do in minutes what the GPU does in seconds
  TEST_TIMEOUT=600 MEMORY_TIMEOUT=600 HANDOVER_TIMEOUT=300 BENCH_TIMEOUT=600 STARTUP_S=300 ETA0_TIMEOUT=300
  echo "dry run on CPU: CUDA hidden" | tee "$OUT/env.txt"
else
  command -v nvidia-smi > /dev/null || { echo "error: nvidia-smi not found: this script needs a GPU" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
fi
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import importlib.util, torch, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"flash_attn {'installed' if importlib.util.find_spec('flash_attn') else 'not installed'}, NCCL {nccl}, GPU {gpu}")
import importlib.metadata as md
import datasets, math_verify  # noqa: F401  (train.py's task data and reward: a missing one fails here, named)
print(", ".join(f"{p} {md.version(p)}" for p in ("datasets", "pyarrow", "math-verify")))
PY
[[ ${PIPESTATUS[0]} == 0 ]] || { echo "error: a package train.py needs is missing (see above; WHEELS=...)" >&2; exit 2; }

# Two phases, each stage under its own time limit (a failing stage does not stop the next): the rollout benchmark
# alone on the GPU (a timing; its warm-up compiles a CUDA graph per decode bucket); then four jobs at once (the GPU
# has the memory and the host the cores): the GPU tests, the colocated runs, the 1.5B memory step and the hand-over
# (a timing, but its two paths differ ~50x: run alone after the others, its 1.82B models' set-up outran 60 s).
# Limits: 240 + 270 s, so the call ends within ~9 minutes; STAGES=bench or STAGES=checks runs one phase.
stage() { echo "== $1 [at ${SECONDS} s]"; }

gpu_tests() {
  # -o addopts=: one process on the one GPU (and the GPU image may lack pytest-xdist, which addopts names)
  timeout "${TEST_TIMEOUT:-270}" "$PYTHON" -m pytest -o addopts= -q -p no:cacheprovider --durations=8 tests/gpu/test_gpu.py
}

colocated_runs() {
  local ok=0
  rm -rf "$OUT/colocated" "$OUT/colocated_eta0"
  echo "colocated run (gpu_single), eta 4, ${TRAIN_S} s of training"
  timeout $((${TRAIN_S%.*} + ${STARTUP_S:-90})) "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 train.py \
    config=gpu_single logging.run_dir="$OUT" logging.run_name=colocated train.max_train_seconds="$TRAIN_S" \
    logging.progress=false > "$OUT/colocated.log" 2>&1 || { ok=1; tail -20 "$OUT/colocated.log"; }
  "$PYTHON" exp/check_run.py "$OUT/colocated" --eta 4 --min-gain "$MIN_GAIN" --min-steps 3 \
    | tee "$OUT/colocated_check.json" || ok=1
  echo "colocated run: eta 0, importance weights near 1"
  timeout "${ETA0_TIMEOUT:-90}" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 train.py config=gpu_single \
    logging.run_dir="$OUT" logging.run_name=colocated_eta0 max_staleness=0 train.total_steps=8 \
    train.max_train_seconds=0 data.num_test=32 logging.progress=false > "$OUT/colocated_eta0.log" 2>&1 \
    || { ok=1; tail -20 "$OUT/colocated_eta0.log"; }
  "$PYTHON" exp/check_run.py "$OUT/colocated_eta0" --eta 0 --weights-near-one 0.02 --min-steps 8 \
    | tee "$OUT/colocated_eta0_check.json" || ok=1
  return $ok
}

handover() {
  timeout "${HANDOVER_TIMEOUT:-240}" "$PYTHON" exp/bench_weight_sync.py "${HANDOVER_ARGS[@]}" 2>&1 | grep -v "^Loading weights"
  return "${PIPESTATUS[0]}"
}

memory_step() {
  timeout "${MEMORY_TIMEOUT:-270}" "$PYTHON" exp/estimate_memory.py --config gpu_r1_1.5b --measure-train-step \
    "${MEMORY_ARGS[@]}" 2>&1 | grep -v "^USDT"
  return "${PIPESTATUS[0]}"
}

STAGES="${STAGES:-bench,checks}"
for s in ${STAGES//,/ }; do
  [[ $s == bench || $s == checks ]] || { echo "error: STAGES: unknown stage '$s' (bench, checks)" >&2; exit 2; }
done
runs() { [[ ",$STAGES," == *",$1,"* ]]; }
status=0
if runs bench; then
  stage "phase 1: exp/bench_rollout.py ${BENCH_ARGS[*]}"
  timeout "${BENCH_TIMEOUT:-240}" "$PYTHON" exp/bench_rollout.py "${BENCH_ARGS[@]}" 2>&1 | grep -v "^Loading weights" \
    | tee "$OUT/bench.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi

if runs checks; then
  stage "phase 2, at once: tests/gpu/test_gpu.py | colocated runs (gpu_single) | one gpu_r1_1.5b train step vs exp/estimate_memory.py | weight hand-over, pinned host (wire) vs CUDA IPC (shared)"
  gpu_tests > "$OUT/test_gpu.log" 2>&1 &
  tests_pid=$!
  colocated_runs > "$OUT/colocated_stage.log" 2>&1 &
  colocated_pid=$!
  memory_step > "$OUT/memory.log" 2>&1 &
  memory_pid=$!
  handover > "$OUT/handover.log" 2>&1 &
  handover_pid=$!
  for job in "tests/gpu/test_gpu.py:$tests_pid:test_gpu.log" "colocated runs:$colocated_pid:colocated_stage.log" \
    "memory:$memory_pid:memory.log" "hand-over:$handover_pid:handover.log"; do
    IFS=: read -r name pid log <<< "$job"
    if wait "$pid"; then result=passed; else result=FAILED; status=1; fi
    stage "$name: $result ($OUT/$log)"
    tail -25 "$OUT/$log"
  done
fi

stage "gpu_check: $([[ $status == 0 ]] && echo all stages passed || echo SOME STAGE FAILED) (logs in $OUT)"
exit $status
