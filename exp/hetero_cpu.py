"""Heterogeneity measured end to end on one machine: the planner's plan against four alternatives, each run on
emulated device types (emulation.py), predicted by the cost model and measured side by side.

    bash exp/hetero_cpu.sh                                     # -> runs/hetero_cpu-<time>/
    python exp/hetero_cpu.py --out /tmp/h --steps 6 --repeats 1   # shorter
    python exp/hetero_cpu.py --out /tmp/h --plans-only            # plan and predict, run nothing
    python exp/hetero_cpu.py --plot runs/hetero_cpu-<time>/hetero_summary.json   # redraw hetero.png beside it

The cluster (exp/clusters/cpu_hetero.yaml): two emulated machines of two ranks on this machine's cores, one of a
bandwidth-rich, compute-poor type (like an H20) and one of a compute-rich, bandwidth-poor type (like an H800), at the
same price per rank, so that neither all-of-one-type cluster of the same budget is best. The five plans:

  planner        `schedule.py`'s plan for the cluster
  swapped        the planner's roles swapped: each machine trains on the ranks it generated on and vice versa
  mixed          one rank of each type per role (the trainer a 2-stage pipeline across the types, one rollout
                 replica of each)
  all-<type>     the planner's plan for the same machines all of one type (the same budget, prices equal)

Each plan is planned and priced with the device profile of this machine (--profile, `schedule.py profile`), whose
constants apply to every emulated type at its fractions (profile_fit.apply_profile, cpu_bench/host.HostSpeeds), and then with
any further --profile of one emulated type, measured under that type's throttle (`schedule.py profile --cluster
<this cluster> --gpu-type <type>`; exp/hetero_cpu.sh takes all three), which replaces that type's constants. Each run is
train.py on the CPU demo's job (exp/configs/cpu_demo.yaml: 16 prompts x 8 samples, eta 4; --max-batch 8 sequences
per replica) for --steps steps,
without evaluations, one torchrun agent per emulated machine (static rendezvous on 127.0.0.1, so node k is the
plan's machine k). The runs go round robin over the plans, --repeats times, each round in a rotated order, so the
machine's drift spreads over every plan.

Measured per plan: the median step_s of every run's steps after the first --skip (warm-up: compilation, the buffer
filling up to eta), and trained tokens / s over the same steps. Predicted: the cost model's step for the plan's
split on the workload the runs had -- their mean prompt and response lengths (inputs, like the paper's profiled
output distribution, not timings); the plans themselves were made with --gen-mean before any run. Writes
<out>/hetero_summary.json (one entry per plan: name, is_planner_plan, predicted_step_s, measured_step_s,
measured_tokens_per_s, and more) and prints the table; exit status 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import schedule  # noqa: E402
from config import load_config  # noqa: E402
from planner import profile_fit, search, specs  # noqa: E402

sys.path.insert(0, str(ROOT / "exp"))
from planner.run_prediction import mean_prompt_tokens, train_passes  # noqa: E402


def workload(cfg, prompt_len: float, gen_mean: float) -> specs.Workload:
    """The CPU demo job's workload as the planner reads it."""
    return specs.Workload(
        prompts_per_step=cfg.train.prompts_per_step,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        prompt_len=prompt_len,
        gen_samples=[gen_mean],
        eta=cfg.staleness.max_staleness,
        precision="fp32",
        ppo_minibatches=cfg.train.ppo_minibatches,
        microbatch_tokens=cfg.train.micro_batch_tokens,
        max_batch=cfg.rollout.max_batch_size,
        kv_recompute=cfg.rollout.interrupt_mode == "recompute",
        train_passes=train_passes(
            {
                "ppo_minibatches": cfg.train.ppo_minibatches,
                "recompute_prox_logprobs": cfg.train.recompute_prox_logprobs,
                "kl_coef": cfg.train.kl_coef,
            }
        ),
    )


