"""Baseline for the CPU demo: continue the warm start's *supervised* training for the same wall time
that RL gets, and measure the same held-out greedy accuracy.

    python exp/sft_baseline.py --seconds 270 --out runs/sft_baseline.json
    python exp/plot_demo.py runs/<rl run> runs/sft_baseline.json --out exp/demo_curves.png

Same data (the warm start's worked solutions, mistakes included), same 500 held-out problems
(test split of the default config), evaluated every --eval-every seconds of training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import greedy_accuracy, sft  # noqa: E402

from config import load_config  # noqa: E402
from tasks import make_arith_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="exp/tiny-model")
    ap.add_argument("--seconds", type=float, default=270.0)
    ap.add_argument("--eval-every", type=float, default=60.0)
    ap.add_argument("--lr", type=float, default=2e-4)  # where the warm start's schedule ended
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/sft_baseline.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warm = json.loads((Path(args.model) / "warm_start.json").read_text())
    data_cfg = load_config([]).data
    ds = make_arith_dataset(data_cfg.num_train, data_cfg.num_test, data_cfg.seed)
    train_rows, test_rows = list(ds["train"]), list(ds["test"])
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    curve = [{"train_seconds": 0.0, "eval_accuracy": greedy_accuracy(model, tok, test_rows)}]
    print(curve[-1], flush=True)
    trained, step = 0.0, 0
    while trained < args.seconds - 1e-6:
        chunk = min(args.eval_every, args.seconds - trained)
        t0 = time.time()
        step += sft(
            model,
            tok,
            train_rows,
            seconds=chunk,
            lr=args.lr,
            mistake_rate=warm["mistake_rate"],
            mistakes=warm.get("mistakes", "random"),
            seed=warm["seed"] + 1 + len(curve),
            log_every=10**9,
            opt=opt,
            constant_lr=True,
        )
        trained += time.time() - t0
        curve.append({"train_seconds": trained, "steps": step, "eval_accuracy": greedy_accuracy(model, tok, test_rows)})
        print(curve[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kind": "sft_baseline", "lr": args.lr, "curve": curve}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
