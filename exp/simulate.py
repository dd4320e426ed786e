"""Discrete-event simulation of the asynchronous RL pipeline of a plan JSON (planner/simulate.py).

    python exp/simulate.py --plan plan.json --steps 20 --eta 4
    python exp/simulate.py --plan plan.json --eta-sweep 0,1,2,4,8,16
    python exp/simulate.py --plan plan.json --eta 4 --consume-order all --long-tail 1.0

The model and its assumptions: planner/simulate.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from buffer import CONSUME_ORDERS  # noqa: E402
from planner.simulate import long_tail_workload, simulate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Simulate the asynchronous RL pipeline of a plan JSON.")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, default=None)
    ap.add_argument("--eta-sweep", default="", help="comma-separated eta values, e.g. 0,1,2,4,8,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=1, help="average over seeds seed..seed+N-1 (max staleness: over all)")
    ap.add_argument(
        "--consume-order",
        default="deadline",
        choices=[*CONSUME_ORDERS, "all"],
        help="the buffer's batch rule (buffer.py); all = one row each",
    )
    ap.add_argument(
        "--long-tail",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="replace the plan's output lengths by a lognormal of the same mean (sigma > 0)",
    )
    a = ap.parse_args(argv)
    if a.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {a.seeds}")
    try:
        with open(a.plan) as f:
            plan = json.load(f)
        etas = [int(x) for x in a.eta_sweep.split(",")] if a.eta_sweep else [a.eta]
        orders = CONSUME_ORDERS if a.consume_order == "all" else [a.consume_order]
        wl = long_tail_workload(plan, a.long_tail) if a.long_tail else None
        print(
            f"{'eta':>4} {'order':>10} {'step s':>9} {'tokens/s':>10} {'roll idle':>9} {'train idle':>10} "
            f"{'stale mean':>10} {'max':>4}"
        )
        for eta in etas:
            for order in orders:
                runs = [
                    simulate(plan, wl, steps=a.steps, eta=eta, seed=a.seed + i, consume_order=order)
                    for i in range(a.seeds)
                ]
                mean = {
                    k: statistics.fmean(r[k] for r in runs)
                    for k in ("step_s", "tokens_per_s", "rollout_idle_frac", "trainer_idle_frac")
                }
                print(
                    f"{eta:>4} {order:>10} {mean['step_s']:>9.2f} {mean['tokens_per_s']:>10.1f} "
                    f"{mean['rollout_idle_frac']:>9.3f} {mean['trainer_idle_frac']:>10.3f} "
                    f"{statistics.fmean(r['staleness']['mean'] for r in runs):>10.2f} "
                    f"{max(r['staleness']['max'] for r in runs):>4}"
                )
        print(f"planner's predicted step: {plan['predicted']['step_s']:.2f} s")
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
