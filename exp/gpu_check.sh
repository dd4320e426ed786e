#!/usr/bin/env bash
# Every single-GPU check in one call (a lent GPU's time is short): the environment, tests/test_gpu.py (CUDA fp32
# exactness, bf16, CUDA-graph decode and weight swaps, the trainer on CUDA under NCCL) and the rollout benchmark.
#
#   OUT=/tmp/gpu_check bash exp/gpu_check.sh            # logs: $OUT/{env.txt,test_gpu.log,bench.log}
#   BENCH_MODELS=tiny BENCH_WORKLOADS=rl REPEATS=3 bash exp/gpu_check.sh
#
# Multi-GPU paths (NCCL weight broadcast between rollout and train ranks, torchrun train.py) need >= 2 GPUs:
# exp/gpu_single_node.sh. Each stage has its own time limit and a failing stage does not stop the next one.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-runs/gpu_check}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
command -v nvidia-smi > /dev/null || { echo "error: nvidia-smi not found: this script needs a GPU" >&2; exit 2; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
"$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import importlib.util, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"flash_attn {'installed' if importlib.util.find_spec('flash_attn') else 'not installed'}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, GPU {torch.cuda.get_device_name()}")
PY

status=0
echo "== tests/test_gpu.py"
timeout "${TEST_TIMEOUT:-300}" "$PYTHON" -m pytest -q -p no:cacheprovider --durations=8 tests/test_gpu.py 2>&1 \
  | tee "$OUT/test_gpu.log" || status=1
echo "== exp/bench_rollout.py"
timeout "${BENCH_TIMEOUT:-300}" "$PYTHON" exp/bench_rollout.py --models "${BENCH_MODELS:-tiny,rand-30m}" \
  --workloads "${BENCH_WORKLOADS:-rl,rl-tail,greedy}" --repeats "${REPEATS:-1}" --compile "${COMPILE:-auto}" 2>&1 \
  | grep -v "^Loading weights" | tee "$OUT/bench.log" || status=1
exit $status
