"""Evaluate a checkpoint: pass@1, avg@k and pass@k on a dataset split, with our generator.

    python exp/eval.py --model exp/tiny-model --task arith --k 8 --n 200
    python exp/eval.py --model runs/<run>/checkpoints/step_40 --task gsm8k --split test --k 4 --out eval.json

Greedy pass@1 plus k samples at --temperature per problem (unbiased pass@k, avg@k), written to JSON
(and to W&B when --wandb is offline|online).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config import load_config  # noqa: E402
from generator import Generator, SamplingParams  # noqa: E402
from reward_math import avg_at_k, pass_at_k, score  # noqa: E402
from tasks import load_task  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="exp/tiny-model")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--split", default="test", choices=["train", "test"])
    ap.add_argument("--n", type=int, default=500, help="problems to evaluate")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--wandb", default="disabled", choices=["disabled", "offline", "online"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    cfg = load_config([f"data.task={args.task}", f"data.num_test={args.n}"])
    train, test = load_task(cfg.data, tok)
    rows = (test if args.split == "test" else train)[: args.n]
    prompts = [tok(r["prompt"])["input_ids"] for r in rows]
    gen = Generator(model, max_batch_size=args.batch, max_seq_len=max(map(len, prompts)) + args.max_new_tokens + 1)
    stop = [tok.eos_token_id]

    def correct(outs, chunk):
        return [score(tok.decode(o.token_ids, skip_special_tokens=True), r["answer"]) > 0 for o, r in zip(outs, chunk)]

    greedy, per_problem = [], []
    for i in tqdm(range(0, len(rows), args.batch), desc="eval", unit="batch"):
        chunk, ps = rows[i : i + args.batch], prompts[i : i + args.batch]
        greedy += correct(
            gen.generate(ps, SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=stop)),
            chunk,
        )
        params = [
            SamplingParams(
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=stop,
                seed=args.seed * 1_000_003 + (i + j) * args.k + s,
            )
            for j in range(len(chunk))
            for s in range(args.k)
        ]
        outs = gen.generate([p for p in ps for _ in range(args.k)], params)
        hits = correct(outs, [r for r in chunk for _ in range(args.k)])
        per_problem += [hits[j * args.k : (j + 1) * args.k] for j in range(len(chunk))]
    result = {
        "model": args.model,
        "task": args.task,
        "split": args.split,
        "n": len(rows),
        "k": args.k,
        "temperature": args.temperature,
        "pass@1_greedy": sum(greedy) / len(rows),
        f"avg@{args.k}": sum(avg_at_k([float(h) for h in hs], args.k) for hs in per_problem) / len(rows),
        f"pass@{args.k}": sum(pass_at_k(args.k, sum(hs), args.k) for hs in per_problem) / len(rows),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.wandb != "disabled":
        import wandb

        run = wandb.init(project="hexrl-eval", mode=args.wandb, config=vars(args))
        run.log(result)
        run.finish()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
