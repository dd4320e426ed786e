#!/usr/bin/env bash
# Several GPU nodes, possibly of different GPU types: the planner's heterogeneous plan vs homogeneous baselines.
# (exp/multi_node_cpu.sh rehearses the same two-agent launch on one CPU host.)
#
# 1. once, on any machine (CPU only): plan for the cluster you have and for its homogeneous parts
#      CLUSTER=exp/clusters/hetero_24.yaml SIZE=7b OUT=/shared/hex7b bash exp/gpu_multi_node.sh plan
#    -> $OUT/plan.json (the whole cluster), $OUT/plan_<type>.json (only the machines of one GPU type), and
#       each plan's predicted step time, tokens/s and $/h printed side by side.
# 2. on every node of the run, with the plan on a shared path (or copied to each node):
#      CLUSTER=... SIZE=7b OUT=/shared/hex7b bash exp/gpu_multi_node.sh train <node rank> <master addr> [<nproc>] \
#          [train.py overrides]
#    (or NODE_RANK=, MASTER_ADDR=, NPROC= in the environment). nproc defaults to the plan's rank count for that
#    node and must equal it. PLAN=plan_H800 runs a homogeneous baseline on the H800 machines only (start it on
#    those nodes alone).
#
# Which node is which (plan.py, "placement"): node k of the launch is the k-th machine in the plan's
# rank order -- schedule.py puts the machines holding pipeline stage 0 first, so that need not be the k-th machine
# of the cluster YAML; the line "node k = machine m" printed below names it. The node runs exactly that machine's
# ranks (LOCAL_WORLD_SIZE = its rank count; local rank j = its j-th rank) on GPUs of its type. Before starting,
# this script checks the node rank you gave against the plan (rank count, GPU count and GPU name via nvidia-smi);
# train.py checks what torchrun actually assigned on every rank and ends the run on every node with one line and
# exit code 2 if it differs. That matters because the default rendezvous, c10d, ignores --node-rank and orders
# nodes by (host name, agent pid): with machines that differ, either give node ranks in host-name order or use
# RDZV_BACKEND=static, which keeps the node rank given here. HEXRL_ANY_DEVICE=1 skips the GPU-type comparisons.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODE="${1:-}"; shift || true
SIZE="${SIZE:-7b}"
PYTHON="${PYTHON:-python}"
CLUSTER="${CLUSTER:?set CLUSTER=<cluster YAML describing the nodes, e.g. exp/clusters/hetero_24.yaml>}"
OUT="${OUT:?set OUT=<a directory on a shared path, the same on every node>}"
ETA="${ETA:-4}"
STEPS="${STEPS:-100}"
case "$SIZE" in
  1.5b) PLANNER_MODEL=deepseek-r1-distill-qwen-1.5b MAX_BATCH=128 MICRO=32768 ;;
  7b)   PLANNER_MODEL=deepseek-r1-distill-qwen-7b   MAX_BATCH=64  MICRO=16384 ;;
  14b)  PLANNER_MODEL=deepseek-r1-distill-qwen-14b  MAX_BATCH=32  MICRO=16384 ;;
  *) echo "error: SIZE must be 1.5b, 7b or 14b, got '$SIZE'" >&2; exit 2 ;;
esac
WORKLOAD=(--model "$PLANNER_MODEL" --prompts 64 --samples 16 --prompt-len 200 --gen-mean 1500
          --gen-quantiles 0.5:1000,0.9:3500,0.99:7000 --eta "$ETA" --precision bf16 --max-batch "$MAX_BATCH"
          --ppo-minibatches 4 --microbatch-tokens "$MICRO")

case "$MODE" in
plan)
  mkdir -p "$OUT"
  echo "== heterogeneous plan for $CLUSTER"
  "$PYTHON" schedule.py --cluster "$CLUSTER" "${WORKLOAD[@]}" --out "$OUT/plan.json" --plot
  # homogeneous baselines: the same cluster restricted to one GPU type
  "$PYTHON" - "$CLUSTER" "$OUT" <<'PY'
import sys, yaml
cluster, out = yaml.safe_load(open(sys.argv[1])), sys.argv[2]
for gpu_type in cluster["gpu_types"]:
    machines = [m for m in cluster["machines"] if m["gpu_type"] == gpu_type]
    if len(machines) == len(cluster["machines"]):
        continue                                 # already homogeneous: plan.json is the baseline
    sub = {"name": f"{cluster.get('name', 'cluster')}_{gpu_type}", "gpu_types": {gpu_type: cluster["gpu_types"][gpu_type]},
           "machines": machines,
           "links": {"inter_gbps": {k: v for k, v in cluster.get("links", {}).get("inter_gbps", {}).items()
                                    if k == f"{gpu_type}-{gpu_type}"}}}
    with open(f"{out}/cluster_{gpu_type}.yaml", "w") as f:
        yaml.safe_dump(sub, f, sort_keys=False)
    print(gpu_type)
PY
  for sub in "$OUT"/cluster_*.yaml; do
    [[ -e "$sub" ]] || continue
    t="$(basename "$sub" .yaml)"; t="${t#cluster_}"
    echo "== homogeneous baseline: only the $t machines"
    "$PYTHON" schedule.py --cluster "$sub" "${WORKLOAD[@]}" --out "$OUT/plan_$t.json" --quiet
  done
  "$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
