"""Naive vs decoupled PPO under staleness (AReaL's Table 2, in shape, on CPU): the CPU demo's job for every
(variant, η, seed), interleaved so the machine's drift spreads over every cell, then a table and summary.json.

    python exp/staleness_study.py --out runs/staleness_study                    # the full grid, lr 5e-5
    python exp/staleness_study.py --lr 1e-4 --out runs/staleness_study/lr1e-4   # at the demo's lr
    python exp/staleness_study.py --etas 0,8 --seeds 0 --seconds 30 --out /tmp/smoke   # a smoke run

  naive      π_prox = π_behav (train.recompute_prox_logprobs=false): the clip acts around the behaviour policy
  decoupled  π_prox = the parameters before the step (AReaL): the clip acts around them, π_prox/π_behav weighs
             each token (train.behav_correction, default AReaL's cap mask)
Each run is `bash exp/cpu_demo.sh` with the overrides below (and --extra), its own run directory under
<out>/runs, and held-out greedy accuracy on the demo's 500 problems.

Where staleness comes from. In the plain CPU demo the rollout ranks generate only a little ahead of the trainer
(token staleness <= 2 even at eta = 8), so eta would not matter. The study therefore runs on
exp/clusters/cpu_slow_compute.yaml (--cluster): the same 4 processes, with compute -- training and prefill --
emulated at half this machine's speed (emulation.py) and decode at full speed, so generation outpaces
training and the buffer, not the generator, bounds the staleness. Every run trains the same number of steps
(--steps; no wall-clock limit), so cells compare at equal updates whatever else the shared machine runs. Per run the summary keeps the final and best
accuracy, the mean clip fraction, the importance weights' mean and max, and the token staleness; per cell the
accuracies of every seed: {"naive"|"decoupled": {"<eta>": [acc_seed0, ...]}}. Curves:
`python exp/compare.py <out>/runs --group-by staleness.max_staleness`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"naive": "train.recompute_prox_logprobs=false", "decoupled": "train.recompute_prox_logprobs=true"}


def run_one(out: Path, variant: str, eta: int, seed: int, args, plan: Path | None) -> dict:
    run = out / "runs" / f"{variant}_eta{eta}_seed{seed}"
    if not (run / "metrics.jsonl").exists():
        overrides = [
            VARIANTS[variant],
            f"staleness.max_staleness={eta}",
            f"train.seed={seed}",
            f"train.lr={args.lr}",
            f"train.ppo_minibatches={args.minibatches}",
            f"train.total_steps={args.steps}",
            f"train.max_train_seconds={args.seconds}",
            f"logging.eval_every={args.eval_every}",
            f"rollout.max_queued_groups={args.max_queued_groups}",
            "logging.progress=false",
            *([f"plan.path={plan.resolve()}"] if plan else []),
            *args.extra,
        ]
        proc = subprocess.run(
            ["bash", "exp/cpu_demo.sh", *overrides],
            cwd=ROOT,
            env={**os.environ, "RUN": str(run.resolve())},
            text=True,
            capture_output=True,
        )
        if proc.returncode != 0:
            sys.exit(f"error: {run.name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [m["eval_accuracy"] for m in lines if "eval_accuracy" in m]
    steps = [m for m in lines if "loss" in m]
    mean = lambda key: statistics.fmean(m[key] for m in steps) if steps else 0.0  # noqa: E731
    return {
        "variant": variant,
        "eta": eta,
        "seed": seed,
        "run": str(run.relative_to(out)),
        "steps": len(steps),
        "start_accuracy": evals[0],
        "final_accuracy": evals[-1],
        "best_accuracy": max(evals),
        "pg_clipfrac_mean": mean("pg_clipfrac"),
        "importance_weight_mean": mean("importance_weight_mean"),
        "importance_weight_max": max((m["importance_weight_max"] for m in steps), default=0.0),
        "staleness_mean": mean("staleness_mean"),
        "staleness_max": max((m.get("staleness_max", 0) for m in steps), default=0),
        "curve": [[m["step"], m["eval_accuracy"]] for m in lines if "eval_accuracy" in m and "step" in m],
        # the mean of every evaluation after the start: the area under the curve, less noisy than its last point
        "mean_accuracy": statistics.fmean(evals[1:]) if len(evals) > 1 else evals[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--etas", default="0,1,2,4,8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default="naive,decoupled")
    ap.add_argument("--steps", type=int, default=40, help="train steps per run (every cell trains as many)")
    ap.add_argument("--seconds", type=float, default=0.0, help="also stop after this many training seconds (0: off)")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every this many steps")
    ap.add_argument(
        "--cluster",
        default="exp/clusters/cpu_slow_compute.yaml",
        help="cluster YAML the 4 ranks are planned on (dp 2 trainers, 2 rollout ranks); 'none': the demo's own map",
    )
    ap.add_argument(
        "--lr",
        type=float,
        default=5e-5,
        help="half the demo's 1e-4: at 1e-4 the policy moves so far per version that even decoupled PPO loses points at eta 8 (docs/results.md)",
    )
    ap.add_argument("--minibatches", type=int, default=2, help="PPO minibatches per step (> 1: the clip acts)")
    ap.add_argument("--parallel", type=int, default=2, help="runs at once")
    ap.add_argument(
        "--max-queued-groups",
        type=int,
        default=80,
        help="rollout.max_queued_groups: groups a rollout rank may hold ahead; >= (eta + 1) x prompts_per_step / "
        "rollout ranks, or the queue, not eta, bounds the staleness (the demo's 16 stops it at 2)",
    )
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    ap.add_argument("--out", default="runs/staleness_study")
    args = ap.parse_args()
    etas = [int(x) for x in args.etas.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        sys.exit(f"error: unknown variants {unknown} (known: {list(VARIANTS)})")
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    plan = None
    if args.cluster != "none":
        plan = out / "plan.json"
        cmd = [sys.executable, "schedule.py", "--cluster", args.cluster, "--model", "exp/tiny-model"]
        cmd += ["--train-layout", "2,1,1", "--out", str(plan.resolve()), "--quiet"]
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
        if proc.returncode != 0:
            sys.exit(f"error: planning on {args.cluster} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    cells_in_order = [(variant, eta, seed) for seed in seeds for eta in etas for variant in variants]
    # interleaved: every cell sees the same stretch of machine time per seed; --parallel runs that many at once (the
    # emulated trainers sleep half their time, so two runs share 2 cores without changing what a run trains: the
    # budget is steps, and both sides of a run slow alike)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_one, out, v, e, s, args, plan) for v, e, s in cells_in_order]
        records = []
        for future in futures:
            r = future.result()
            records.append(r)
            print(
                f"{r['variant']:>9} eta={r['eta']} seed={r['seed']}: {r['start_accuracy']:.3f} -> "
                f"{r['final_accuracy']:.3f} (staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']}, "
                f"clip {r['pg_clipfrac_mean']:.4f}, w max {r['importance_weight_max']:.2f})",
                flush=True,
            )

    def cells_of(key: str) -> dict:
        return {v: {str(e): [r[key] for r in records if r["variant"] == v and r["eta"] == e] for e in etas}
                for v in variants}  # fmt: skip

    cells = cells_of("final_accuracy")
    for title, table in (("final accuracy", cells), ("mean accuracy over the evaluations", cells_of("mean_accuracy"))):
        print(
            f"\n{title} (%), mean ± std over seeds\n{'variant':>9} " + " ".join(f"{'eta=' + str(e):>15}" for e in etas)
        )
        for v in variants:
            row = []
            for e in etas:
                accs = table[v][str(e)]
                sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
                row.append(f"{100 * statistics.fmean(accs):6.1f} ± {100 * sd:4.1f}")
            print(f"{v:>9} " + " ".join(f"{x:>15}" for x in row))
    settings = {
        k: getattr(args, k) for k in ("steps", "seconds", "eval_every", "cluster", "lr", "minibatches", "extra")
    }
    (out / "summary.json").write_text(json.dumps({**cells, "settings": settings, "runs": records}, indent=1) + "\n")
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
