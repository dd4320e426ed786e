"""Rollout throughput: our Generator vs HF `generate`, on the same model and the same requests.

    HF_HUB_OFFLINE=1 .venv/bin/python exp/bench_rollout.py                       # all models, both workloads
    HF_HUB_OFFLINE=1 .venv/bin/python exp/bench_rollout.py --models rand-256x4 --requests 64   # quick
    HF_HUB_OFFLINE=1 .venv/bin/python exp/bench_rollout.py --kv-memory --models tiny            # KV memory, ours only
    python3 exp/bench_rollout.py --models r1-1.5b,r1-7b --workloads rl-tail --batch 256         # GPU: RL tail at 256
    HF_HUB_OFFLINE=1 .venv/bin/python exp/bench_rollout.py --models r1-1.5b --workloads rl-tail --batch 16 --layers 2
                                                                          # CPU dry run of the same, 2 layers

Workloads
  rl     RL-shaped: P prompts x 4 samples (256 requests by default), temperature 1.0, up to 256 new tokens,
         32 slots. HF is called the way a user calls it: batches of 32, left padding, do_sample=True.
  rl-tail the same requests with the long-tailed lengths below instead of the model's own EOS (the shipped tiny
         model's answers are all ~25 tokens, no tail); for a random model (no EOS) the same as rl.
  --batch N  the RL tail at RL batch sizes: N slots and 2N requests (N x 2 / 4 prompts x 4 samples), so the
         batch runs full, then drains. r1-1.5b / r1-7b are DeepSeek-R1-Distill-Qwen-1.5B / -7B shaped
         (exp/models/*.json) with random weights; --layers L keeps only L layers (CPU only: a dry run).
  greedy fixed-length greedy: every request generates exactly --greedy-tokens tokens (no stop).

Long tails. A trained model (exp/tiny-model) ends on its own EOS, and both generators stop on it.
Random-init models almost never emit EOS, so each request gets its own length limit drawn from a
long-tailed law (lognormal, median 40, clipped to [4, 256]); we pass it as the request's
max_new_tokens, and HF gets the same per-row limits through a StoppingCriteria that marks a row done
at its limit (HF then pads that row until the whole batch is done -- exactly what it does after EOS).

--kv-memory: no HF, no timing. Runs the workloads through our generator step by step and prints, every
--kv-every steps, the live K/V rows (tokens whose K/V the running sequences hold), the KV-pool bytes held by
them (whole blocks; a GRPO group's prompt blocks are held once), and the static cache this generator replaced
(slots x max_seq_len tokens, all allocated up front). With --kv-cache-tokens the pool is that small (and
--kv-seq-tokens sets the slots it serves): admission waits and the youngest requests are preempted; the
tokens stay those of an unconstrained run (checked).

Figures: useful tokens/s = generated tokens (EOS included, padding excluded) / wall seconds.
Achieved GB/s = bytes a decode step must read / seconds: the weights once per forward plus the K/V it attends
over (ours: the live K/V tokens of the running sequences, counted step by step; HF: every row of its padded
batch up to the batch's current length, which its cache holds and its attention reads). "% HBM" is that over
--hbm-peak-gbps (default: 4800, an H200's HBM3e, on CUDA; on CPU the copy bandwidth measured here).
Achieved FLOP/s = 2 x parameters x useful tokens / seconds. Peaks are measured here: a square matmul and a
large tensor copy (read + write bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from generator import PACKED_RIDE_TOKENS, Generator, SamplingParams, gpu_options  # noqa: E402
from kv_cache import KVPool  # noqa: E402

TINY_DIR = ROOT / "exp" / "tiny-model"
RANDOM_CONFIGS = {  # random-init stand-ins when (or besides) the shipped tiny model
    "rand-256x4": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "rand-30m": dict(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=16384,
    ),
    # the shape of Qwen2.5-1.5B / DeepSeek-R1-Distill-Qwen-1.5B (GPU: the paper's smallest model, bandwidth-bound)
    "rand-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}


# real models' shapes with random weights (exp/models/*.json): the RL-tail rows at RL batch sizes
SHAPE_FILES = {
    "r1-1.5b": ROOT / "exp" / "models" / "deepseek-r1-distill-qwen-1.5b.json",
    "r1-7b": ROOT / "exp" / "models" / "deepseek-r1-distill-qwen-7b.json",
}
H200_HBM_GBPS = 4800.0  # HBM3e peak of an H200 (the copy peak measured there was ~3600)


# ----------------------------------------------------------------------------- machine peaks


def measure_peaks(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, copy GB/s) measured in about a second."""
    n = 2048 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    src = torch.empty(64 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)

    def timed(fn, reps):
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / reps

    flops = 2 * n**3 / timed(lambda: a @ b, 20)
    gbs = 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 10) / 1e9
    return flops, gbs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- workloads


