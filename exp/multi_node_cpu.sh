#!/usr/bin/env bash
# A two-node launch rehearsed on this machine: two torchrun agents (node 0 and node 1, 2 CPU ranks each) meet in a
# c10d rendezvous on loopback and run train.py over a plan for exp/clusters/cpu_2node.yaml (two machines of 2 CPU
# "GPUs"), the way exp/gpu_multi_node.sh launches real nodes. Both agents run in the background; the script waits for
# both and prints both exit codes (and exits 0 only if both are 0).
#
#   bash exp/multi_node_cpu.sh                        # plans into $OUT/plan.json, logs in $OUT/node{0,1}.log
#   PLAN=my_plan.json STEPS=4 bash exp/multi_node_cpu.sh train.lr=2e-5   # a given plan; extra train.py overrides
#
# The plan is made with --rollout-tp $ROLLOUT_TP (default 1: every rollout rank its own TP-1 replica). With c10d,
# torchrun orders the nodes by (host name, agent pid), not by --node_rank: on one host the agent started first (the
# lower pid) is node 0. The two machines here are alike, so either order is the plan's. Both agents match the
# endpoint's host, so the rendezvous store would go to whichever binds the port first; node 0's agent is made its
# host (is_host), because train.py's ranks on node 0 leave last after an error so that the other agents, still
# reading the store, see their own ranks' exit codes first.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
MODEL="${MODEL:-exp/tiny-model}"
CLUSTER="${CLUSTER:-exp/clusters/cpu_2node.yaml}"
OUT="${OUT:-runs/multi_node_cpu-$(date +%Y%m%d-%H%M%S)}"
STEPS="${STEPS:-2}"
ROLLOUT_TP="${ROLLOUT_TP:-1}"
NPROC=2 # ranks per node: the cluster's machines have 2 CPU "GPUs" each
JOIN_TIMEOUT="${JOIN_TIMEOUT:-60}" # seconds an agent waits for the other at the rendezvous
PORT="${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

if [[ ! -d "$MODEL" ]]; then
  echo "error: model '$MODEL' not found; build it with '$PYTHON exp/make_tiny_model.py --out exp/tiny-model' or set MODEL=<dir>" >&2
  exit 2
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1 HEXRL_THREADS=1

if [[ -z "${PLAN:-}" ]]; then
  PLAN="$OUT/plan.json"
  # the workload of the run below, so the planner sizes replicas for it
  "$PYTHON" schedule.py --cluster "$CLUSTER" --model "$MODEL" --prompts 2 --samples 4 --prompt-len 20 --gen-mean 16 \
    --max-batch 16 --precision fp32 --ppo-minibatches 1 --microbatch-tokens 8192 --rollout-tp "$ROLLOUT_TP" \
    --out "$PLAN" --quiet \
    || { echo "error: planning $CLUSTER failed" >&2; exit 2; }
fi
[[ -f "$PLAN" ]] || { echo "error: plan '$PLAN' not found" >&2; exit 2; }

pids=()
for node in 0 1; do
  "$PYTHON" -m torch.distributed.run --nnodes=2 --node_rank="$node" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:$PORT" --rdzv_id="hexrl-multi-node-cpu-$PORT" \
    --rdzv_conf="join_timeout=$JOIN_TIMEOUT,is_host=$((node == 0))" --local_addr=127.0.0.1 --max_restarts=0 \
    train.py model.path="$MODEL" plan="$PLAN" logging.run_dir="$OUT" logging.run_name=run logging.wandb=disabled \
    logging.progress=false logging.eval_every=0 train.total_steps="$STEPS" train.max_train_seconds=0 \
    train.prompts_per_step=2 rollout.samples_per_prompt=4 rollout.max_new_tokens=16 data.num_train=100 \
    data.num_test=4 dist.timeout_s=120 dist.rollout_timeout_s=60 "$@" > "$OUT/node$node.log" 2>&1 &
  pids+=("$!")
  sleep 0.5 # node 0's agent starts first (lower pid), so on this host it is c10d's node 0 too
done

status=0
for node in 0 1; do
  wait "${pids[$node]}"
  rc=$?
  # torchrun's agent exits 1 whenever a worker fails; the workers' own codes are in its failure summary
  workers="$(grep -o 'exitcode  : [-0-9]*' "$OUT/node$node.log" | awk '{print $3}' | paste -sd, -)"
  echo "node $node exit code: $rc${workers:+ (worker exit codes: $workers)} (log: $OUT/node$node.log)"
  ((rc == 0)) || status=1
done
exit "$status"
