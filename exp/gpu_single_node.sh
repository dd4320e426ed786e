#!/usr/bin/env bash
# One GPU node: the planner's plan vs baselines for DeepSeek-R1-Distill-Qwen 1.5B / 7B / 14B on GSM8K.
#
#   SIZE=7b bash exp/gpu_single_node.sh                    # -> runs/gpu_single_7b-<time>/{planned,planned_sync,even_split}
#   SIZE=1.5b STEPS=100 RUNS="planned even_split" bash exp/gpu_single_node.sh data.task=deepscaler
#
# Runs (each `python -m torch.distributed.run --standalone --nproc_per_node=$NGPU train.py config=gpu_r1_$SIZE ...`):
#   planned       schedule.py's split + trainer layout for this node, asynchronous (η = ETA, default 4)
#   planned_sync  the same plan at η = 0 (synchronous RL: what asynchrony buys on the same GPUs)
#   even_split    no planner: half the GPUs generate, half train data-parallel (AReaL-style homogeneous
#                 split; skipped for 14B, whose full Adam state does not fit one 80 GB GPU without TP/PP)
# then exp/compare.py tabulates and plots them. One node is one GPU type, so the heterogeneous comparison
# proper is exp/gpu_multi_node.sh; here the planner still chooses the rollout/train split and layout.
# Environment: MODEL_PATH (local copy of the weights; default: the hub id in the config), GPU_TYPE, NGPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SIZE="${SIZE:-1.5b}"
PYTHON="${PYTHON:-python}"
STEPS="${STEPS:-50}"
ETA="${ETA:-4}"
RUNS="${RUNS:-planned planned_sync even_split}"
OUT="${OUT:-runs/gpu_single_${SIZE}-$(date +%Y%m%d-%H%M%S)}"
case "$SIZE" in
  1.5b) PLANNER_MODEL=deepseek-r1-distill-qwen-1.5b MAX_BATCH=128 MICRO=32768 ;;
  7b)   PLANNER_MODEL=deepseek-r1-distill-qwen-7b   MAX_BATCH=64  MICRO=16384 ;;
  14b)  PLANNER_MODEL=deepseek-r1-distill-qwen-14b  MAX_BATCH=32  MICRO=16384 ;;
  *) echo "error: SIZE must be 1.5b, 7b or 14b, got '$SIZE'" >&2; exit 2 ;;
esac
command -v nvidia-smi > /dev/null || { echo "error: nvidia-smi not found: this script needs a GPU node" >&2; exit 2; }
NGPU="${NGPU:-$(nvidia-smi --list-gpus | wc -l)}"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
if (( NGPU < 2 )); then
  echo "error: hexrl needs at least 2 GPUs on the node (one rollout, one train), found $NGPU" >&2
  exit 2
fi
# Spec-sheet numbers per GPU type (dense bf16 TFLOPS, HBM TB/s, NVLink GB/s one way); the planner's
# efficiency constants (schedule.py calibrate) turn them into achieved numbers.
if [[ -z "${GPU_TYPE:-}" ]]; then
  case "$GPU_NAME" in
    *H800*) GPU_TYPE=H800 ;; *H200*) GPU_TYPE=H200 ;; *H100*) GPU_TYPE=H100 ;; *H20*) GPU_TYPE=H20 ;;
    *A100*) GPU_TYPE=A100 ;; *L40S*) GPU_TYPE=L40S ;;
    *) echo "error: unknown GPU '$GPU_NAME'; set GPU_TYPE= and GPU_SPEC='{hbm_gb: .., tflops: .., hbm_tbps: .., dollars_per_hour: .., intra_gbps: ..}'" >&2; exit 2 ;;
  esac
fi
case "$GPU_TYPE" in
  H800) SPEC="{hbm_gb: 80, tflops: 756, hbm_tbps: 2.0, dollars_per_hour: 5.28, intra_gbps: 200}" ;;
  H100) SPEC="{hbm_gb: 80, tflops: 989, hbm_tbps: 3.35, dollars_per_hour: 5.0, intra_gbps: 450}" ;;
  H200) SPEC="{hbm_gb: 141, tflops: 989, hbm_tbps: 4.8, dollars_per_hour: 6.0, intra_gbps: 450}" ;;
  H20)  SPEC="{hbm_gb: 96, tflops: 148, hbm_tbps: 4.0, dollars_per_hour: 1.85, intra_gbps: 450}" ;;
  A100) SPEC="{hbm_gb: 80, tflops: 312, hbm_tbps: 2.0, dollars_per_hour: 2.5, intra_gbps: 300}" ;;
  L40S) SPEC="{hbm_gb: 48, tflops: 362, hbm_tbps: 0.864, dollars_per_hour: 1.5, intra_gbps: 32}" ;;
  *) SPEC="${GPU_SPEC:?set GPU_SPEC for GPU_TYPE=$GPU_TYPE}" ;;
esac
SPEC="${GPU_SPEC:-$SPEC}"

mkdir -p "$OUT"
cat > "$OUT/cluster.yaml" <<YAML
name: node_${GPU_TYPE}_${NGPU}
gpu_types:
  $GPU_TYPE: $SPEC
machines:
  - {gpu_type: $GPU_TYPE, gpus: $NGPU, count: 1}
links:
  inter_gbps: {$GPU_TYPE-$GPU_TYPE: 5.0}
YAML
echo "node: $NGPU x $GPU_NAME ($GPU_TYPE); model $SIZE; output $OUT"
"$PYTHON" schedule.py --cluster "$OUT/cluster.yaml" --model "$PLANNER_MODEL" --prompts 64 --samples 16 \
  --prompt-len 200 --gen-mean 1500 --gen-quantiles 0.5:1000,0.9:3500,0.99:7000 --eta "$ETA" --precision bf16 \
  --max-batch "$MAX_BATCH" --ppo-minibatches 4 --microbatch-tokens "$MICRO" --out "$OUT/plan.json" --plot

export HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}" OMP_NUM_THREADS=4
MODEL_ARG=()
[[ -n "${MODEL_PATH:-}" ]] && MODEL_ARG=(model.path="$MODEL_PATH")
launch() {  # name, then train.py overrides
  local name="$1"; shift
  echo "== $name"
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py config="gpu_r1_$SIZE" "${MODEL_ARG[@]}" \
    train.total_steps="$STEPS" logging.run_dir="$OUT" logging.run_name="$name" logging.progress=false "$@" \
    2>&1 | tee "$OUT/$name.log"
}
for run in $RUNS; do
  case "$run" in
    planned)      launch planned plan="$OUT/plan.json" staleness.max_staleness="$ETA" "$@" ;;
    planned_sync) launch planned_sync plan="$OUT/plan.json" staleness.max_staleness=0 "$@" ;;
    even_split)
      if [[ "$SIZE" == 14b ]]; then echo "== even_split skipped for 14B (DP-only trainer does not fit)"; continue; fi
      launch even_split plan.num_rollout=$(( NGPU / 2 )) staleness.max_staleness="$ETA" "$@" ;;
    *) echo "error: unknown run '$run' (planned, planned_sync, even_split)" >&2; exit 2 ;;
  esac
done
"$PYTHON" exp/compare.py "$OUT"
