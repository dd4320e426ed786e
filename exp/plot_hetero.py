"""Plot exp/hetero_cpu.py's experiment: predicted and measured step time per plan (each run's median as a dot), and
measured trained tokens / s.

    python exp/plot_hetero.py runs/hetero_cpu-<time>/hetero_summary.json --out exp/results/hetero_cpu/hetero.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", help="hetero_summary.json")
    ap.add_argument("--out", default=None, help="PNG (default: hetero.png beside the summary)")
    a = ap.parse_args(argv)
    summary = json.loads(Path(a.summary).read_text())
    plans = [p for p in summary["plans"] if "measured_step_s" in p]
    if not plans:
        raise SystemExit(f"error: {a.summary} has no measured plan (the runs did not finish)")
    names = [p["name"] + (" (planner)" if p["is_planner_plan"] and p["name"] != "planner" else "") for p in plans]
    x = range(len(plans))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.bar([i - 0.2 for i in x], [p["predicted_step_s"] for p in plans], 0.4, label="predicted (cost model)")
    ax.bar([i + 0.2 for i in x], [p["measured_step_s"] for p in plans], 0.4, label="measured (median)")
    for i, p in zip(x, plans):
        runs = p.get("measured_step_s_per_run", [])
        ax.plot([i + 0.2] * len(runs), runs, "k.", markersize=5)
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("step time (s)")
    ax.set_title("step time per plan (dots: each run)")
    ax.legend()
    bx.bar(list(x), [p["measured_tokens_per_s"] for p in plans], 0.6, color="tab:green")
    bx.set_xticks(list(x), names, rotation=20)
    bx.set_ylabel("trained tokens / s (measured)")
    bx.set_title(f"emulated cluster {summary['cluster'].get('name', '')}")
    fig.tight_layout()
    out = Path(a.out) if a.out else Path(a.summary).with_name("hetero.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
