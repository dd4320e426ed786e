"""Our generator (generator.Generator) against HF transformers on a real checkpoint, fp32 on CPU.

    python exp/check_real_model.py --model runs/<run>/smollm2-135m-hf            # 4 GSM8K test prompts, 64 tokens

The prompts are GSM8K test questions through the tokenizer's chat template (tasks.chat_prompt, what the rollout
ranks send), and one short question whose answer ends on the EOS token early (--eos-prompt). Checks, each a failure (exit 1) when it does not hold:
- greedy: our token ids equal HF `generate(do_sample=False)` run one prompt at a time (no padding), EOS included;
- log-probs: ours equal the log-softmax of HF's full forward over prompt + generated tokens within --atol, for the
  greedy run (log_softmax(logits)) and for seeded sampled runs (log_softmax(logits / T), before top-k/top-p: the
  log-prob convention of docs/generator.md) at T = 1 (the RL setting) and at T = 0.7 with top-p 0.9 and top-k 50;
- seeds: a sampled request run alone gives the same tokens as in the batch (counter-based draws).
HF runs on its own copy of the model as loaded: our Generator re-lays the weights it fuses. Speed: greedy tokens/s
of ours (all prompts in one continuously batched call) vs HF `generate` on the same prompts left-padded in one
batch, best of --repeats, engines interleaved, --threads threads each. The last line is one JSON record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generator import Generator, SamplingParams  # noqa: E402
from tasks import chat_prompt, load_math_dataset  # noqa: E402


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def hf_forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0):
    """Per-token log-probs of `tokens` from one full forward over prompt + tokens; also the top-2 gap per position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    logp = torch.log_softmax(rows / temperature, dim=-1)
    top2 = rows.topk(2, dim=-1).values
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int, pad: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    return out[0, len(prompt) :].tolist()


