"""Reward throughput, one process: GSM8K-style responses through reward_math.score (the fast path), and LaTeX
answers through math-verify (RewardPool workers, cold and cached) for the planner's reward cost.

    HF_DATASETS_OFFLINE=1 .venv/bin/python exp/bench_reward.py [--repeats 3] [--slow 40] [--workers 2]

Responses are built from the vendored GSM8K test split (1,319 problems), three per problem: the reference
solution (`#### N`, correct), the same with its final number altered (wrong), and a chat-style ending
"... so the answer is $\\boxed{N}$." (correct). Every verdict is checked, so a fast wrong scorer cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import reward_math  # noqa: E402

GSM8K_TEST = os.path.join(os.path.dirname(__file__), "..", "data", "gsm8k", "test.jsonl")
# MATH-convention pairs that need math-verify (none is a plain number on both sides)
LATEX_PAIRS = [
    ("\\frac{3}{4}", "\\dfrac{6}{8}", 1.0),
    ("x^2+2x+1", "(x+1)^2", 1.0),
    ("[0,1)", "(0,1)", 0.0),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", 1.0),
    ("(1,2)", "(2,1)", 0.0),
    ("10\\%", "\\frac{1}{10}", 1.0),
    ("\\{1,2,3\\}", "\\{3,1,2\\}", 1.0),
    ("2\\pi", "\\pi", 0.0),
]


def gsm8k_responses() -> list[tuple[str, str, float]]:
    cases = []
    with open(GSM8K_TEST) as f:
        for line in f:
            solution = json.loads(line)["answer"]
            head, gold = solution.rsplit("####", 1)
            gold = gold.strip()
            wrong = int(gold.replace(",", "")) + 1
            cases += [
                (solution, gold, 1.0),
                (f"{head}#### {wrong}", gold, 0.0),
                (f"{head.strip()}\nSo the answer is $\\boxed{{{gold}}}$.", gold, 1.0),
            ]
    return cases


def bench_fast_path(cases: list[tuple[str, str, float]], repeats: int) -> float:
    for response, gold, expected in cases:  # correctness first (also warms caches of the regex engine)
        got = reward_math.score(response, gold)
        assert got == expected, (response[-80:], gold, got)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for response, gold, _ in cases:
            reward_math.score(response, gold)
    return repeats * len(cases) / (time.perf_counter() - t0)


def bench_pool(num_workers: int, copies: int) -> dict[str, float]:
    """Slow-path jobs through RewardPool: each pair made unique per copy (trailing thin spaces defeat the
    verdict cache), then the same jobs again (all cache hits)."""
    jobs = []
    for c in range(copies):
        for gold, answer, expected in LATEX_PAIRS:
            suffix = "\\," * (c + 1)  # thin spaces: same answer, distinct string
            jobs.append((f"\\boxed{{{answer}{suffix}}}", gold, expected))
    with reward_math.RewardPool(num_workers) as pool:
        start = time.monotonic()
        while not all(w.poll_ready() for w in pool._workers):  # startup is not scoring time
            if time.monotonic() - start > 300:
                raise RuntimeError("reward workers did not start")
            time.sleep(0.05)
        out = {"worker_startup_s": time.monotonic() - start}
        for phase in ("cold", "cached"):
            pool.reward_s = 0.0
            t0 = time.perf_counter()
            for i, (response, gold, _) in enumerate(jobs):
                pool.submit(i, response, gold)
            results = pool.drain(timeout_s=600)
            wall = time.perf_counter() - t0
            assert len(results) == len(jobs)
            for key, details, _ in results:
                if details.reason != "timeout":
                    assert details.reward == jobs[key][2], (jobs[key], details)
            out[f"{phase}_per_s"] = len(jobs) / wall
            out[f"{phase}_mean_service_ms"] = 1e3 * pool.reward_s / len(jobs)
            out[f"{phase}_timeouts"] = sum(d.reason == "timeout" for _, d, _ in results)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="passes over the 3x1,319 GSM8K responses")
    parser.add_argument("--slow", type=int, default=5, help="copies of the LaTeX pairs for the math-verify bench")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = gsm8k_responses()
    per_s = bench_fast_path(cases, args.repeats)
    print(
        f"fast path  : {per_s:,.0f} scorings/s/process over {args.repeats}x{len(cases)} GSM8K responses "
        f"({1e6 / per_s:.0f} us each), all verdicts checked"
    )
    if args.slow > 0:
        pool = bench_pool(args.workers, args.slow)
        n = args.slow * len(LATEX_PAIRS)
        print(
            f"math-verify: {n} LaTeX jobs, {args.workers} workers (startup {pool['worker_startup_s']:.1f}s): "
            f"cold {pool['cold_per_s']:.1f}/s ({pool['cold_mean_service_ms']:.0f} ms/job service, "
            f"{pool['cold_timeouts']} timeouts), cached {pool['cached_per_s']:,.0f}/s"
        )


if __name__ == "__main__":
    main()
