#!/usr/bin/env bash
# Every single-GPU check in one call (a lent GPU's time is short, ~8 min in all): the environment, tests/test_gpu.py
# (CUDA fp32 exactness, bf16, CUDA-graph decode and weight swaps, the trainer on CUDA, a colocated run), the
# colocated end-to-end run of the tiny model (exp/configs/gpu_single.yaml: a rollout and a train rank on this one GPU; it
# must learn >= 20 points within ~3 min of training, within the staleness bound, exactly once), an eta = 0 run
# (importance weights near 1: generator and trainer agree), one train step of the 1.5B config (random weights, the
# shipped shapes) measured against exp/estimate_memory.py, the weight hand-over of a 1.5B-shaped model from the train
# rank to a rollout rank on this GPU (pinned host memory, as colocated runs do), and the rollout benchmark.
#
#   OUT=exp/gpu_logs/h200 bash exp/gpu_check.sh   # logs: $OUT/{env.txt,test_gpu.log,colocated*,memory.log,handover.log,bench.log}
#   GPU_CHECK_ON_CPU=1 OUT=/tmp/dry bash exp/gpu_check.sh  # dry run on CPU (CUDA hidden, shorter runs, no gain check)
#
# Multi-GPU paths (NCCL between rollout and train ranks) need >= 2 GPUs: exp/gpu_single_node.sh. Each stage has its
# own time limit and a failing stage does not stop the next one; the exit code says whether all passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-runs/gpu_check}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
TRAIN_S="${TRAIN_S:-170}"  # training seconds of the colocated run
MIN_GAIN="${MIN_GAIN:-20}"
MEMORY_ARGS=()  # the shipped 1.5B shapes
HANDOVER_ARGS=(--device cuda --replicas 1 --repeats 3 --bucket-mb 1024 --bench-shape 1536,28,8960,151936)
if [[ "${GPU_CHECK_ON_CPU:-0}" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  TRAIN_S="${TRAIN_S_CPU:-40}"
  MIN_GAIN=-100  # 40 s of one CPU train rank proves the flow, not the learning
  # the 1.5B shapes at CPU size: one layer, short sequences; the hand-over at the benchmark's CPU model
  MEMORY_ARGS=(--layers 1 train.micro_batch_tokens=1024 train.prompts_per_step=2 rollout.samples_per_prompt=4
    rollout.max_new_tokens=200 rollout.max_seq_len=320 data.max_prompt_tokens=64)
  HANDOVER_ARGS=(--device cpu --replicas 1 --repeats 2)
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
PY

status=0
stage() { echo "== $1"; }
stage "tests/test_gpu.py"
timeout "${TEST_TIMEOUT:-240}" "$PYTHON" -m pytest -q -p no:cacheprovider --durations=8 tests/test_gpu.py 2>&1 \
  | tee "$OUT/test_gpu.log" || status=1

stage "colocated run (gpu_single), eta 4, ${TRAIN_S} s of training"
rm -rf "$OUT/colocated"
timeout $((${TRAIN_S%.*} + 150)) "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 train.py \
  config=gpu_single logging.run_dir="$OUT" logging.run_name=colocated train.max_train_seconds="$TRAIN_S" \
  logging.progress=false > "$OUT/colocated.log" 2>&1 || { status=1; tail -20 "$OUT/colocated.log"; }
"$PYTHON" exp/check_run.py "$OUT/colocated" --eta 4 --min-gain "$MIN_GAIN" --min-steps 3 | tee "$OUT/colocated_check.json" \
  || status=1

stage "colocated run: eta 0, importance weights near 1"
rm -rf "$OUT/colocated_eta0"
timeout 300 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 train.py config=gpu_single \
  logging.run_dir="$OUT" logging.run_name=colocated_eta0 max_staleness=0 train.total_steps=8 train.max_train_seconds=0 \
  data.num_test=32 logging.progress=false > "$OUT/colocated_eta0.log" 2>&1 || { status=1; tail -20 "$OUT/colocated_eta0.log"; }
"$PYTHON" exp/check_run.py "$OUT/colocated_eta0" --eta 0 --weights-near-one 0.02 --min-steps 8 \
  | tee "$OUT/colocated_eta0_check.json" || status=1

stage "memory: one train step of gpu_r1_1.5b (random weights) vs exp/estimate_memory.py"
timeout "${MEMORY_TIMEOUT:-420}" "$PYTHON" exp/estimate_memory.py --config gpu_r1_1.5b --measure-train-step \
  "${MEMORY_ARGS[@]}" 2>&1 | grep -v "^USDT" | tee "$OUT/memory.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1

stage "weight hand-over: train rank -> rollout rank on one device (exp/bench_weight_sync.py)"
timeout "${HANDOVER_TIMEOUT:-300}" "$PYTHON" exp/bench_weight_sync.py "${HANDOVER_ARGS[@]}" 2>&1 | tee "$OUT/handover.log"
[[ ${PIPESTATUS[0]} == 0 ]] || status=1

stage "exp/bench_rollout.py"
timeout "${BENCH_TIMEOUT:-180}" "$PYTHON" exp/bench_rollout.py --models "${BENCH_MODELS:-tiny,rand-30m}" \
  --workloads "${BENCH_WORKLOADS:-rl,rl-tail,greedy}" --repeats "${REPEATS:-1}" --compile "${COMPILE:-auto}" 2>&1 \
  | grep -v "^Loading weights" | tee "$OUT/bench.log" || status=1
echo "gpu_check: $([[ $status == 0 ]] && echo all stages passed || echo SOME STAGE FAILED) (logs in $OUT)"
exit $status