def all_of_type(spec: dict, type_name: str) -> dict:
    """The cluster with every machine of `type_name` (same machines, links of that type pair)."""
    out = json.loads(json.dumps(spec))
    out["name"] = f"{spec.get('name', 'cluster')}-all-{type_name}"
    out["gpu_types"] = {type_name: spec["gpu_types"][type_name]}
    for m in out["machines"]:
        m["gpu_type"] = type_name
    pair = f"{type_name}-{type_name}"
    gbps = (spec.get("links", {}).get("inter_gbps") or {}).get(pair)
    out["links"] = {"inter_gbps": {pair: gbps if gbps is not None else 1.0}}
    return out


def planner_for(
    spec: dict, model: specs.ModelSpec, wl: specs.Workload, profiles: list[str], bucket_mb: float
) -> search.Planner:
    """The planner of `spec` priced by the profiles in order: this machine's applies to every emulated type, a
    profile of one emulated type (measured under its throttle) then to that type, where the cluster has it."""
    cluster = specs.cluster_from_dict(spec, "cluster")
    eff = specs.Efficiency()
    for path in profiles:
        prof = profile_fit.load_profile(path)
        if prof.emulated and prof.gpu_type not in cluster.gpu_types:
            continue  # the all-of-one-type clusters lack the other type
        eff = profile_fit.apply_profile(eff, cluster, prof, path)
    return search.Planner(cluster, model, wl, eff, weight_bucket_mb=bucket_mb)


def make_plans(spec: dict, model: specs.ModelSpec, wl: specs.Workload, profiles: list[str], bucket_mb: float) -> dict:
    """{name: (plan JSON, cluster spec)} of the five plans (identical splits keep their own names)."""
    p = planner_for(spec, model, wl, profiles, bucket_mb)
    if len(p.cluster.machines) != 2 or len(p.types) != 2:
        raise SystemExit(f"error: {spec.get('name')}: the experiment needs two machines of two GPU types")
    planned = p.solve()
    gpus = [m.gpus for m in p.cluster.machines]
    swapped = tuple(n - k for n, k in zip(gpus, planned.train_counts))
    mixed = tuple(n // 2 for n in gpus)
    plans = {"planner": (planned, p, spec)}
    for name, counts in (("swapped", swapped), ("mixed", mixed)):
        ev = p.evaluate(counts)
        if not ev.train or not ev.rollout:
            raise SystemExit(f"error: the {name} split {counts} has no feasible plan on {spec.get('name')}")
        plans[name] = (ev, p, spec)
    for t in p.types:
        sub = all_of_type(spec, t)
        q = planner_for(sub, model, wl, profiles, bucket_mb)
        plans[f"all-{t}"] = (q.solve(), q, sub)
    return {name: (schedule.to_plan_json(planner, ev), s) for name, (ev, planner, s) in plans.items()}


def predict(
    plan: dict, spec: dict, model, wl: specs.Workload, profiles: list[str], bucket_mb: float
) -> search.Evaluation:
    """The cost model's evaluation of the plan's split and train layout on workload `wl`."""
    p = planner_for(spec, model, wl, profiles, bucket_mb)
    p.forced_layout = (plan["train"]["dp"], plan["train"]["tp"], plan["train"]["pp"])
    counts = [0] * len(p.cluster.machines)
    for r in plan["ranks"]:
        counts[r["machine"]] += r["role"] == "train"
    return p.evaluate(tuple(counts))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan_path: Path, run_dir: Path, plan: dict, args) -> tuple[bool, float]:
    """train.py on the plan: one torchrun agent per plan machine (its node), static rendezvous. (ok, seconds)."""
    nodes = []
    for r in plan["ranks"]:  # machines in rank order are the plan's nodes (plan.py)
        if not nodes or nodes[-1][0] != r["machine"]:
            nodes.append([r["machine"], 0])
        nodes[-1][1] += 1
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "HEXRL_THREADS": "1",
    }
    overrides = [
        "config=cpu_demo",
        f"model.path={args.model}",
        f"plan.path={plan_path.resolve()}",
        f"train.total_steps={args.steps}",
        "train.max_train_seconds=0",
        "logging.eval_every=0",
        "logging.progress=false",
        "logging.wandb=disabled",
        f"logging.run_dir={run_dir.parent.resolve()}",
        f"logging.run_name={run_dir.name}",
        *args.extra,
    ]
    procs, t0 = [], time.perf_counter()
    for node, (_machine, count) in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", f"--node_rank={node}"]
        cmd += [f"--nproc_per_node={count}", "--master_addr=127.0.0.1", f"--master_port={port}", "--max_restarts=0"]
        log = open(run_dir.parent / f"{run_dir.name}.node{node}.log", "w")
        procs.append((subprocess.Popen([*cmd, "train.py", *overrides], cwd=ROOT, env=env, stdout=log, stderr=log), log))
    ok = True
    for proc, log in procs:
        try:
            ok &= proc.wait(timeout=args.run_timeout) == 0
        except subprocess.TimeoutExpired:
            ok = False
            for q, _ in procs:
                q.kill()
        log.close()
    return ok, time.perf_counter() - t0


