"""Peak device memory of every rank of a plan, from the runtime's own code run on fake tensors (planner/memory.py).

    python exp/estimate_memory.py --config gpu_r1_7b --plan plan.json [--json] [--headroom 0.9] [--jobs 2]
    python exp/estimate_memory.py --validate [--json]      # estimates vs measured peaks on CPU (real tensors, gloo)
    python exp/estimate_memory.py --measure-train-step --config <config> [--layers N]

What runs and what is counted: planner/memory.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from planner.memory import (  # noqa: E402
    FULL,
    STEADY,
    VALIDATION_LAYOUTS,
    VALIDATION_MODELS,
    estimate_plan,
    format_table,
    format_validation,
    load_run,
    measure_train_step,
    validate,
    validation_ok,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Peak device memory of every distinct rank of a plan (fake tensors).")
    ap.add_argument("--config", help="exp/configs/<name>.yaml (or a path)")
    ap.add_argument("--plan", help="plan JSON from schedule.py")
    ap.add_argument("--json", action="store_true", help="one JSON object per distinct rank")
    ap.add_argument("--headroom", type=float, default=0.9, help="a rank fits when peak <= headroom x HBM")
    ap.add_argument("--jobs", type=int, default=2, help="ranks estimated at once (one process each)")
    ap.add_argument("--batch", choices=(STEADY, FULL), default=STEADY, help="trajectories per train step")
    ap.add_argument("--validate", action="store_true", help="estimates vs measured peaks on CPU")
    ap.add_argument(
        "--measure-train-step",
        action="store_true",
        help="one train step of --config's model on this machine's device (CUDA if any) vs its estimate",
    )
    ap.add_argument("--layers", type=int, help="with --measure-train-step: the model's depth (default: the config's)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    a = ap.parse_args(argv)
    if a.validate:
        rows = validate([(m, layout) for m in VALIDATION_MODELS for layout in VALIDATION_LAYOUTS])
        print("\n".join(json.dumps(r) for r in rows) if a.json else format_validation(rows))
        return 0 if all(validation_ok(r) for r in rows) else 1
    if a.measure_train_step:
        if not a.config:
            ap.error("--measure-train-step needs --config")
        row = measure_train_step(a.config, a.overrides, a.layers)
        mib = 2**20
        print(json.dumps(row) if a.json else
              f"{row['config']} ({row['layers']} layers) on {row['device']}: one train step measured "
              f"{row['measured_low'] / mib:.1f}-{row['measured_high'] / mib:.1f} MiB, estimated "
              f"{row['estimated'] / mib:.1f} MiB ({row['error_vs_low']:+.1%} / {row['error_vs_high']:+.1%}), "
              f"step {row['seconds']} s: {'within' if row['ok'] else 'NOT within'} 15%")  # fmt: skip
        return 0 if row["ok"] else 1
    if not a.config or not a.plan:
        ap.error("--config and --plan are required (or --validate)")
    if not Path(a.plan).is_file():
        raise SystemExit(f"error: plan file '{a.plan}' does not exist (make one with schedule.py --out)")
    from errors import HexrlError

    try:
        load_run(a.config, a.overrides)  # a bad config or override fails here, once, not in every worker
    except HexrlError as e:
        raise SystemExit(f"error: {e}") from None
    rows = estimate_plan(a.config, a.plan, a.overrides, a.headroom, a.jobs, a.batch)
    if a.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_table(rows, a.headroom))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