def hf_batched_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: int, pad: int) -> list[list[int]]:
    """One left-padded batch (what an HF-generate rollout does); each row cut after its EOS."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory (exp/export_gguf_model.py)")
    ap.add_argument("--prompts", type=int, default=4, help="GSM8K test questions")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--atol", type=float, default=1e-4, help="max |our log-prob - HF forward log-prob|")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--eos-prompt",
        default="What is 2 + 3? Reply with the number only.",
        help="one more prompt, whose greedy answer ends on EOS (<|im_end|>) early: the stop path against HF ('' = none)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    rows = load_math_dataset("gsm8k", "test").to_list()[: args.prompts]
    prompts = [tok(chat_prompt(tok, r["question"]))["input_ids"] for r in rows]
    if args.eos_prompt:
        prompts.append(tok(chat_prompt(tok, args.eos_prompt, instruction=""))["input_ids"])
    ref_model, our_model = load(args.model), load(args.model)
    cfg = our_model.config
    print(
        f"model {args.model}: {cfg.model_type}, {sum(p.numel() for p in our_model.parameters()) / 1e6:.1f}M params, "
        f"{cfg.num_hidden_layers} layers, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, vocab "
        f"{cfg.vocab_size}, tied {cfg.tie_word_embeddings}, rope {getattr(cfg, 'rope_parameters', None)}; eos "
        f"{tok.eos_token!r}={eos}; prompt tokens {[len(p) for p in prompts]}; {args.threads} thread(s)",
        flush=True,
    )
    max_seq_len = max(map(len, prompts)) + args.max_new_tokens + 1
    gen = Generator(our_model, max_batch_size=len(prompts), max_seq_len=max_seq_len)
    failures: list[str] = []
    record: dict = {
        "prompts": len(prompts),
        "gsm8k_prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "atol": args.atol,
    }

    # -- greedy: tokens = HF generate, log-probs = HF forward
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, stop_token_ids=[eos])
    outs = gen.generate(prompts, greedy)
    worst, min_gap, stopped = 0.0, float("inf"), 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(ref_model, prompt, args.max_new_tokens, eos, pad)
        ref_lp, gaps = hf_forward_logprobs(ref_model, prompt, out.token_ids)
        diff = max(abs(a - b) for a, b in zip(ref_lp, out.logprobs))
        worst, min_gap = max(worst, diff), min(min_gap, min(gaps))
        stopped += out.finish_reason == "stop"
        if out.token_ids != ref:
            j = next(
                (k for k, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), min(len(ref), len(out.token_ids))
            )
            gap = gaps[j] if j < len(gaps) else float("nan")
            failures.append(
                f"greedy prompt {i}: tokens differ from HF generate at position {j} (ours {out.token_ids[j : j + 3]}, "
                f"HF {ref[j : j + 3]}; HF's top-2 logit gap there {gap:.2e})"
            )
        if out.finish_reason == "stop" and out.token_ids[-1] != eos:
            failures.append(f"greedy prompt {i}: finished 'stop' without its EOS")
        if diff > args.atol:
            failures.append(f"greedy prompt {i}: log-probs differ from HF's forward by {diff:.2e} > {args.atol}")
    print(
        f"greedy: {len(prompts)} prompts x <= {args.max_new_tokens} tokens, tokens {'=' if not failures else '!='} "
        f"HF generate; {stopped} ended on EOS; max |log-prob - HF forward| {worst:.2e}; smallest top-2 logit gap "
        f"{min_gap:.2e}",
        flush=True,
    )
    print("  sample (prompt 0, greedy): " + json.dumps(tok.decode(outs[0].token_ids))[:300], flush=True)
    record.update(greedy_max_abs_logprob_diff=worst, greedy_min_top2_gap=min_gap, greedy_eos_stops=stopped)

    # -- sampled, seeded: log-probs = HF forward at the temperature; a request alone = the same request in the batch
    for name, temperature, top_p, top_k in (("T=1", 1.0, 1.0, -1), ("T=0.7,top_p=0.9,top_k=50", 0.7, 0.9, 50)):
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=args.max_new_tokens,
            stop_token_ids=[eos],
            seed=args.seed,
        )
        outs = gen.generate(prompts, params)
        worst = 0.0
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            ref_lp, _ = hf_forward_logprobs(ref_model, prompt, out.token_ids, temperature)
            diff = max(abs(a - b) for a, b in zip(ref_lp, out.logprobs))
            worst = max(worst, diff)
            if diff > args.atol:
                failures.append(f"sampled {name} prompt {i}: log-probs differ from HF's forward by {diff:.2e}")
        last = len(prompts) - 1
        alone = gen.generate([prompts[last]], [SamplingParams(**{**params.__dict__, "seed": args.seed + last})])[0]
        if alone.token_ids != outs[last].token_ids:
            failures.append(f"sampled {name}: request {last} alone gave other tokens than in the batch")
        lengths = [len(o.token_ids) for o in outs]
        stops = sum(o.finish_reason == "stop" and o.token_ids[-1] == eos for o in outs)
        print(
            f"sampled {name} (seed {args.seed}+i): lengths {lengths} ({stops} ended on EOS), max |log-prob - HF "
            f"forward at T| {worst:.2e}; "
            f"alone = in batch: {alone.token_ids == outs[last].token_ids}",
            flush=True,
        )
        record[f"sampled_{name}_max_abs_logprob_diff"] = worst

    # -- speed: greedy, ours (one continuously batched call) vs HF generate (one left-padded batch)
    best = {"ours": float("inf"), "hf": float("inf")}
    useful = {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        outs = gen.generate(prompts, greedy)
        best["ours"] = min(best["ours"], time.perf_counter() - t0)
        useful["ours"] = sum(len(o.token_ids) for o in outs)
        t0 = time.perf_counter()
        hf_rows = hf_batched_greedy(ref_model, prompts, args.max_new_tokens, eos, pad)
        best["hf"] = min(best["hf"], time.perf_counter() - t0)
        useful["hf"] = sum(map(len, hf_rows))
    same_batched = [o.token_ids for o in outs] == hf_rows
    ours_tps, hf_tps = useful["ours"] / best["ours"], useful["hf"] / best["hf"]
    print(
        f"speed (greedy, batch {len(prompts)}, {args.threads} thread(s), best of {args.repeats}): ours "
        f"{useful['ours']} tokens in {best['ours']:.2f} s = {ours_tps:.1f} tokens/s; HF generate (left-padded batch) "
        f"{useful['hf']} tokens in {best['hf']:.2f} s = {hf_tps:.1f} tokens/s; ratio {ours_tps / hf_tps:.2f}x; "
        f"HF's padded batch gave the same tokens: {same_batched}",
        flush=True,
    )
    record.update(
        ours_tokens_per_s=ours_tps,
        hf_tokens_per_s=hf_tps,
        speed_ratio=ours_tps / hf_tps,
        hf_padded_batch_same_tokens=same_batched,
        failures=failures,
    )
    for f in failures:
        print(f"FAIL {f}", flush=True)
    print("check_real_model: " + json.dumps(record), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
