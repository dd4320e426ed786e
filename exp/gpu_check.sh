#!/usr/bin/env bash
# Every single-GPU check in one call (a lent GPU's time is short, ~8 min in all): the environment, tests/test_gpu.py
# (CUDA fp32 exactness, bf16, CUDA-graph decode and weight swaps, the trainer on CUDA, a colocated run), the
# colocated end-to-end run of the tiny model (exp/configs/gpu_single.yaml: a rollout and a train rank on this one GPU; it
# must learn >= 20 points within ~3 min of training, within the staleness bound, exactly once), an eta = 0 run
# (importance weights near 1: generator and trainer agree), the memory estimate against one measured train step,
# and the rollout benchmark.
#
#   OUT=exp/gpu_logs/h200 bash exp/gpu_check.sh          # logs: $OUT/{env.txt,test_gpu.log,colocated*,memory.log,bench.log}
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
if [[ "${GPU_CHECK_ON_CPU:-0}" == 1 ]]; then
  export CUDA_VISIBLE_DEVICES=""
  TRAIN_S="${TRAIN_S_CPU:-40}"
  MIN_GAIN=-100  # 40 s of one CPU train rank proves the flow, not the learning
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

stage "exp/bench_rollout.py"
timeout "${BENCH_TIMEOUT:-180}" "$PYTHON" exp/bench_rollout.py --models "${BENCH_MODELS:-tiny,rand-30m}" \
  --workloads "${BENCH_WORKLOADS:-rl,rl-tail,greedy}" --repeats "${REPEATS:-1}" --compile "${COMPILE:-auto}" 2>&1 \
  | grep -v "^Loading weights" | tee "$OUT/bench.log" || status=1
echo "gpu_check: $([[ $status == 0 ]] && echo all stages passed || echo SOME STAGE FAILED) (logs in $OUT)"
exit $status
