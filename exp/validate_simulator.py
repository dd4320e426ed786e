"""Validate exp/simulate.py against measured CPU runs: predicted vs measured step time and trained tokens/s.

    python exp/validate_simulator.py runs/layouts_cpu-<time>        # made by exp/layouts_cpu.sh

For every run directory whose plan.json came from schedule.py (it carries the planner's `inputs`):
1. profile the run's components from its own metrics (what simulate.predict_from_measured takes):
   - trainer seconds per sequence token  = Σ train_s / Σ (trained response tokens + B x prompt length)
   - rollout seconds per generated token  = busy time of one rollout replica / tokens it generated, where
     busy = (1 - rollout_idle_frac) x rollout lifetime - the start-up sync + eval (the step-0 eval time)
   - rollout seconds per prefilled token  = the generators' own prefill timer / prefilled tokens (prompts and
     KV recompute after weight swaps), taken out of the busy time above
   - weight sync seconds                  = mean weight_ready_s (until every replica held the version; the
     head's weight_sync_s where a run did not log it) for the replicas, mean weight_sync_s for the trainer
   and the workload: prompts x samples per step, mean response length, η, and the prompt length the plan
   was made for (metrics count only response tokens, which carry the loss);
2. run the discrete-event simulator with those costs: it composes them through the pipeline (admission
   under η, continuous batching, sync pauses with KV recompute, oldest-first batches) and predicts the
   steady-state step time and tokens/s, none of which it was given;
3. compare with the measured steady state (steps after the first `warmup`, as the simulator counts them);
   the simulator's tokens/s counts prompt + response tokens, so it is scaled by response / (prompt + response)
   to compare with trained (response) tokens/s.
The planner's uncalibrated prediction (exp/clusters/cpu.yaml constants) is printed alongside for reference.

    python exp/validate_simulator.py --profile exp/profiles/cpu.yaml <runs>      # held out: nothing from the runs

With --profile the simulator takes no cost from the runs: each run's own split (its train layout and rollout
replicas) is priced by the cost model with the device profile (exp/check_profile_prediction.py's predict: the
cluster resized to the run, the profile applied, the run's workload -- batch, eta, lengths, minibatches), made
into a plan (schedule.to_plan_json) and simulated. The profile is fitted on microbenchmarks of this machine
(`schedule.py profile`), not on any run, so every run is a held-out prediction; tolerance 15%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import compare  # noqa: E402

import schedule  # noqa: E402
from planner import run_prediction, simulate  # noqa: E402

TOLERANCE = 0.20  # costs profiled from each run itself
HELD_OUT_TOLERANCE = 0.15  # costs from a device profile: the runs held out


def profile(run: compare.Run, plan: dict) -> dict:
    """Per-token costs and the workload of one measured run."""
    steps = run.steps
    if len(steps) < 4:
        raise compare.CompareError(f"{run.source}: {len(steps)} steps; validation needs at least 4")
    cfg = run.config
    B = compare.config_value(cfg, "train.prompts_per_step") * compare.config_value(cfg, "rollout.samples_per_prompt")
    trained = sum(s["trained_tokens"] for s in steps)
    generated = sum(s["generated_tokens_per_s"] * s["step_s"] for s in steps)
    resp_mean = sum(s["response_len_mean"] for s in steps) / len(steps)
    prompt_len = float(plan["inputs"]["workload"]["prompt_len"])
    startup = run.evals[0]["time"] if run.evals and run.evals[0]["step"] == 0 else 0.0
    lifetime = steps[-1]["elapsed_s"] + startup
    busy = max((1 - steps[-1]["rollout_idle_frac"]) * lifetime - startup, 1e-9)
    replicas = len(plan["rollout"]["replicas"])
    # prefill (prompts, shared prompts excluded, and KV recompute after weight swaps) is timed by the generator
    # itself: the simulator charges it separately, so it leaves the per-generated-token cost
    prefill_s = steps[-1].get("rollout_prefill_s")
    prefill_tokens = steps[-1].get("rollout_prefill_tokens")
    prefill_s_per_token = prefill_s / prefill_tokens if prefill_s is not None and prefill_tokens else None
    if prefill_s_per_token is not None:
        busy = max(busy - prefill_s / replicas, 1e-9)
    return {
        "batch": B,
        "prompt_len": prompt_len,
        "gen_mean": resp_mean,
        "train_s_per_token": sum(s["train_s"] for s in steps) / (trained + B * prompt_len * len(steps)),
        "decode_s_per_token": busy / (generated / replicas),
        "prefill_s_per_token": prefill_s_per_token,
        "sync_send_s": sum(s["weight_sync_s"] for s in steps) / len(steps),
        # until every replica held the version where the run logged it, else the head's sends
        "sync_s": sum(s.get("weight_ready_s", s["weight_sync_s"]) for s in steps) / len(steps),
        "eta": compare.config_value(cfg, "staleness.max_staleness"),
    }


def validate_run(run_dir: Path, warmup: int = 2, seed: int = 0) -> dict:
    run = compare.load_run_dir(run_dir)
    plan_path = run_dir / "plan.json"
    if not plan_path.is_file():
        raise compare.CompareError(f"{run_dir}: no plan.json")
    plan = json.loads(plan_path.read_text())
    if "inputs" not in plan:
        raise compare.CompareError(f"{run_dir}: plan.json was not made by schedule.py (no 'inputs')")
    p = profile(run, plan)
    measured = compare.summarize(run, warmup=warmup)
    workload = {
        **plan["inputs"]["workload"],
        "prompts_per_step": compare.config_value(run.config, "train.prompts_per_step"),
        "samples_per_prompt": compare.config_value(run.config, "rollout.samples_per_prompt"),
        "prompt_len": p["prompt_len"],
        "gen_samples": [p["gen_mean"]],
        "eta": p["eta"],
    }
    res = simulate.simulate(
        plan,
        workload,
        steps=len(run.steps),
        seed=seed,
        warmup=warmup,
        decode_s_per_token=p["decode_s_per_token"],
        train_s_per_token=p["train_s_per_token"],
        sync_s=p["sync_s"],
        prefill_s_per_token=p["prefill_s_per_token"],
        sync_send_s=p["sync_send_s"],
    )
    predicted_tokens_per_s = res["tokens_per_s"] * p["gen_mean"] / (p["gen_mean"] + p["prompt_len"])
    t = plan["train"]
    return {
        "run": run.name,
        "layout": f"dp{t['dp']} tp{t['tp']} pp{t['pp']} + {len(plan['rollout']['replicas'])} rollout",
        "profile": p,
        "measured_step_s": measured["step_s"],
        "predicted_step_s": res["step_s"],
        "measured_tokens_per_s": measured["tokens_per_s"],
        "predicted_tokens_per_s": predicted_tokens_per_s,
        "planner_step_s": plan["predicted"]["step_s"],
        "measured_staleness_mean": measured["staleness_mean"],
        "predicted_staleness_mean": res["staleness"]["mean"],
        "tokens_err": predicted_tokens_per_s / measured["tokens_per_s"] - 1,
        "step_err": res["step_s"] / measured["step_s"] - 1,
    }


def predict_run(run_dir: Path, profiles: list[str], cluster: str, warmup: int = 2, seed: int = 0) -> dict:
    """A run predicted from a device profile alone (see the module docstring): simulated step and tokens/s."""
    run = compare.load_run_dir(run_dir)
    if len(run.steps) <= warmup + 1:
        raise compare.CompareError(f"{run_dir}: {len(run.steps)} steps; validation needs more than {warmup + 1}")
    cfg, rows, plan, layout = run_prediction.read_run(run_dir)
    if "train" not in plan or "world_size" not in plan:
        raise compare.CompareError(f"{run_dir}: plan.json has no train layout or world size")
    wl = run_prediction.workload(cfg, rows, run_prediction.mean_prompt_tokens(cfg))
    ev, planner = run_prediction.predict(cluster, profiles, cfg, plan, layout, wl)
    res = simulate.simulate(schedule.to_plan_json(planner, ev), steps=len(run.steps), seed=seed, warmup=warmup)
    # measured: the steps after the warm-up but for those that waited for an evaluation (the cost model and the
    # simulator have no evaluations)
    steady = run_prediction.steady_steps(rows, warmup)
    if not steady:
        raise compare.CompareError(f"{run_dir}: no steady steps after the first {warmup}")
    measured = {
        "step_s": statistics.fmean(r["step_s"] for r in steady),
        "tokens_per_s": sum(r["trained_tokens"] for r in steady) / sum(r["step_s"] for r in steady),
        "staleness_mean": compare.summarize(run, warmup=warmup)["staleness_mean"],
    }
    predicted_tokens_per_s = res["tokens_per_s"] * wl.gen_mean / (wl.gen_mean + wl.prompt_len)
    t = plan["train"]
    return {
        "run": run.name,
        "layout": f"dp{t['dp']} tp{t['tp']} pp{t['pp']} + {len(ev.rollout.replicas)} rollout",
        "eta": wl.eta,
        "response_len": wl.gen_mean,
        "fitted_on": profiles,
        "measured_step_s": measured["step_s"],
        "predicted_step_s": res["step_s"],
        "measured_tokens_per_s": measured["tokens_per_s"],
        "predicted_tokens_per_s": predicted_tokens_per_s,
        "planner_step_s": ev.step_s,
        "measured_staleness_mean": measured["staleness_mean"],
        "predicted_staleness_mean": res["staleness"]["mean"],
        "tokens_err": predicted_tokens_per_s / measured["tokens_per_s"] - 1,
        "step_err": res["step_s"] / measured["step_s"] - 1,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Simulator predictions vs measured CPU runs.")
    ap.add_argument("paths", nargs="+", help="run directories or directories holding them")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out, as the simulator does")
    ap.add_argument("--out", default=None, help="JSON file for the results (default: <first path>/validation.json)")
    ap.add_argument("--profile", action="append", default=[], help="device profile YAML: predict the runs held out")
    ap.add_argument("--cluster", default=str(HERE / "clusters/cpu.yaml"), help="with --profile: the runs' cluster")
    a = ap.parse_args(argv)
    tolerance = HELD_OUT_TOLERANCE if a.profile else TOLERANCE
    try:
        dirs = compare.find_run_dirs(a.paths)
        results, skipped = [], []
        for d in dirs:
            try:
                results.append(
                    predict_run(d, a.profile, a.cluster, a.warmup) if a.profile else validate_run(d, a.warmup)
                )
            except compare.CompareError as e:
                skipped.append(str(e))
        for s in skipped:
            print(f"skipped: {s}")
        if not results:
            raise compare.CompareError("no run could be validated (need planner plan.json and >= 4 steps)")
    except (compare.CompareError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"{'run':<18} {'layout':<22} {'meas tok/s':>10} {'sim tok/s':>10} {'err':>7} "
        f"{'meas step s':>11} {'sim step s':>10} {'err':>7} {'stale m/s':>10} {'planner step s':>14}"
    )
    for r in results:
        print(
            f"{r['run']:<18} {r['layout']:<22} {r['measured_tokens_per_s']:>10.1f} {r['predicted_tokens_per_s']:>10.1f} "
            f"{r['tokens_err']:>+7.1%} {r['measured_step_s']:>11.3f} {r['predicted_step_s']:>10.3f} {r['step_err']:>+7.1%} "
            f"{r['measured_staleness_mean']:>4.2f}/{r['predicted_staleness_mean']:<5.2f} {r['planner_step_s']:>14.3f}"
        )
    ok = [r for r in results if abs(r["tokens_err"]) <= tolerance and abs(r["step_err"]) <= tolerance]
    fitted = f"fitted on {', '.join(a.profile)} alone, every run held out" if a.profile else "each run's own costs"
    print(f"{len(ok)} of {len(results)} runs within {tolerance:.0%} (tokens/s and step time; {fitted})")
    out = Path(a.out) if a.out else Path(a.paths[0]) / "validation.json"
    if out.parent.is_dir():
        out.write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
