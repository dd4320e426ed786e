"""Build the shipped tiny model: tokenizer + Llama-architecture HF model + supervised warm start.

    python exp/make_tiny_model.py --out exp/tiny-model                         # from scratch
    python exp/make_tiny_model.py --from-stage1 <dir> --out exp/tiny-model     # redo stages 1b and 2 only
    python exp/make_tiny_model.py --task arith_tail --from-stage1 exp/tiny-model --out exp/tiny-model-tail \
        --batch-size 16 --capable-steps 400

The last builds the long-tailed workload's warm start (tasks.py `arith_tail`: chains of 2 to 40 operations) from
the demo's model: stages 1b and 2 on chains, with positions up to 1024.

Reproducible (fixed seeds and step counts). Steps:
1. train a byte-level BPE tokenizer with `tokenizers` on the task's text (digits split into single tokens);
2. build a small LlamaConfig model (GQA, 3.1M parameters);
3. stage 1 (500 SFT steps, lr 2e-3 cosine): worked solutions of which half carry a random slip — the model
   learns the format and the arithmetic (68.6% greedy);
4. stage 1b (800 SFT steps, constant lr 1e-3, fresh AdamW, 8 chunks of 100 with seeds 100..107): correct
   solutions only — the model becomes *capable* (85% greedy). RL can only sharpen what is there: without
   this stage RL reached 55-57% in the demo's 5 minutes; with it, 95%;
5. stage 2 (70 SFT steps, lr 1e-3): worked solutions with *systematic* habits at rate 0.6 (a first-step
   subtraction done as an addition; a forgotten carry or borrow) — capable but unsharp: on problems that
   invite a habit the most likely answer is wrong, yet right answers keep a large share (high pass@8);
6. save an HF directory (fp16 safetensors + tokenizer files, 6.2 MB) loadable by AutoModelForCausalLM /
   AutoTokenizer, and record greedy accuracy, pass@8 and sample accuracy in warm_start.json.
`sft()`, `greedy_accuracy()` and `pass_at_k()` are reused by exp/sft_baseline.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks import TASKS, arith_splits, format_prompt, problem_from_row, worked_solution  # noqa: E402

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Digits become single tokens so numbers are spelled digit by digit (arithmetic generalises).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=None, padding_side="left", model_max_length=256
    )


def encode_example(tok, question: str, solution: str) -> tuple[list[int], int]:
    prompt = tok(format_prompt(question))["input_ids"]
    full = prompt + tok(solution)["input_ids"] + [tok.eos_token_id]
    return full, len(prompt)


def sft(
    model,
    tok,
    train_rows: list[dict],
    *,
    steps: int | None = None,
    seconds: float | None = None,
    batch_size: int = 64,
    lr: float = 2e-3,
    mistake_rate: float = 0.6,
    mistakes: str = "systematic",
    seed: int = 0,
    warmup: int = 30,
    log_every: int = 50,
    opt: torch.optim.Optimizer | None = None,
    constant_lr: bool = False,
) -> int:
    """Supervised training on worked solutions (a fresh mistake draw per example per step).
    Stops after `steps` optimizer steps or `seconds` of wall time. Returns the number of steps done.
    Warm-up then cosine decay to 10% of `lr`, or a constant `lr` (the baseline continues at the end LR)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    total = steps or 10**9
    model.train()
    start, step = time.time(), 0
    while step < total and (seconds is None or time.time() - start < seconds):
        batch = [train_rows[rng.randrange(len(train_rows))] for _ in range(batch_size)]
        seqs = [
            encode_example(tok, r["question"], worked_solution(problem_from_row(r), rng, mistake_rate, mistakes))
            for r in batch
        ]
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((batch_size, width), tok.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (s, plen) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, plen : len(s)] = torch.tensor(s[plen:])  # loss on the answer only
        frac = step / max(1, total) if steps else (time.time() - start) / seconds
        scale = (
            1.0
            if constant_lr
            else min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        )
        for g in opt.param_groups:
            g["lr"] = lr * scale
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % log_every == 0:
            print(f"sft step {step} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    return step


@torch.no_grad()
def greedy_accuracy(model, tok, rows: list[dict], batch_size: int = 128, max_new_tokens: int = 40) -> float:
    """Held-out greedy accuracy with HF generate (independent of our generator, on purpose)."""
    from reward_math import score

    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = tok([format_prompt(r["question"]) for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(score(t, r["answer"]) for t, r in zip(texts, chunk))
    return correct / len(rows)


@torch.no_grad()
def pass_at_k(model, tok, rows: list[dict], k: int = 8, max_new_tokens: int = 40, seed: int = 0) -> tuple[float, float]:
    """(pass@k, mean per-sample accuracy) with temperature-1 sampling: how capable the model is
    beyond its greedy answer."""
    from reward_math import score

    torch.manual_seed(seed)
    hits, samples = 0, 0.0
    for i in range(0, len(rows), 32):
        chunk = rows[i : i + 32]
        enc = tok([format_prompt(r["question"]) for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=k,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for j, r in enumerate(chunk):
            right = [score(t, r["answer"]) for t in texts[j * k : (j + 1) * k]]
            hits += max(right)
            samples += sum(right) / k
    return hits / len(rows), samples / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="exp/tiny-model")
    ap.add_argument("--task", default="arith", choices=TASKS, help="arith (the demo) | arith_tail (long chains)")
    ap.add_argument("--basic-steps", type=int, default=500, help="stage 1: arithmetic with random slips")
    ap.add_argument("--capable-steps", type=int, default=800, help="stage 1b: correct solutions only")
    ap.add_argument("--habit-steps", type=int, default=70, help="stage 2: systematic slips (capable, unsharp)")
    ap.add_argument("--mistake-rate", type=float, default=0.6, help="stage 2 slip probability")
    ap.add_argument("--from-stage1", default="", help="an HF dir saved after stage 1: skip stage 1")
    ap.add_argument("--batch-size", type=int, default=64, help="sequences per SFT step (arith_tail: 16)")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train_rows, test_rows = arith_splits(num_train=20000, num_test=1000, seed=args.seed, task=args.task)
    # positions: the demo's prompt + response fit in 256 tokens; a 40-operation chain needs ~730
    positions, new_tokens = (256, 40) if args.task == "arith" else (1024, 512)
    t0 = time.time()
    if args.from_stage1:
        tok = AutoTokenizer.from_pretrained(args.from_stage1)
        model = AutoModelForCausalLM.from_pretrained(args.from_stage1, dtype=torch.float32)
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, positions)  # RoPE: no table
        tok.model_max_length = max(tok.model_max_length, positions)
    else:
        rng = random.Random(args.seed)
        corpus = [
            format_prompt(r["question"]) + worked_solution(problem_from_row(r), rng, 0.5, "random") for r in train_rows
        ]
        tok = train_tokenizer(corpus, args.vocab_size)
        tok.model_max_length = positions
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 8 // 3 // 8 * 8,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=positions,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        model = LlamaForCausalLM(config)
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(tok)}")
        # Stage 1: learn the format and the arithmetic (random slips keep it from being too sure).
        sft(
            model,
            tok,
            train_rows,
            steps=args.basic_steps,
            mistake_rate=0.5,
            mistakes="random",
            seed=args.seed,
            batch_size=args.batch_size,
        )
        model.to(torch.float16).to(torch.float32)  # what a saved stage-1 checkpoint would hold
    stage1_seconds = time.time() - t0
    # Stage 1b: correct solutions only, so the arithmetic itself is reliable (capable).
    t1 = time.time()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    for chunk in range(args.capable_steps // 100):
        sft(
            model,
            tok,
            train_rows,
            steps=100,
            lr=1e-3,
            mistake_rate=0.0,
            mistakes="random",
            seed=100 + chunk,
            opt=opt,
            constant_lr=True,
            batch_size=args.batch_size,
        )
    model.to(torch.float16).to(torch.float32)
    stage1b_seconds = time.time() - t1
    # Stage 2: systematic habits — subtraction done as addition, forgotten carries — at rate 0.6:
    # for those problems the most likely answer is wrong, while right answers keep a large share.
    t1 = time.time()
    sft(
        model,
        tok,
        train_rows,
        steps=args.habit_steps,
        lr=1e-3,
        warmup=10,
        mistake_rate=args.mistake_rate,
        mistakes="systematic",
        seed=args.seed + 1,
        batch_size=args.batch_size,
    )
    stage2_seconds = time.time() - t1

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)  # fp16 on disk keeps it < 10 MB
    tok.save_pretrained(out)
    # Measure what users get: the saved checkpoint, loaded the standard way, in fp32.
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    p8, mean_sample = pass_at_k(loaded, tok, test_rows[:200], max_new_tokens=new_tokens)
    info = {
        "params": sum(p.numel() for p in loaded.parameters()),
        "seed": args.seed,
        "stage1": {
            "steps": args.basic_steps,
            "mistakes": "random",
            "mistake_rate": 0.5,
            "seconds": round(stage1_seconds, 1),
            "skipped_with": args.from_stage1 or None,
        },
        "stage1b": {
            "steps": args.capable_steps // 100 * 100,
            "mistakes": "none",
            "lr": 1e-3,
            "seconds": round(stage1b_seconds, 1),
        },
        "stage2": {"steps": args.habit_steps, "mistakes": "systematic", "seconds": round(stage2_seconds, 1)},
        "mistakes": "systematic",
        "mistake_rate": args.mistake_rate,
        "task": args.task,
        "greedy_acc_test500": greedy_accuracy(loaded, tok, test_rows[:500], max_new_tokens=new_tokens),
        "pass_at_8_test200": p8,
        "sample_acc_test200": mean_sample,
    }
    (out / "warm_start.json").write_text(json.dumps(info, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(json.dumps(info), f"size {size:.1f} MB", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