def steady(run_dir: Path, skip: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_s" in r][skip:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default=str(ROOT / "exp/clusters/cpu_hetero.yaml"))
    ap.add_argument(
        "--profile",
        action="append",
        help="this machine's device profile (default exp/profiles/cpu.yaml); repeated: then profiles of emulated "
        "types (`schedule.py profile --cluster <it> --gpu-type <type>`, measured under the type's throttle)",
    )
    ap.add_argument("--model", default="exp/tiny-model")
    ap.add_argument("--out", default=None, help="run directory (default runs/hetero_cpu-<time>)")
    ap.add_argument("--steps", type=int, default=12, help="RL steps per run")
    ap.add_argument("--skip", type=int, default=4, help="warm-up steps of each run left out of the medians")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the five plans")
    ap.add_argument("--gen-mean", type=float, default=25.0, help="the response length the plans are made for")
    ap.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="rollout.max_batch_size: sequences a replica decodes at once (the demo's 64 makes the tiny model's "
        "decode compute-bound and the job all training; 8 keeps decode memory-bound, as a long-context RL "
        "rollout's is, so both sides weigh)",
    )
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run counts as failed")
    ap.add_argument("--plans-only", action="store_true", help="plan and predict; run nothing")
    ap.add_argument("--plot", metavar="SUMMARY", help="only draw a finished experiment's figure (beside its summary)")
    ap.add_argument("extra", nargs="*", help="train.py key=value overrides for every run")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_name("hetero.png"))
        return 0
    args.profile = args.profile or [str(ROOT / "exp/profiles/cpu.yaml")]
    if args.steps <= args.skip:
        raise SystemExit(f"error: --steps {args.steps} must exceed --skip {args.skip} (the warm-up left out)")
    out = Path(args.out or ROOT / f"runs/hetero_cpu-{time.strftime('%Y%m%d-%H%M%S')}")
    if (out / "hetero_summary.json").exists():
        raise SystemExit(f"error: {out} already holds an experiment; pick another --out")
    out.mkdir(parents=True, exist_ok=True)

    args.extra = [f"rollout.max_batch_size={args.max_batch}", *args.extra]
    cfg = load_config(["config=cpu_demo", f"model.path={args.model}", *args.extra])
    spec = yaml.safe_load(Path(args.cluster).read_text())
    model = specs.load_model_spec(ROOT / args.model)
    prompt_len = mean_prompt_tokens({"model": {"path": args.model}, "data": vars(cfg.data)})
    bucket_mb = cfg.dist.weight_bucket_mb
    wl = workload(cfg, prompt_len, args.gen_mean)
    plans = make_plans(spec, model, wl, args.profile, bucket_mb)
    for name, (pj, _) in plans.items():
        (out / f"plan_{name}.json").write_text(json.dumps(pj, indent=1))
    names = list(plans)
    print(f"{len(names)} plans on {spec['name']} for {wl.batch} sequences/step, prompt {prompt_len:.1f} + response "
          f"{args.gen_mean:g} tokens, eta {wl.eta} (profiles {args.profile})")  # fmt: skip
    for name, (pj, _) in plans.items():
        print(f"  {name:12s} {describe(pj)}  predicted step {pj['predicted']['step_s']:.2f} s")

    failed = []
    if not args.plans_only:
        for rep in range(args.repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                run_dir = out / "runs" / f"{name}_r{rep}"
                if (run_dir / "metrics.jsonl").exists():
                    continue  # a resumed experiment keeps the runs it has
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                ok, took = launch(out / f"plan_{name}.json", run_dir, plans[name][0], args)
                print(f"  round {rep} {name:12s} {'ok' if ok else 'FAILED'} in {took:.0f} s", flush=True)
                if not ok:
                    failed.append(run_dir.name)

    entries = []
    for name, (pj, sub) in plans.items():
        runs = sorted(d for d in (out / "runs").glob(f"{name}_r*") if (d / "metrics.jsonl").exists())
        per_run = [steady(d, args.skip) for d in runs]
        rows = [r for run_rows in per_run for r in run_rows]
        entry = {"name": name, "is_planner_plan": name == "planner", "split": describe(pj)}
        entry["planned_step_s"] = pj["predicted"]["step_s"]
        if rows:
            gen = statistics.fmean(r["response_len_mean"] for r in rows)
            ev = predict(pj, sub, model, workload(cfg, prompt_len, gen), args.profile, bucket_mb)
            entry |= {
                "runs": len(runs),
                "steps": len(rows),
                "response_len_mean": gen,
                "predicted_step_s": ev.step_s,
                "predicted": {
                    "rollout_s": ev.rollout_s,
                    "train_s": ev.train_s,
                    "sync_s": ev.sync_s,
                    "decode_contention": ev.host_pricing.get("decode_contention", {}),
                },
                "measured_step_s": statistics.median(r["step_s"] for r in rows),
                "measured_step_s_per_run": [statistics.median(r["step_s"] for r in rr) for rr in per_run if rr],
                "measured": {
                    "train_s": statistics.median(r["train_s"] for r in rows),
                    "sync_s": statistics.median(r["weight_sync_s"] for r in rows),
                    "rollout_idle_frac": statistics.fmean(r["rollout_idle_frac"] for r in rows),
                    "trainer_idle_frac": statistics.fmean(r["trainer_idle_frac"] for r in rows),
                },
                "measured_tokens_per_s": sum(r["trained_tokens"] for r in rows) / sum(r["step_s"] for r in rows),
                "generation": generation(per_run, len(pj["rollout"]["replicas"]), ev, sub),
                "emulated": rows[0].get("emulated"),
            }
            entry["error"] = (entry["predicted_step_s"] - entry["measured_step_s"]) / entry["measured_step_s"]
        else:
            entry["predicted_step_s"] = pj["predicted"]["step_s"]
        entries.append(entry)
    summary = {
        "cluster": spec,
        "profiles": args.profile,
        "workload": wl.to_dict(),
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "failed_runs": failed,
        "plans": entries,
    }
    measured = [e for e in entries if "measured_step_s" in e]
    if measured:
        fastest = min(measured, key=lambda e: e["measured_step_s"])
        by_pred = sorted(measured, key=lambda e: e["predicted_step_s"])
        by_meas = sorted(measured, key=lambda e: e["measured_step_s"])
        summary |= {
            "fastest_measured": fastest["name"],
            "planner_fastest": fastest["is_planner_plan"],
            "rankings_agree": [e["name"] for e in by_pred] == [e["name"] for e in by_meas],
            "max_abs_error": max(abs(e["error"]) for e in measured),
        }
    (out / "hetero_summary.json").write_text(json.dumps(summary, indent=1))
    print(format_table(summary))
    print(f"wrote {out / 'hetero_summary.json'}")
    if not failed and not args.plans_only:
        plot(summary, out / "hetero.png")
    return 1 if failed else 0


def generation(per_run: list[list[dict]], replicas: int, ev: search.Evaluation, spec: dict) -> dict:
    """Where a replica's generation time goes, per RL step over the steady steps (the rollout counters' growth
    from each run's first steady step to its last, averaged over the runs): its wall seconds in generator steps,
    their CPU seconds, the throttle's padding, and the rest -- waits for a core the padding did not absorb -- with
    the wall and CPU seconds of one generator step beside the model's (its decode round at the replica's batch;
    times the decode speed it was priced at: the CPU work the throttle pads to the round). A prefill
    rides in some generator steps; the model prices it apart. {} for runs without the counters."""
    spans = [(rr[0], rr[-1]) for rr in per_run if len(rr) > 1 and "rollout_generate_cpu_s" in rr[-1]]
    if not spans:
        return {}

    def per_step(key: str) -> float:
        return statistics.fmean((b[key] - a[key]) / (b["step"] - a["step"]) for a, b in spans) / replicas

    wall, cpu, pad, steps = (per_step(k) for k in ("rollout_generate_s", "rollout_generate_cpu_s",
                                                    "rollout_throttle_s", "rollout_generate_steps"))  # fmt: skip
    speeds = specs.cluster_from_dict(spec, "cluster").speeds.with_busy_devices(
        ev.host_pricing.get("busy_devices", {}), ev.host_pricing.get("decode_contention", {})
    )
    rounds = [replica.cost.round_s for replica, _ in ev.rollout.replicas]
    # the round's CPU work: the round at the speed it was priced at (HostSpeeds.decode_speed: the bandwidth fraction,
    # less the decode contention, which is wall time)
    priced = [replica.cost.round_s * speeds.decode_speed(replica.gpu_type) for replica, _ in ev.rollout.replicas]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "throttle_s": pad,
        "wait_s": wall - cpu - pad,
        "generator_steps": steps,
        "wall_per_step_s": wall / steps if steps else math.nan,
        "priced_wall_per_step_s": statistics.fmean(rounds) if rounds else math.nan,
        "cpu_per_step_s": cpu / steps if steps else math.nan,
        "priced_cpu_per_step_s": statistics.fmean(priced) if priced else math.nan,
    }