class RowLimits(StoppingCriteria):
    """Marks row i done once it has generated limits[i] tokens (HF stops when all rows are done)."""

    def __init__(self, prompt_width: int, limits: list[int]):
        self.prompt_width, self.limits = prompt_width, torch.tensor(limits)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_width) >= self.limits.to(input_ids.device)


def make_prompts(model_name: str, n_prompts: int, rng: random.Random, vocab: int) -> list[list[int]]:
    if model_name == "tiny":  # the task's real prompts, so the model's own EOS ends them
        from transformers import AutoTokenizer

        from tasks import arith_splits, format_prompt

        tok = AutoTokenizer.from_pretrained(TINY_DIR)
        rows = arith_splits(0, n_prompts, seed=123)[1]
        return [tok(format_prompt(r["question"]))["input_ids"] for r in rows]
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 64))] for _ in range(n_prompts)]


def long_tailed_limits(n: int, rng: random.Random, cap: int) -> list[int]:
    return [max(4, min(cap, round(math.exp(rng.gauss(math.log(40), 1.0))))) for _ in range(n)]


def kv_tokens_read(prompt_len: int, new_tokens: int) -> int:
    """K/V tokens a sequence's decode rows attend over: its j-th row reads prompt_len + j positions."""
    return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2


def run_ours(gen: Generator, prompts, limits, temperature, stop, seed=0):
    """(useful tokens, seconds, decode steps, K/V tokens read by decode attention, the generator's stats of this run)."""
    params = [
        SamplingParams(
            temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=lim, stop_token_ids=stop, seed=seed + i
        )
        for i, lim in enumerate(limits)
    ]
    before = dataclasses.replace(gen.stats)
    sync(gen.device)
    t0 = time.perf_counter()
    outs = gen.generate(prompts, params)
    sync(gen.device)
    seconds = time.perf_counter() - t0
    kv = sum(kv_tokens_read(len(o.prompt_ids), len(o.token_ids)) for o in outs)
    run = {k: v - getattr(before, k) for k, v in vars(gen.stats).items()}
    return sum(len(o.token_ids) for o in outs), seconds, run["decode_steps"], kv, run


def breakdown(run: dict, seconds: float) -> str:
    """Where the last run's wall time went, as the host saw it: the prefill phase (planning, K/V copies and the
    prefill-only forwards: under a compiled decode step, eager, those the step's packed rows could not carry) and
    the decode phase (launching the step, which on a GPU returns at once, and waiting for the step before it); the
    rest is the caller's. And dynamo's graph count: one that grew during a timed run is a recompile inside it."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return (
        f"{run['decode_steps']} steps ({run['prefill_rides']} carrying prefill rows), {run['prefill_forwards']} "
        f"prefill-only forwards; host: prefill phase "
        f"{run['prefill_seconds']:.2f} s, decode phase {run['decode_seconds']:.2f} s, other "
        f"{seconds - run['prefill_seconds'] - run['decode_seconds']:.2f} s; dynamo graphs so far {graphs}"
    )


def kernel_profile(gen: Generator, prompts, limits, temperature, stop, rows: int) -> None:
    """One more run of ours under torch.profiler: the ops that took the most device time (CPU: host time), so that a
    benchmark row far off the HBM roofline says what bounds it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = gen.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_ours(gen, prompts, limits, temperature, stop)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60))


