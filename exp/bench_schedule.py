"""Planner solve time vs cluster size (acceptance: <= 1 s at 24 GPUs, <= 6 s at 56, <= 60 s at 512), the time
of the optimality check against --exhaustive (acceptance: <= 90 s), and `schedule.py calibrate --profile-cpu`'s
measurement against its time budget (acceptance: < 2 s for a 1 s budget).

    python exp/bench_schedule.py    # one line per cluster (paper Table 5: 14.9 s, 23.1 s, 46.7 s, 2.0 min), one
                                    # line for the --exhaustive check, one line per --profile-cpu budget

Clusters: the shipped 24/32/40/56-GPU H800+H20 mixes and a 512-GPU one (16 H800 + 48 H20 machines of 8),
model 7B, the reproduction workload. Time = the full two-phase solve (Algorithm 1 + refinement), imports excluded.

--profile-cpu (calibration.profile_cpu): its loops stop once the budget is spent, so the overrun is the last
iteration plus allocating the matrices and buffers (the first call also imports numpy).

Optimality check: the workload of tests/unit/test_schedule.py::test_planner_matches_exhaustive_on_50_random_small_clusters
(imported from it, so the two cannot drift apart): planner and brute force on the same 50 seeded random clusters.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "exp"))
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # test_schedule's search_budget

from reproduce_paper import workload  # noqa: E402
from test_schedule import SMALL_MODEL, WL, random_cluster  # noqa: E402

from planner import calibration, search, specs  # noqa: E402

LIMITS = {24: 1.0, 56: 6.0, 512: 60.0}
EXHAUSTIVE_SEEDS, EXHAUSTIVE_LIMIT = 50, 90.0
PAPER = {24: "14.9 s", 32: "23.1 s", 40: "46.7 s", 56: "2.0 min"}
PROFILE_CPU_LIMITS = {1.0: 2.0}  # budget s -> wall-time limit s
PROFILE_CPU_BUDGETS = (0.5, 1.0, 1.5)  # 1.5 s is profile_cpu's default, which schedule.py uses


def big_cluster(h800_machines: int, h20_machines: int) -> specs.Cluster:
    base = specs.load_cluster(ROOT / "exp/clusters/hetero_32.yaml")
    machines = [specs.Machine(i, "H800", 8) for i in range(h800_machines)]
    machines += [specs.Machine(h800_machines + i, "H20", 8) for i in range(h20_machines)]
    return specs.Cluster(f"hetero_{8 * len(machines)}", base.gpu_types, machines, base.inter_gbps)


def main() -> None:
    model = specs.load_model_spec("deepseek-r1-distill-qwen-7b")
    wl = workload()
    clusters = [specs.load_cluster(ROOT / f"exp/clusters/hetero_{n}.yaml") for n in (24, 32, 40, 56)]
    clusters.append(big_cluster(16, 48))
    print(
        f"{'GPUs':>5} {'solve s':>8} {'limit':>6} {'paper':>8} {'iters':>6} {'evals':>6} {'MILPs':>6} {'tokens/s':>9}  plan"
    )
    for c in clusters:
        p = search.Planner(c, model, wl)
        t0 = time.perf_counter()
        ev = p.solve()
        secs = time.perf_counter() - t0
        n = c.n_gpus
        roles = {}
        for m, k in zip(c.machines, ev.train_counts):
            roles[m.gpu_type] = roles.get(m.gpu_type, 0) + k
        limit = f"{LIMITS[n]:.0f} s" if n in LIMITS else ""
        ok = "" if n not in LIMITS else (" ok" if secs <= LIMITS[n] else " SLOW")
        print(
            f"{n:>5} {secs:>8.2f} {limit:>6} {PAPER.get(n, ''):>8} {p.stats.iterations:>6} {p.stats.evaluations:>6} "
            f"{p.stats.milp_solves:>6} {ev.tokens_per_s:>9.0f}  train {roles}, dp{ev.train.dp} tp{ev.train.tp} "
            f"pp{ev.train.pp}{ok}"
        )
    bench_vs_exhaustive()
    bench_profile_cpu()


def bench_vs_exhaustive() -> None:
    solve_s = brute_s = 0.0
    worst = (math.inf, -1)
    t_all = time.perf_counter()
    for seed in range(EXHAUSTIVE_SEEDS):
        cluster = random_cluster(seed)
        t0 = time.perf_counter()
        fast = search.Planner(cluster, SMALL_MODEL, WL).solve()
        t1 = time.perf_counter()
        brute = search.Planner(cluster, SMALL_MODEL, WL).exhaustive()
        t2 = time.perf_counter()
        solve_s += t1 - t0
        brute_s += t2 - t1
        worst = min(worst, (fast.tokens_per_s / brute.tokens_per_s, seed))
    secs = time.perf_counter() - t_all
    ok = "ok" if secs <= EXHAUSTIVE_LIMIT else "SLOW"
    print(
        f"\nplanner vs --exhaustive on {EXHAUSTIVE_SEEDS} random clusters (<= 12 GPUs): {secs:.1f} s "
        f"(limit {EXHAUSTIVE_LIMIT:.0f} s) {ok}; planner {solve_s:.1f} s, exhaustive {brute_s:.1f} s; "
        f"worst ratio {worst[0]:.4f} (seed {worst[1]})"
    )


def bench_profile_cpu() -> None:
    print(f"\n{'--profile-cpu budget s':>22} {'wall s':>7} {'limit':>6} {'TFLOP/s':>8} {'TB/s':>6}")
    for budget in PROFILE_CPU_BUDGETS:
        t0 = time.perf_counter()
        prof = calibration.profile_cpu(budget)
        secs = time.perf_counter() - t0
        limit = f"{PROFILE_CPU_LIMITS[budget]:.0f} s" if budget in PROFILE_CPU_LIMITS else ""
        ok = "" if budget not in PROFILE_CPU_LIMITS else (" ok" if secs < PROFILE_CPU_LIMITS[budget] else " SLOW")
        print(f"{budget:>22.1f} {secs:>7.2f} {limit:>6} {prof['tflops']:>8.3f} {prof['hbm_tbps']:>6.3f}{ok}")


if __name__ == "__main__":
    main()