def describe(pj: dict) -> str:
    """Where the roles run: 'train 2xh800ish (dp1 tp2 pp1) | rollout 2xh20ish'."""

    def count(role: str) -> str:
        types = sorted(r["gpu_type"] for r in pj["ranks"] if r["role"] == role)
        return "+".join(f"{types.count(t)}x{t}" for t in sorted(set(types)))

    t = pj["train"]
    return f"train {count('train')} (dp{t['dp']} tp{t['tp']} pp{t['pp']}) | rollout {count('rollout')}"


def plot(summary: dict, out: Path) -> None:
    """The figure: predicted and measured step time per plan (each run's median as a dot), and measured trained
    tokens / s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [p for p in summary["plans"] if "measured_step_s" in p]
    if not plans:
        raise SystemExit("error: the summary has no measured plan (the runs did not finish)")
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
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def format_table(summary: dict) -> str:
    head = f"{'plan':12s} {'split':52s} {'predicted s':>11s} {'measured s':>10s} {'error':>7s} {'tokens/s':>9s}"
    lines = [head, "-" * len(head)]
    for e in summary["plans"]:
        if "measured_step_s" not in e:
            lines.append(f"{e['name']:12s} {e['split']:52s} {e['predicted_step_s']:11.2f} {'-':>10s}")
            continue
        star = " *" if e["name"] == summary.get("fastest_measured") else ""
        lines.append(
            f"{e['name']:12s} {e['split']:52s} {e['predicted_step_s']:11.2f} {e['measured_step_s']:10.2f} "
            f"{e['error'] * 100:+6.1f}% {e['measured_tokens_per_s']:9.0f}{star}"
        )
    if "fastest_measured" in summary:
        lines.append(
            f"fastest measured: {summary['fastest_measured']} (* ; the planner's plan "
            f"{'is' if summary['planner_fastest'] else 'is NOT'} the fastest); predicted and measured rankings "
            f"{'agree' if summary['rankings_agree'] else 'DISAGREE'}; largest |error| "
            f"{summary['max_abs_error'] * 100:.1f}%"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