def run_hf(model, prompts, limits, temperature, stop, batch, pad_id):
    """As run_ours; HF's K/V read is every row of its padded batch up to the batch's current length."""
    device = next(model.parameters()).device
    useful, steps, seconds, kv = 0, 0, 0.0, 0
    for start in range(0, len(prompts), batch):
        chunk, lims = prompts[start : start + batch], limits[start : start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        kwargs = (
            dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            if temperature > 0
            else dict(do_sample=False)
        )
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lims),
                pad_token_id=pad_id,
                eos_token_id=stop or None,
                stopping_criteria=StoppingCriteriaList([RowLimits(width, lims)]),
                **kwargs,
            )
        sync(device)
        seconds += time.perf_counter() - t0
        gen = out[:, width:].tolist()
        steps += len(gen[0])
        kv += len(chunk) * kv_tokens_read(width, len(gen[0]))
        for row, lim in zip(gen, lims):  # useful = up to the row's limit or its first stop token
            row = row[:lim]
            ends = [i for i, t in enumerate(row) if t in stop]
            useful += ends[0] + 1 if ends else len(row)
    return useful, seconds, steps, kv


# ----------------------------------------------------------------------------- KV memory


def kv_memory_run(model, name, workload, prompts, limits, temperature, stop, args) -> None:
    """One workload through a paged generator, step by step: live K/V rows and pool bytes vs a static cache."""
    max_seq_len = max(len(p) for p in prompts) + max(limits)
    params = [
        SamplingParams(temperature=temperature, max_new_tokens=n, stop_token_ids=stop, seed=i)
        for i, n in enumerate(limits)
    ]
    ref = None
    if args.kv_cache_tokens:  # the tokens an unconstrained pool gives, to check the small pool's against
        ref = Generator(model, max_batch_size=args.slots, max_seq_len=max_seq_len).generate(prompts, params)
    gen = Generator(
        model,
        max_batch_size=args.slots,
        max_seq_len=max_seq_len,
        kv_block_size=args.kv_block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_seq_tokens=args.kv_seq_tokens,
    )
    pool = gen.kv_pool
    token_bytes = KVPool.token_bytes(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
    static = gen.max_batch_size * max_seq_len * token_bytes
    print(
        f"\n{name} {workload}: {len(prompts)} requests, {gen.max_batch_size} slots, max_seq_len {max_seq_len}, "
        f"blocks of {pool.block_size} tokens ({pool.block_bytes / 2**10:.0f} KiB), pool {pool.num_blocks} blocks = "
        f"{pool.num_blocks * pool.block_bytes / 2**20:.1f} MiB reserved; static cache {gen.max_batch_size} x "
        f"{max_seq_len} tokens = {static / 2**20:.1f} MiB"
    )
    print("| step | running | waiting | live K/V tokens | live MiB | pool blocks held | pool MiB held | static MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (p, sp) in enumerate(zip(prompts, params)):
        gen.add_request(i, p, sp)
    outs, step, live_sum, held_sum, peak = {}, 0, 0, 0, (0, 0)
    while gen.num_unfinished():
        outs.update((o.request_id, o) for o in gen.step())
        step += 1
        live, held = gen.kv_live_tokens(), pool.num_used
        live_sum, held_sum, peak = live_sum + live, held_sum + held, max(peak, (held, live))
        if step % args.kv_every == 0 or not gen.num_unfinished():
            running = sum(r is not None for r in gen.slots)
            print(
                f"| {step} | {running} | {len(gen.waiting)} | {live} | {live * token_bytes / 2**20:.2f} | {held} | "
                f"{held * pool.block_bytes / 2**20:.2f} | {static / 2**20:.1f} |"
            )
    mean_held = held_sum / step * pool.block_bytes
    print(
        f"{name} {workload}: {step} steps; pool held at peak {peak[0] * pool.block_bytes / 2**20:.2f} MiB "
        f"({100 * peak[0] * pool.block_bytes / static:.0f}% of the static cache), mean {mean_held / 2**20:.2f} MiB "
        f"({100 * mean_held / static:.0f}%); mean live K/V {live_sum / step * token_bytes / 2**20:.2f} MiB; "
        f"preemptions {gen.stats.preemptions}; prompt rows shared {gen.stats.prefill_tokens_shared}"
    )
    if ref is not None:
        same = all(outs[i].token_ids == r.token_ids for i, r in enumerate(ref))
        print(f"{name} {workload}: tokens equal to an unconstrained pool's: {same}")
        if not same:
            raise SystemExit("--kv-memory: the small pool changed the tokens")


# ----------------------------------------------------------------------------- main


def load_bench_model(name: str, device: torch.device, dtype: torch.dtype, layers: int = 0):
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32)
        stop = [model.config.eos_token_id]
    elif name in SHAPE_FILES:
        shape = json.loads(SHAPE_FILES[name].read_text())
        shape = {k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype", "model_type")}
        shape.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
        if layers:
            shape["num_hidden_layers"] = layers
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # initialised in its dtype, where it runs: a 7B fp32 copy would be 30 GB
        try:
            with device:
                model = Qwen2ForCausalLM(Qwen2Config(**shape))
        finally:
            torch.set_default_dtype(default)
        stop = []
    else:
        torch.manual_seed(0)
        with device:  # initialised where it runs (a 1.5B model's random init takes minutes on CPU)
            model = LlamaForCausalLM(
                LlamaConfig(
                    **RANDOM_CONFIGS[name],
                    max_position_embeddings=512,
                    eos_token_id=None,
                    bos_token_id=None,
                    pad_token_id=0,
                )
            )
        stop = []
    model.generation_config.eos_token_id = None  # only the stop ids we pass count, for both sides
    return model.to(device=device, dtype=dtype).eval(), stop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--models",
        default="tiny,rand-256x4,rand-30m",
        help="comma list of: tiny (exp/tiny-model, skipped if absent), " + ", ".join([*RANDOM_CONFIGS, *SHAPE_FILES]),
    )
    ap.add_argument("--batch", type=int, default=0, help="RL batch size: N slots, 2N requests (0: --slots, --requests)")
    ap.add_argument("--layers", type=int, default=0, help="r1-* models: keep only this many layers (CPU dry runs)")
    ap.add_argument(
        "--hbm-peak-gbps", type=float, default=0.0, help="memory peak for %% HBM (0: 4800 on CUDA, measured on CPU)"
    )
    ap.add_argument("--async-decode", default="auto", choices=["auto", "always", "never"], help="auto: on a GPU")
    ap.add_argument("--buckets", default="auto", choices=["auto", "always", "never"], help="auto: on a GPU")
    ap.add_argument(
        "--ride-tokens",
        type=int,
        default=PACKED_RIDE_TOKENS,
        help="prefill rows a compiled decode step carries, packed (0: prefill-only forwards, eager)",
    )
    ap.add_argument(
        "--bucket-widths",
        default="",
        help="decode batch widths to pad to, e.g. 1,16,64,256 (default: powers of two); each is one compile on a GPU",
    )
    ap.add_argument("--decode-attention", default="auto", choices=["auto", "gather", "flex"], help="auto: flex on GPU")
    ap.add_argument("--requests", type=int, default=256, help="RL workload size (prompts x 4 samples)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--greedy-requests", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=128)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="rl,rl-tail,greedy")
    ap.add_argument("--repeats", type=int, default=1, help="runs per engine (alternating); the fastest counts")
    ap.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "always", "never"],
        help="our decode step under torch.compile (CUDA graphs on GPU); auto: on a GPU",
    )
    ap.add_argument(
        "--flash-attn",
        default="never",
        choices=["auto", "always", "never"],
        help="flash-attn's KV-cache decode kernel (untested); auto: on a GPU when installed",
    )
    ap.add_argument(
        "--kernel-profile",
        type=int,
        default=0,
        metavar="N",
        help="after each workload: its N costliest ops (torch.profiler)",
    )
    ap.add_argument("--kv-memory", action="store_true", help="KV-pool bytes vs live tokens per step (ours only)")
    ap.add_argument("--kv-every", type=int, default=20, help="--kv-memory: print every this many steps")
    ap.add_argument("--kv-block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=0,
        help="our KV pool's size (0: a static cache's); --kv-memory: see above",
    )
    ap.add_argument("--kv-seq-tokens", type=int, default=0, help="expected K/V tokens per sequence, for the slots")
    args = ap.parse_args()
    unknown = set(args.workloads.split(",")) - {"rl", "rl-tail", "greedy"}
    if unknown:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose from rl, rl-tail, greedy")
    if args.batch:
        args.slots, args.requests = args.batch, -(-2 * args.batch // 4) * 4
    if args.requests % 4:
        raise SystemExit(f"--requests must be a multiple of 4 (prompts x 4 samples), got {args.requests}")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.layers and device.type == "cuda":
        raise SystemExit("--layers is for CPU dry runs; on a GPU the r1-* models run at their real depth")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":  # a skipped CUDA graph or a recompile in a timed run is logged, with its reason
        torch._logging.set_logs(perf_hints=True, recompiles=True)
    peak_flops, peak_gbs = measure_peaks(device, dtype)
    hbm_peak = args.hbm_peak_gbps or (H200_HBM_GBPS if device.type == "cuda" else peak_gbs)
    auto = {"auto": None, "always": True, "never": False}
    ours_options = dict(
        **gpu_options(device, args.compile, args.flash_attn, ride_tokens=args.ride_tokens),
        async_decode=auto[args.async_decode],
        decode_buckets=[int(w) for w in args.bucket_widths.split(",")] if args.bucket_widths else auto[args.buckets],
        decode_attention=args.decode_attention,
    )
    print(
        f"device {device} {dtype}, threads {args.threads}: peak matmul {peak_flops / 1e9:.1f} GFLOP/s, "
        f"copy {peak_gbs:.1f} GB/s, HBM peak taken as {hbm_peak:.0f} GB/s; ours: {ours_options}"
    )

    rows = []
    for name in args.models.split(","):
        if name == "tiny" and not (TINY_DIR / "config.json").exists():
            print(f"skip tiny: {TINY_DIR} not built")
            continue
        model, stop = load_bench_model(name, device, dtype, args.layers)
        # HF runs on its own copy, as loaded: our Generator re-lays the projection weights it fuses (on CPU
        # input-major where MKL is faster), which would change HF's GEMMs too if it ran on the same modules.
        hf_model, _ = load_bench_model(name, device, dtype, args.layers)
        n_params = sum(p.numel() for p in model.parameters())
        # a decode step reads every weight once, but of an untied embedding only the rows it looks up
        embed = model.model.embed_tokens.weight
        untied = embed is not model.lm_head.weight
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - untied * embed.numel() * (
            embed.element_size()
        )
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_token_bytes = KVPool.token_bytes(c.num_hidden_layers, c.num_key_value_heads, head_dim, dtype)
        rng = random.Random(0)
        vocab = model.config.vocab_size
        workloads = []  # (name, prompts, limits, temperature, stop ids)
        for workload in args.workloads.split(","):
            if workload == "rl-tail" and not stop and "rl" in args.workloads.split(","):
                continue  # a model without EOS runs the long-tailed lengths under "rl" already
            if workload in ("rl", "rl-tail"):
                base = make_prompts(name, args.requests // 4, rng, vocab)
                prompts = [p for p in base for _ in range(4)]
                tail = workload == "rl-tail" or not stop
                # within the model's positions (the tiny model has 256; its own answers never get near them)
                cap = min(args.max_new_tokens, model.config.max_position_embeddings - max(len(p) for p in prompts))
                limits = long_tailed_limits(len(prompts), rng, cap) if tail else [args.max_new_tokens] * len(prompts)
                workloads.append((workload, prompts, limits, 1.0, [] if tail else stop))
            else:
                prompts = make_prompts(name, args.greedy_requests, rng, vocab)
                workloads.append((workload, prompts, [args.greedy_tokens] * len(prompts), 0.0, []))
        if args.kv_memory:
            for workload, prompts, limits, temperature, wl_stop in workloads:
                kv_memory_run(model, name, workload, prompts, limits, temperature, wl_stop, args)
            continue
        # one generator for all workloads, as a rollout rank keeps one; its first call compiles the decode step (GPU)
        gen = Generator(
            model,
            max_batch_size=args.slots,
            max_seq_len=max(max(len(p) for p in w[1]) + max(w[2]) for w in workloads),
            kv_cache_tokens=args.kv_cache_tokens,
            **ours_options,
        )
        for workload, prompts, limits, temperature, wl_stop in workloads:
            # warm-up: one short batch per decode width, so every bucket's graph is compiled before the timed runs
            t0 = time.perf_counter()
            widths = gen.buckets if gen.decode_buckets else [min(4, args.slots)]
            took = []
            for width in widths:
                t1 = time.perf_counter()
                run_ours(gen, (prompts * width)[:width], [3] * width, temperature, wl_stop)
                took.append(f"{width}: {time.perf_counter() - t1:.1f} s")
            print(
                f"  {name:10s} {workload:6s} ours warm-up {time.perf_counter() - t0:.1f} s (width: s) {', '.join(took)}"
            )
            run_hf(hf_model, prompts[:4], [8] * 4, temperature, wl_stop, args.slots, 0)
            best: dict[str, tuple[int, float, int, int]] = {}
            for _ in range(args.repeats):  # alternate engines; keep each one's fastest run (shared CPUs are noisy)
                for engine in ("ours", "hf"):
                    if engine == "ours":
                        result = run_ours(gen, prompts, limits, temperature, wl_stop)
                    else:
                        result = run_hf(hf_model, prompts, limits, temperature, wl_stop, args.slots, 0)
                    if engine not in best or result[1] < best[engine][1]:
                        best[engine] = result
                        if engine == "ours":
                            ours_breakdown = breakdown(result[4], result[1])
            print(f"  {name:10s} {workload:6s} ours: {ours_breakdown}")
            if args.kernel_profile:
                kernel_profile(gen, prompts, limits, temperature, wl_stop, args.kernel_profile)
            for engine, (useful, seconds, steps, kv, *_) in best.items():
                rows.append(
                    dict(
                        model=f"{name} ({n_params / 1e6:.1f}M)",
                        workload=workload,
                        engine=engine,
                        tokens=useful,
                        steps=steps,
                        seconds=seconds,
                        tps=useful / seconds,
                        gbs=(steps * weight_bytes + kv * kv_token_bytes) / seconds / 1e9,
                        step_ms=1e3 * seconds / steps,
                        flops=2 * n_params * useful / seconds,
                    )
                )
                print(
                    f"  {name:10s} {workload:6s} {engine:4s} {useful:7d} tok {steps:5d} steps "
                    f"{seconds:7.2f} s {useful / seconds:9.1f} tok/s {rows[-1]['gbs']:8.1f} GB/s",
                    flush=True,
                )

    if args.kv_memory:
        return
    print(
        f"\n{args.slots} slots, {args.requests} requests; GB/s = (weights + K/V read) / s, % of {hbm_peak:.0f} GB/s\n"
        "| model | workload | engine | useful tokens | decode steps | ms/step | s | tok/s | ratio | GB/s (% HBM) "
        "| GFLOP/s (% peak) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        hf = next(
            r for r in rows if r["model"] == row["model"] and r["workload"] == row["workload"] and r["engine"] == "hf"
        )
        print(
            f"| {row['model']} | {row['workload']} | {row['engine']} | {row['tokens']} | {row['steps']} | "
            f"{row['step_ms']:.2f} | {row['seconds']:.2f} | {row['tps']:.0f} | {row['tps'] / hf['tps']:.2f}x | "
            f"{row['gbs']:.1f} ({100 * row['gbs'] / hbm_peak:.0f}%) | "
            f"{row['flops'] / 1e9:.2f} ({100 * row['flops'] / peak_flops:.0f}%) |"
        )


if __name__ == "__main__":
    main()