print(f"{'plan':<16} {'GPUs':>5} {'step s':>9} {'tokens/s':>10} {'$/h':>8} {'tokens/$':>10}")
for p in sorted(pathlib.Path(sys.argv[1]).glob("plan*.json")):
    plan = json.loads(p.read_text()); pr = plan["predicted"]
    print(f"{p.stem:<16} {plan['world_size']:>5} {pr['step_s']:>9.1f} {pr['tokens_per_s']:>10.0f} "
          f"{pr['dollars_per_hour']:>8.2f} {pr['tokens_per_dollar']:>10.0f}")
PY
  ;;
train)
  if [[ "${1:-}" =~ ^[0-9]+$ ]]; then # positional: <node rank> <master addr> [<nproc>]
    NODE_RANK="$1" MASTER_ADDR="${2:-}"
    shift $(($# < 2 ? $# : 2))
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then NPROC="$1"; shift; fi
  fi
  if [[ -z "${NODE_RANK:-}" || -z "${MASTER_ADDR:-}" ]]; then
    echo "error: give the node rank (0 on the rendezvous host) and the master address (host of node 0):" \
      "$0 train <node rank> <master addr> [<nproc>] [train.py overrides]" >&2
    exit 2
  fi
  PLAN_NAME="${PLAN:-plan}"
  PLAN_FILE="$OUT/$PLAN_NAME.json"
  [[ -f "$PLAN_FILE" ]] || { echo "error: $PLAN_FILE not found; run '$0 plan' first (and share \$OUT)" >&2; exit 2; }
  # this node's machine in the plan: node k = the k-th machine in rank order (plan.plan_nodes)
  placement="$("$PYTHON" - "$PLAN_FILE" "$NODE_RANK" <<'PY'
import json, sys
from plan import PlanError, plan_nodes
plan, node = json.load(open(sys.argv[1])), int(sys.argv[2])
try:
    nodes = plan_nodes(plan)
except PlanError as e:
    sys.exit(f"error: {e}")
if nodes is None:
    sys.exit("error: the plan has no `machine` fields: make it with schedule.py for the cluster of these nodes")
if node >= len(nodes):
    sys.exit(f"error: node rank {node}, but the plan spans {len(nodes)} machines (node ranks 0..{len(nodes) - 1})")
n = nodes[node]
print(len(nodes), n["count"], n["gpu_type"], n["machine"], n["first"])
PY
  )" || exit 2
  read -r NNODES GPUS_HERE TYPE_HERE MACHINE_HERE FIRST_HERE <<< "$placement"
  NPROC="${NPROC:-$GPUS_HERE}"
  echo "node $NODE_RANK = machine $MACHINE_HERE of the plan: $GPUS_HERE x $TYPE_HERE, global ranks $FIRST_HERE..$((FIRST_HERE + GPUS_HERE - 1)) of $NNODES nodes"
  if [[ "$NPROC" != "$GPUS_HERE" ]]; then
    echo "error: node $NODE_RANK: the plan puts $GPUS_HERE ranks on machine $MACHINE_HERE, asked to run $NPROC" >&2
    exit 2
  fi
  command -v nvidia-smi > /dev/null || { echo "error: node $NODE_RANK: no nvidia-smi here; is this a GPU node?" >&2; exit 2; }
  local_gpus="$(nvidia-smi --list-gpus | wc -l)"
  local_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  if ((local_gpus < GPUS_HERE)); then
    echo "error: node $NODE_RANK: the plan puts $GPUS_HERE x $TYPE_HERE here, this node has $local_gpus GPUs ($local_name)" >&2
    exit 2
  fi
  if [[ "${HEXRL_ANY_DEVICE:-}" != 1 ]] \
    && ! "$PYTHON" -c 'import sys; from plan import device_matches; sys.exit(not device_matches(*sys.argv[1:]))' \
      "$TYPE_HERE" "$local_name"; then
    echo "error: node $NODE_RANK: the plan puts $TYPE_HERE GPUs here, this node has '$local_name' (HEXRL_ANY_DEVICE=1 to run anyway)" >&2
    exit 2
  fi
  export HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}" OMP_NUM_THREADS=4
  MODEL_ARG=()
  [[ -n "${MODEL_PATH:-}" ]] && MODEL_ARG=(model.path="$MODEL_PATH")
  RUN_NAME="${RUN_NAME:-${PLAN_NAME}_eta$ETA}"
  "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$NPROC" \
    --rdzv-backend="${RDZV_BACKEND:-c10d}" --rdzv-endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" \
    --rdzv-id="${RDZV_ID:-hexrl-$SIZE-$RUN_NAME}" \
    train.py config="gpu_r1_$SIZE" "${MODEL_ARG[@]}" plan="$PLAN_FILE" staleness.max_staleness="$ETA" \
    train.total_steps="$STEPS" logging.run_dir="$OUT/runs" logging.run_name="$RUN_NAME" logging.progress=false "$@"
  if [[ "$NODE_RANK" == 0 ]]; then
    echo "compare when all runs are done: $PYTHON exp/compare.py $OUT/runs"
  fi
  ;;
*)
  echo "usage: CLUSTER=<yaml> OUT=<shared dir> [SIZE=1.5b|7b|14b] bash exp/gpu_multi_node.sh plan | train <node rank> <master addr> [<nproc>] [train.py overrides]" >&2
  exit 2 ;;
esac
