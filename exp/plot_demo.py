"""Plot the CPU demo: held-out greedy accuracy of RL (a train.py run) and of the supervised baselines
(exp/sft_baseline.py: continued SFT, SFT on correct solutions, rejection-sampling fine-tuning) against training
wall time.

    python exp/plot_demo.py exp/results/demo/summary.json                # the figure in docs/results.md
    python exp/plot_demo.py runs/<rl run> runs/baseline_*.json --out demo_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rl_curve(run_dir: Path) -> tuple[list[float], list[float]]:
    lines = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    elapsed = {m["step"]: m["elapsed_s"] for m in lines if "elapsed_s" in m}
    elapsed[0] = 0.0
    evals = [m for m in lines if "eval_accuracy" in m]
    return [elapsed.get(m["step"], 0.0) for m in evals], [100 * m["eval_accuracy"] for m in evals]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rl_run", help="a train.py run directory, or exp/results/demo/summary.json (RL and baselines)")
    ap.add_argument("baseline_json", nargs="*")
    ap.add_argument("--out", default="exp/results/demo/demo_curves.png")
    args = ap.parse_args()
    if args.rl_run.endswith(".json"):
        summary = json.loads(Path(args.rl_run).read_text())
        x_rl = [c["train_seconds"] for c in summary["rl"]["curve"]]
        y_rl = [100 * c["eval_accuracy"] for c in summary["rl"]["curve"]]
        baselines = list(summary["baselines"].values())
    else:
        x_rl, y_rl = rl_curve(Path(args.rl_run))
        baselines = [json.loads(Path(path).read_text()) for path in args.baseline_json]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x_rl, y_rl, "o-", label="hexrl async GRPO (2 rollout + 2 train ranks)")
    labels = {
        "sft_baseline": "continued SFT on the warm-start data (its mistakes too)",
        "sft_correct_baseline": "SFT on correct reference solutions",
        "rft_baseline": "rejection-sampling fine-tuning (own correct samples)",
    }
    for doc, marker in zip(baselines, ["s--", "^--", "d--", "v--"]):
        curve = doc["curve"]
        label = labels.get(doc.get("kind"), doc.get("kind", "baseline"))
        ax.plot([c["train_seconds"] for c in curve], [100 * c["eval_accuracy"] for c in curve], marker, label=label)
    ax.set_xlabel("training wall time (s), 2 CPU cores")
    ax.set_ylabel("held-out greedy accuracy (%), 500 problems")
    ax.set_title("CPU demo: held-out greedy accuracy against training time")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
