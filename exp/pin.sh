#!/usr/bin/env bash
# torchrun entry point that pins each local rank to its own CPU core(s) (torchrun has no per-rank taskset):
#
#   HEXRL_PIN_CORES="0 1" torchrun --no-python --nproc_per_node=2 exp/pin.sh train.py plan.num_rollout=1 ...
#
# HEXRL_PIN_CORES holds one taskset core list per LOCAL_RANK, space-separated ("0 1", or "0-1 2-3");
# HEXRL_PYTHON is the interpreter (default: the repo's .venv, else python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${HEXRL_PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$here/.venv/bin/python" ]]; then python="$here/.venv/bin/python"; else python="python3"; fi
fi
read -r -a cores <<< "${HEXRL_PIN_CORES:-}"
rank="${LOCAL_RANK:?exp/pin.sh must be started by torchrun (LOCAL_RANK is not set)}"
if (( ${#cores[@]} == 0 )); then
  exec "$python" "$@"                     # nothing to pin: behave like torchrun's default entry
fi
if (( rank >= ${#cores[@]} )); then
  echo "exp/pin.sh: LOCAL_RANK=$rank but HEXRL_PIN_CORES='${HEXRL_PIN_CORES}' names only ${#cores[@]} core list(s)" >&2
  exit 2
fi
exec taskset -c "${cores[$rank]}" "$python" "$@"
