"""Supervised baselines for the CPU demo, each for the same wall time RL gets and measured on the same held-out
greedy accuracy (500 problems, the default config's test split), evaluated every --eval-every seconds:

    python exp/sft_baseline.py --mode sft --seconds 270 --out runs/sft_baseline.json
    python exp/sft_baseline.py --mode sft-correct --seconds 270 --out runs/sft_correct.json
    python exp/sft_baseline.py --mode rft --seconds 270 --out runs/rft_baseline.json
    python exp/plot_demo.py runs/<rl run> runs/sft_baseline.json --out demo_curves.png

  sft          continue the warm start's own supervised training: its worked solutions, mistakes included
  sft-correct  supervised training on correct reference solutions of the training problems (no mistakes)
  rft          rejection-sampling fine-tuning: per round, the RL demo's 16 training prompts x 8 samples at
               temperature 1 from the current model (our generator), scored like RL, and one supervised step on
               the correct ones (loss on the response) -- what RL gets, minus the negative samples and advantages
The wall time counts everything each does (RFT's sampling and scoring too), on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_model import greedy_accuracy, sft  # noqa: E402

from config import load_config  # noqa: E402
from tasks import arith_splits, load_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="sft", choices=["sft", "sft-correct", "rft"])
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
    train_rows, test_rows = arith_splits(data_cfg.num_train, data_cfg.num_test, data_cfg.seed)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sampler = RejectionSampler(model, tok, load_config([]), seed=warm["seed"]) if args.mode == "rft" else None
    curve = [{"train_seconds": 0.0, "eval_accuracy": greedy_accuracy(model, tok, test_rows)}]
    print(curve[-1], flush=True)
    trained, step = 0.0, 0
    while trained < args.seconds - 1e-6:
        chunk = min(args.eval_every, args.seconds - trained)
        t0 = time.time()
        if sampler is not None:
            step += sampler.train(opt, chunk, args.lr)
        else:
            step += sft(
                model,
                tok,
                train_rows,
                seconds=chunk,
                lr=args.lr,
                mistake_rate=warm["mistake_rate"] if args.mode == "sft" else 0.0,
                mistakes=warm.get("mistakes", "random"),
                seed=warm["seed"] + 1 + len(curve),
                log_every=10**9,
                opt=opt,
                constant_lr=True,
            )
        trained += time.time() - t0
        point = {"train_seconds": trained, "steps": step, "eval_accuracy": greedy_accuracy(model, tok, test_rows)}
        if sampler is not None:
            point["kept_fraction"] = sampler.kept / max(sampler.sampled, 1)
        curve.append(point)
        print(curve[-1], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kind = {"sft": "sft_baseline", "sft-correct": "sft_correct_baseline", "rft": "rft_baseline"}[args.mode]
    out.write_text(json.dumps({"kind": kind, "lr": args.lr, "curve": curve}, indent=1) + "\n")
    print(f"wrote {out}")


class RejectionSampler:
    """RFT on the RL demo's training prompts and shapes: sample with our generator (a copy of the model that
    gets the trained weights before every round), score like RL, take one supervised step on the correct."""

    def __init__(self, model, tok, cfg, seed: int):
        import copy

        from generator import Generator

        self.model, self.tok, self.cfg = model, tok, cfg
        self.train_rows, _ = load_task(cfg.data, tok)
        r = cfg.rollout
        self.gen = Generator(copy.deepcopy(model).eval(), max_batch_size=128, max_seq_len=r.max_seq_len)
        self.rng = random.Random(seed)
        self.round, self.sampled, self.kept = 0, 0, 0

    def train(self, opt, seconds: float, lr: float) -> int:
        from generator import SamplingParams
        from reward_math import score

        r, steps, start = self.cfg.rollout, 0, time.time()
        for g in opt.param_groups:
            g["lr"] = lr
        while time.time() - start < seconds:
            self.gen.update_weights(self.model.state_dict(), self.round)
            rows = [self.rng.choice(self.train_rows) for _ in range(self.cfg.train.prompts_per_step)]
            prompts = [self.tok(row["prompt"])["input_ids"] for row in rows for _ in range(r.samples_per_prompt)]
            params = SamplingParams(
                temperature=1.0,
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=[self.tok.eos_token_id],
                seed=self.round,
            )
            outs = self.gen.generate(prompts, params)
            self.round += 1
            golds = [row["answer"] for row in rows for _ in range(r.samples_per_prompt)]
            keep = [
                (p, list(o.token_ids))
                for p, o, gold in zip(prompts, outs, golds)
                if score(self.tok.decode(o.token_ids, skip_special_tokens=True), gold) > 0
            ]
            self.sampled, self.kept = self.sampled + len(outs), self.kept + len(keep)
            if not keep:
                continue
            width = max(len(p) + len(t) for p, t in keep)
            ids = torch.full((len(keep), width), self.tok.pad_token_id)
            labels = torch.full((len(keep), width), -100)
            for i, (p, t) in enumerate(keep):
                ids[i, : len(p) + len(t)] = torch.tensor(p + t)
                labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)  # loss on the response only
            self.model.train()
            loss = self.model(input_ids=ids, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            opt.step()
            self.model.eval()
            steps += 1
        return steps


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
