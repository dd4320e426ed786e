"""Wall time of calibration.profile_cpu against its budget (acceptance: < 2 s for a 1 s budget).

    python exp/bench_cost_model.py          # one line per budget: wall time, overrun, measured TFLOP/s and TB/s

The measurement loops stop once the budget is spent, so the overrun is the last iteration plus allocating the
matrices and buffers (the first call also imports numpy); `schedule.py --profile-cpu` runs it once per plan.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import calibration  # noqa: E402

LIMITS = {1.0: 2.0}  # budget s -> wall-time limit s
BUDGETS = (0.5, 1.0, 1.5)  # 1.5 s is profile_cpu's default, which schedule.py uses


def main() -> None:
    print(f"{'budget s':>8} {'wall s':>7} {'limit':>6} {'TFLOP/s':>8} {'TB/s':>6}")
    for budget in BUDGETS:
        t0 = time.perf_counter()
        prof = calibration.profile_cpu(budget)
        secs = time.perf_counter() - t0
        limit = f"{LIMITS[budget]:.0f} s" if budget in LIMITS else ""
        ok = "" if budget not in LIMITS else (" ok" if secs < LIMITS[budget] else " SLOW")
        print(f"{budget:>8.1f} {secs:>7.2f} {limit:>6} {prof['tflops']:>8.3f} {prof['hbm_tbps']:>6.3f}{ok}")


if __name__ == "__main__":
    main()
