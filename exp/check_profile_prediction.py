"""Acceptance 4 of issue 21: does the planner, with a device profile, predict a run's step time?

    python exp/check_profile_prediction.py runs/<run> --profile exp/profiles/cpu.yaml [--cluster exp/clusters/cpu.yaml]

What it prices and measures: planner/run_prediction.py. Exit status 0 when the predicted step is within
--tolerance (default 15%) of the measured one, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.run_prediction import mean_prompt_tokens, predict, read_run, steady_steps, workload  # noqa: E402
from planner.specs import Machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a train.py run directory (config.yaml, metrics.jsonl, plan.json, layout.json)")
    ap.add_argument("--profile", action="append", required=True, help="device profile YAML (repeatable)")
    ap.add_argument("--cluster", default=str(ROOT / "exp/clusters/cpu.yaml"), help="cluster YAML the run ran on")
    ap.add_argument("--prompt-len", type=float, default=None, help="mean prompt tokens (default: tokenize the task)")
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the measured medians")
    ap.add_argument("--tolerance", type=float, default=0.15, help="allowed |predicted - measured| / measured")
    ap.add_argument("--json", default=None, help="write the comparison here")
    a = ap.parse_args(argv)
    run = Path(a.run)
    cfg, rows, plan, layout = read_run(run)
    steady = steady_steps(rows, a.skip)
    if not steady:
        raise SystemExit(f"error: {run} has no steady-state steps after skipping {a.skip}")
    prompt_len = a.prompt_len if a.prompt_len is not None else mean_prompt_tokens(cfg)
    wl = workload(cfg, rows, prompt_len)
    ev, planner = predict(a.cluster, a.profile, cfg, plan, layout, wl)
    cluster = planner.cluster
    steps = [r for r in rows if "step_s" in r]
    mean_step = steps[-1]["elapsed_s"] / len(steps)
    measured = {
        "step_s": statistics.median(r["step_s"] for r in steady),
        "train_s": statistics.median(r["train_s"] for r in steady),
        "sync_s": statistics.median(r["weight_sync_s"] for r in steady),
        # the sync as the replicas saw it: until the last one took the version (runs since weight_ready_s)
        "ready_s": statistics.median(r["weight_ready_s"] for r in steady) if "weight_ready_s" in steady[0] else None,
        "rollout_busy_s": (1 - steps[-1]["rollout_idle_frac"]) * mean_step,
        "mean_step_s": mean_step,
    }
    predicted = {
        "step_s": ev.step_s,
        "train_s": ev.train_s,
        "sync_s": ev.train_sync_s,  # the train side's sends, as weight_sync_s measures them
        "ready_s": ev.sync_s,  # until every replica holds the version
        "rollout_s": ev.rollout_s,
        "busy_devices": {str(m): dict(b) for m, b in ev.host_pricing.get("busy_devices", {}).items()},
    }
    error = (predicted["step_s"] - measured["step_s"]) / measured["step_s"]
    busy_devices = ev.host_pricing.get("busy_devices", {})
    priced = cluster.speeds.with_busy_devices(busy_devices) if busy_devices else cluster.speeds

    def machine_speed(m: Machine) -> str:
        """A machine's core share per role its devices have (HostSpeeds.speed), and the devices busy while one works."""
        seen = busy_devices.get(m.index, {})
        cores = priced.host_cores[m.index] if seen else None
        if cores is None or not seen:
            return f"machine {m.index}: {priced.speed(m.index):.3g}"
        roles = ", ".join(
            f"{role} {priced.speed(m.index, 'compute', role):.3g} ({busy:.2f} of {m.gpus} devices busy while one works)"
            for role, busy in seen.items()
        )
        return f"machine {m.index}: {roles} on {cores:g} cores"

    speed = "; ".join(machine_speed(m) for m in cluster.machines)
    print(f"run {run}: {len(steps)} steps, {len(steady)} steady (first {a.skip} and those after an eval left out)")
    print(
        f"workload: {wl.batch} sequences/step ({wl.prompts_per_step} x {wl.samples_per_prompt}), prompt "
        f"{wl.prompt_len:.1f} + response {wl.gen_mean:.1f} tokens, eta {wl.eta}, {wl.precision}, "
        f"{wl.ppo_minibatches} minibatch(es) of {wl.microbatch_tokens}-token micro-batches, {wl.train_passes:g} passes"
    )
    print(f"split: train dp {plan['train']['dp']} x tp {plan['train']['tp']} x pp {plan['train']['pp']}, "
          f"{len(ev.rollout.replicas)} rollout replica(s); device speed (HostSpeeds.speed) {speed}")  # fmt: skip
    print(f"{'':10s} {'predicted':>10s} {'measured':>10s}")
    for key, label, mkey in (
        ("rollout_s", "rollout", "rollout_busy_s"),
        ("train_s", "train", "train_s"),
        ("sync_s", "sync", "sync_s"),
        ("step_s", "step", "step_s"),
    ):
        print(f"{label:10s} {predicted[key]:10.3f} {measured[mkey]:10.3f}")
    if measured["ready_s"] is not None:
        print(
            f"{'sync ready':10s} {predicted['ready_s']:10.3f} {measured['ready_s']:10.3f}  (until every replica held it)"
        )
    print(f"{'mean step':10s} {'':10s} {measured['mean_step_s']:10.3f}  (elapsed / steps, evaluations included)")
    ok = abs(error) <= a.tolerance
    print(f"step error {error * 100:+.1f}% ({'within' if ok else 'outside'} {a.tolerance * 100:.0f}%)")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"predicted": predicted, "measured": measured, "error": error, "workload": wl.to_dict()}, indent=1
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
