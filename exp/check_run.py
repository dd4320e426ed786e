"""Check a finished run from its logs (runlog.audit_run: exactly once, whole groups, the staleness bound, versions
in order, no fault) and print the audit as one JSON line; exit 1 naming every check that failed.

    python exp/check_run.py runs/<run> [--eta 4] [--min-gain 20] [--weights-near-one 0.02] [--min-steps 3]

  --eta               also require that no trained token is older than this (default: the run's own bound)
  --min-gain          held-out accuracy, last eval minus first, in points (percent)
  --weights-near-one  |mean importance weight - 1| at most this (eta = 0: the generator and the trainer agree)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runlog import audit_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--eta", type=int, default=None)
    ap.add_argument("--min-gain", type=float, default=None, help="points of held-out accuracy, last - first eval")
    ap.add_argument("--weights-near-one", type=float, default=None)
    ap.add_argument("--min-steps", type=int, default=1)
    a = ap.parse_args(argv)
    audit = audit_run(a.run)
    failed = list(audit["problems"])
    if audit["steps"] < a.min_steps:
        failed.append(f"{audit['steps']} steps < {a.min_steps}")
    if a.eta is not None and audit["staleness_max"] > a.eta:
        failed.append(f"a token {audit['staleness_max']} versions old > eta {a.eta}")
    if a.min_gain is not None:
        gain = None if audit["eval_first"] is None else 100 * (audit["eval_last"] - audit["eval_first"])
        audit["eval_gain_points"] = gain
        if gain is None or gain < a.min_gain:
            failed.append(f"held-out accuracy gained {gain} points < {a.min_gain}")
    if a.weights_near_one is not None:
        w = audit["importance_weight_mean"]
        if w is None or abs(w - 1) > a.weights_near_one:
            failed.append(f"mean importance weight {w} not within {a.weights_near_one} of 1")
    print(json.dumps({k: v for k, v in audit.items() if k not in ("config", "step_lines", "eval_lines")}))
    for f in failed:
        print(f"check_run: FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
