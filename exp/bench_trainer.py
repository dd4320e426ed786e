"""Trainer step time per layout against 1 process, on a ~30M-parameter Llama config (CPU, gloo, 1 thread per rank).

    .venv/bin/python exp/bench_trainer.py [--layouts 1,1,1 2,1,1 1,2,1 1,1,2 1,1,2:4+4 2,1,1/allreduce] [--steps 3]
    .venv/bin/python exp/bench_trainer.py --baseline /tmp/old   # another checkout's trainer, side by side

With --baseline DIR (a checkout of another commit, e.g. `git worktree add /tmp/old <commit>`) every layout runs
with both trees' trainers in turn (each tree's own copy of this file as the worker) and the table gives the ratio
of this tree's step time to the baseline's.

A PP layout without `:a+b` gets the compute-balanced split (the LM head counts on the last stage). DP shards with
FSDP2 unless the layout ends in `/allreduce` (train.shard_state=false: replicated state, one bucketed all-reduce).

The driver launches one torchrun per layout (nproc = dp*tp*pp) running this same file as a worker; the worker times
`steps` train_steps after one warm-up step and the train head prints one JSON line. Ratio to ideal =
step time / (1-process step time / number of ranks): 1.0 is perfect scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bench_model():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def balanced_stage_sizes(model, pp: int) -> list[int]:
    """Layers per pipeline stage that minimise the largest stage's matmul work (parameters touched per token:
    each decoder layer, plus the LM head on the last stage; the embedding is a lookup) -- what the planner does
    for stages of one GPU type. An even split would leave the last stage the LM head's extra work."""
    import itertools

    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.lm_head.weight.numel()
    n = model.config.num_hidden_layers
    best = None
    for cuts in itertools.combinations(range(1, n), pp - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
        work = max(k * layer + (head if s == pp - 1 else 0) for s, k in enumerate(sizes))
        if best is None or work < best[0]:
            best = (work, sizes)
    return best[1]


def bench_trajectories(n: int, prompt: int, response: int):
    from types import SimpleNamespace

    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        r = response - int(torch.randint(0, response // 2, (1,), generator=g))  # uneven lengths, like RL rollouts
        ids = torch.randint(0, 8192, (prompt + r,), generator=g).tolist()
        out.append(
            SimpleNamespace(
                prompt_id=i,
                sample_idx=0,
                prompt_ids=ids[:prompt],
                response_ids=ids[prompt:],
                behav_logprobs=(-9.0 + 0.1 * torch.randn(r, generator=g)).tolist(),
                versions=[0] * r,
                reward=0.0,
                advantage=float(torch.randn((), generator=g)),
            )
        )
    return out


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from config import TrainConfig
    from parallel.groups import build_groups
    from parallel.trainer import Trainer
    from plan import make_train_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout, _, mode = args.layout.partition("/")
    dims, _, split = layout.partition(":")
    dp, tp, pp = (int(x) for x in dims.split(","))
    model = bench_model()
    sizes = [int(x) for x in split.split("+")] if split else balanced_stage_sizes(model, pp)
    stage_layers = [(sum(sizes[:s]), sum(sizes[: s + 1])) for s in range(pp)]
    groups = build_groups(make_train_plan(dp, tp, pp, stage_layers))
    trainer = Trainer(
        model,
        groups,
        TrainConfig(
            lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, min_microbatches=1, shard_state=mode != "allreduce"
        ),
        "cpu",
    )
    trajs = bench_trajectories(args.seqs, args.prompt, args.response)
    metrics = trainer.train_step(trajs)  # warm-up
    times, cpu = [], []
    for _ in range(args.steps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = trainer.train_step(trajs)
        cpu.append(time.process_time() - c0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    # CPU seconds of the best step, summed over ranks: the work the layout costs, whatever the machine's load
    best = times.index(min(times))
    cpu_sum = torch.tensor([cpu[best]], dtype=torch.float64)
    dist.all_reduce(cpu_sum)
    if groups.is_train_head:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            "BENCH "
            + json.dumps(
                {
                    "layout": args.layout,
                    "ranks": dp * tp * pp,
                    "params": n_params,
                    "stage_layers": "+".join(map(str, sizes)),
                    "step_s": min(times),
                    "step_s_all": times,
                    "cpu_s_all_ranks": cpu_sum.item(),
                    "tokens": metrics["trained_tokens"],
                    "microbatches": metrics["num_microbatches"],
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_layout(tree: str, layout: str, args) -> dict:
    """One torchrun of `tree`'s own worker for one layout: its BENCH line."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    n = 1
    for x in layout.partition("/")[0].partition(":")[0].split(","):
        n *= int(x)
    cmd = [
        torchrun,
        "--standalone",
        f"--nproc_per_node={n}",
        os.path.join(tree, "exp", "bench_trainer.py"),
        "--worker",
        "--layout",
        layout,
        "--steps",
        str(args.steps),
        "--seqs",
        str(args.seqs),
        "--prompt",
        str(args.prompt),
        "--response",
        str(args.response),
        "--micro-batch-tokens",
        str(args.micro_batch_tokens),
    ]
    out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=1800)
    line = [l for l in out.stdout.splitlines() if l.startswith("BENCH ")]
    if not line:
        raise RuntimeError(f"layout {layout} in {tree} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    print(f"{tree}: {line[0]}", flush=True)
    return json.loads(line[0][6:])


def driver(args) -> None:
    trees = [ROOT] + ([os.path.abspath(args.baseline)] if args.baseline else [])
    best: dict[tuple[str, str], dict] = {}
    # --repeats rounds over all layouts (and trees), interleaved, best round per layout: a slow spell of this shared
    # machine then hits every layout alike instead of one
    for layout in [lay for _ in range(args.repeats) for lay in args.layouts]:
        for tree in trees:
            row = run_layout(tree, layout, args)
            if (tree, layout) not in best or row["step_s"] < best[tree, layout]["step_s"]:
                best[tree, layout] = row
    if args.baseline:
        print(
            f"\n| layout dp,tp,pp | step s (this tree) | step s ({args.baseline}) | ratio | CPU s ratio |\n|---|---|---|---|---|"
        )
        for layout in args.layouts:
            new, old = best[ROOT, layout], best[trees[1], layout]
            print(
                f"| {layout} | {new['step_s']:.2f} | {old['step_s']:.2f} | {new['step_s'] / old['step_s']:.2f} "
                f"| {new['cpu_s_all_ranks'] / old['cpu_s_all_ranks']:.2f} |"
            )
        return
    rows = [best[ROOT, layout] for layout in args.layouts]
    base = next(r["step_s"] for r in rows if r["ranks"] == 1)
    print(
        f"\nparams {rows[0]['params'] / 1e6:.1f}M, {rows[0]['tokens']:.0f} trained tokens/step\n"
        f"| layout dp,tp,pp (layers per stage) | ranks | step s | ideal s | ratio to ideal | CPU s (all ranks) | CPU ratio |\n"
        f"|---|---|---|---|---|---|---|"
    )
    base_cpu = next(r["cpu_s_all_ranks"] for r in rows if r["ranks"] == 1)
    for r in rows:
        ideal = base / r["ranks"]
        print(
            f"| {r['layout']} ({r['stage_layers']}) | {r['ranks']} | {r['step_s']:.2f} | {ideal:.2f} | {r['step_s'] / ideal:.2f} "
            f"| {r['cpu_s_all_ranks']:.2f} | {r['cpu_s_all_ranks'] / base_cpu:.2f} |"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--layout", default="1,1,1")
    ap.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,1", "1,2,1", "1,1,2"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the layouts; best kept")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=128)
    ap.add_argument("--baseline", help="a checkout of another commit: its trainer runs beside this one")
    a = ap.parse_args()
    worker(a) if a.worker else driver(a)
