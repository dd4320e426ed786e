"""AReaL-Hex planner: split a heterogeneous cluster into trainer and rollout GPUs and plan both sides.

    python schedule.py --cluster exp/clusters/hetero_56.yaml --model deepseek-r1-distill-qwen-7b --out plan.json --plot
    python schedule.py --cluster exp/clusters/cpu.yaml --model exp/tiny-model --nproc 4 --out plan.json
    python schedule.py calibrate --plan plan.json --rollout-s 145 --train-s 95 --sync-s 4.75 --out eff.yaml
    python schedule.py profile --cluster exp/clusters/cpu.yaml --gpu-type cpu --nominal measured --out exp/profiles/cpu.yaml
    python schedule.py --cluster exp/clusters/cpu.yaml --model exp/tiny-model --nproc 4 --profile exp/profiles/cpu.yaml

The story, top to bottom (paper Algorithm 1; the inputs are planner/specs.py, the search planner/search.py, every
time and memory formula planner/cost_model.py):
  plan          the whole cluster, or each whole-machine sub-cluster under --budget / --min-tokens-per-s, solved by
                Planner.solve: phase 1a the trainer's DP x TP x PP layout, phase 1b the rollout replicas (a MILP on
                CBC), phase 2 the split of the GPUs between them (a networkx partition bisected until the train and
                rollout sides take as long, then local moves); a topology-blind split is one more candidate
  to_plan_json  the rank map train.py reads, and planner_from_plan reads it back; format_table / plot_plan show it
  main          the CLI: a plan (the default), `calibrate` (planner/calibration.py) and `profile` (this machine's
                device, planner/device_profile.py, fitted by planner/profile_fit.py: the only torch the planner runs)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict

from parallel import sync_layout
from plan import PlanError
from planner import calibration, cost_model, profile_fit, specs
from planner.calibration import calibrate
from planner.search import Evaluation, Planner, check_rollout_tp, machine_kinds
from planner.specs import Cluster, Efficiency, ModelSpec, Workload

# ----------------------------------------------------------------------------- objectives over sub-clusters


def sub_clusters(cluster: Cluster) -> list[tuple[float, Cluster]]:
    """Every choice of how many whole machines of each kind to rent, as ($/h, sub-cluster)."""
    kinds = machine_kinds(cluster)
    out = []
    for use in itertools.product(*[range(len(k) + 1) for k in kinds]):
        keep = {i: 0 for k, n in zip(kinds, use) for i in k[n:]}
        sub = cluster.subset(keep) if len(keep) < len(cluster.machines) else None
        if sub is not None:
            out.append((sub.dollars_per_hour(), sub))
    return sorted(out, key=lambda cs: cs[0])


def plan(
    cluster: Cluster,
    model: ModelSpec,
    wl: Workload,
    eff: Efficiency | None = None,
    *,
    budget: float | None = None,
    min_tokens_per_s: float | None = None,
    exhaustive: bool = False,
    train_layout: tuple[int, int, int] | None = None,
    rollout_tp: int | None = None,
    weight_bucket_mb: float = 64.0,
    max_seconds: float = 10.0,
    topology_aware: bool = True,
) -> dict:
    """The planner's entry point: best plan as the plan-JSON dict. budget: max throughput among whole-machine
    sub-clusters costing <= budget $/h; min_tokens_per_s: cheapest sub-cluster reaching that throughput.
    rollout_tp: every rollout replica has this TP degree (checked against the model and the whole cluster here,
    so a sub-cluster search does not hide the reason)."""
    eff = eff or Efficiency()
    t0 = time.perf_counter()
    if rollout_tp is not None:
        check_rollout_tp(cluster, model, rollout_tp)

    def run(c: Cluster) -> tuple[Planner, Evaluation]:
        p = Planner(c, model, wl, eff, max_seconds, train_layout, rollout_tp, weight_bucket_mb)
        if exhaustive:
            return p, p.exhaustive()
        if not c.machine_gbps:
            return p, p.solve()
        # the topology-blind plan: where the trainers go, chosen as if every machine pair had its type pair's
        # link; its layouts are then re-planned and the plan priced on the real links. Without --topology-blind
        # it is one more candidate, so reading the links never loses to ignoring them.
        blind = Planner(c.with_uniform_links(), model, wl, eff, max_seconds, train_layout, rollout_tp, weight_bucket_mb)
        blind_ev = p.evaluate(blind.solve().train_counts)
        if not topology_aware:
            return p, blind_ev
        ev = p.solve()
        return p, (blind_ev if blind_ev.step_s < ev.step_s * (1 - 1e-9) else ev)

    if budget is None and min_tokens_per_s is None:
        p, ev = run(cluster)
    else:
        options = sub_clusters(cluster)
        feasible_cost = None
        chosen = None
        for cost, sub in options:
            if budget is not None and cost > budget + 1e-9:
                break
            try:
                p, ev = run(sub)
            except PlanError:
                continue
            feasible_cost = cost if feasible_cost is None else feasible_cost
            if min_tokens_per_s is not None:
                if ev.tokens_per_s >= min_tokens_per_s:
                    chosen = (p, ev)
                    break
            elif chosen is None or ev.tokens_per_s > chosen[1].tokens_per_s:
                chosen = (p, ev)
        if chosen is None:
            cheapest = options[0][0] if options else cluster.dollars_per_hour()
            if min_tokens_per_s is not None:
                raise PlanError(
                    f"throughput: no sub-cluster reaches {min_tokens_per_s:.0f} tokens/s"
                    + (f" within ${budget:.2f}/h" if budget is not None else "")
                )
            raise PlanError(
                f"budget: ${budget:.2f}/h is below the cheapest feasible plan "
                f"(cheapest sub-cluster ${cheapest:.2f}/h, first feasible "
                f"{'none' if feasible_cost is None else f'${feasible_cost:.2f}/h'})"
            )
        p, ev = chosen
    out = to_plan_json(p, ev)
    out["solver"]["seconds"] = time.perf_counter() - t0
    return out


# ----------------------------------------------------------------------------- plan JSON, table, picture


def to_plan_json(p: Planner, ev: Evaluation) -> dict:
    c = p.cluster
    # global rank order: machines holding stage 0 first ... rollout-only machines last; in a machine, trainers first
    train_ids = [i for _, _, ids in ev.train.stages for i in ids]
    stage_of = {i: k for k, (_, _, ids) in enumerate(ev.train.stages) for i in ids}
    first_stage = {}
    for i in train_ids:
        first_stage.setdefault(p.gpu_machine[i], stage_of[i])
    machine_order = sorted(range(len(c.machines)), key=lambda m: (first_stage.get(m, 10**9), m))
    train_set = set(train_ids)
    order = []
    for m in machine_order:
        ids = list(range(p.first[m], p.first[m] + c.machines[m].gpus))
        pos = {i: n for n, i in enumerate(train_ids)}
        order += sorted((i for i in ids if i in train_set), key=pos.get) + [i for i in ids if i not in train_set]
    rank_of = {gid: r for r, gid in enumerate(order)}
    tr = ev.train
    ranks = [None] * len(order)
    replica_of = {i: n for n, (_, ids) in enumerate(ev.rollout.replicas) for i in ids}
    stages_json, layer_start = [], 0
    for k, (t, layers, ids) in enumerate(tr.stages):
        stages_json.append(
            {
                "pp": k,
                "gpu_type": t,
                "layers": [layer_start, layer_start + layers],
                "ranks": sorted(rank_of[i] for i in ids),
            }
        )
        for j, i in enumerate(ids):
            ranks[rank_of[i]] = {
                "rank": rank_of[i],
                "gpu_type": t,
                "machine": p.gpu_machine[i],
                "role": "train",
                "dp": j // tr.tp,
                "tp": j % tr.tp,
                "pp": k,
                "layers": [layer_start, layer_start + layers],
            }
        layer_start += layers
    for gid, r in rank_of.items():
        if ranks[r] is None:
            m = p.gpu_machine[gid]
            ranks[r] = {
                "rank": r,
                "gpu_type": c.machines[m].gpu_type,
                "machine": m,
                "role": "rollout",
                "replica": replica_of.get(gid),
            }
            if gid not in replica_of:
                ranks[r]["idle"] = True  # no replica config fits the leftover GPUs
    total = ev.rollout.tokens_per_s
    replicas = [
        {
            "id": n,
            "gpu_type": cfg.gpu_type,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "ranks": [rank_of[i] for i in ids],
            "share": cfg.cost.tokens_per_s / total,
            "batch": cfg.cost.batch,
            "tokens_per_s": cfg.cost.tokens_per_s,
            "round_s": cfg.cost.round_s,
        }
        for n, (cfg, ids) in enumerate(ev.rollout.replicas)
    ]
    dollars = c.dollars_per_hour()
    pred = {
        "rollout_s": ev.rollout_s,
        "train_s": ev.train_s,
        "sync_s": ev.sync_s,
        "sync_send_s": ev.train_sync_s,
        "sync_bytes": sync_layout.sync_bytes_sent(p.sync_buckets(tr), len(p.rollout_machines(ev.rollout))),
        "reward_s": p.wl.reward_s,
        "step_s": ev.step_s,
        "tokens_per_s": ev.tokens_per_s,
        # a CPU host standing in for the cluster: what its pricing settled at (cpu_bench/host.HostSpeeds.settle:
        # machine -> role -> devices busy at once; GPU type -> its replicas' decode contention)
        **json.loads(json.dumps(ev.host_pricing)),
        "dollars_per_hour": dollars,
        "tokens_per_dollar": ev.tokens_per_s * 3600 / dollars if dollars > 0 else None,
    }
    return {
        "world_size": len(order),
        "ranks": ranks,
        "rollout": {"replicas": replicas, "tokens_per_s": total},
        "train": {
            "dp": tr.dp,
            "tp": tr.tp,
            "pp": tr.pp,
            "stages": stages_json,
            "tokens_per_s": cost_model.train_tokens_per_s(p.wl, ev.train_s),
        },
        "predicted": pred,
        "solver": {
            "seconds": p.stats.seconds,
            "iterations": p.stats.iterations,
            "status": p.stats.status,
            "evaluations": p.stats.evaluations,
            "milp_solves": p.stats.milp_solves,
        },
        "inputs": {
            "cluster": c.to_dict(),
            "model": p.model.to_config(),
            "workload": p.wl.to_dict(),
            "efficiency": p.eff.to_dict(),
            "weight_bucket_mb": p.weight_bucket_mb,
            **({"rollout_tp": p.rollout_tp} if p.rollout_tp is not None else {}),
        },
    }


def planner_from_plan(pj: dict) -> tuple[Planner, tuple[int, ...]]:
    """Rebuild the Planner and per-machine trainer counts a plan JSON was made from (inputs are embedded)."""
    inp = pj["inputs"]
    cluster = specs.cluster_from_dict(inp["cluster"], "plan.inputs.cluster")
    p = Planner(
        cluster,
        specs.model_from_config(inp["model"]),
        Workload(**inp["workload"]),
        Efficiency.from_dict(inp["efficiency"]),
        rollout_tp=inp.get("rollout_tp"),
        weight_bucket_mb=inp.get("weight_bucket_mb", 64.0),
    )
    counts = [0] * len(cluster.machines)
    for r in pj["ranks"]:
        counts[r["machine"]] += r["role"] == "train"
    return p, tuple(counts)


def format_table(plan_json: dict) -> str:
    lines = [f"{'rank':>4} {'machine':>7} {'type':>6} {'role':>7}  {'where':<24} {'layers':>9}"]
    for r in plan_json["ranks"]:
        if r["role"] == "train":
            where, layers = f"stage {r['pp']} dp {r['dp']} tp {r['tp']}", f"[{r['layers'][0]},{r['layers'][1]})"
        else:
            rep = r["replica"]
            if rep is None:
                where, layers = "idle", ""
            else:
                spec = plan_json["rollout"]["replicas"][rep]
                where, layers = f"replica {rep} (tp{spec['tp']} pp{spec['pp']})", ""
        lines.append(f"{r['rank']:>4} {r['machine']:>7} {r['gpu_type']:>6} {r['role']:>7}  {where:<24} {layers:>9}")
    pr, tr = plan_json["predicted"], plan_json["train"]
    tpd = pr["tokens_per_dollar"]
    lines += [
        f"train: dp {tr['dp']} tp {tr['tp']} pp {tr['pp']}; rollout: {len(plan_json['rollout']['replicas'])} replicas",
        f"predicted: rollout {pr['rollout_s']:.2f} s | train {pr['train_s']:.2f} s | sync {pr['sync_s']:.2f} s | "
        f"reward {pr['reward_s']:.2f} s | step {pr['step_s']:.2f} s",
        f"           {pr['tokens_per_s']:.1f} tokens/s | ${pr['dollars_per_hour']:.2f}/h | "
        + (f"{tpd:.0f} tokens/$" if tpd is not None else "free"),
        f"solver: {plan_json['solver']['seconds']:.2f} s, {plan_json['solver']['iterations']} iterations, "
        f"{plan_json['solver']['status']}",
    ]
    return "\n".join(lines)


def plot_plan(plan_json: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    machines = sorted({r["machine"] for r in plan_json["ranks"]})
    width = max(sum(1 for r in plan_json["ranks"] if r["machine"] == m) for m in machines)
    fig, ax = plt.subplots(figsize=(1 + 0.9 * width, 0.8 + 0.6 * len(machines)))
    cmap = plt.get_cmap("tab20")
    col = {}
    for row, m in enumerate(machines):
        for x, r in enumerate(sorted((r for r in plan_json["ranks"] if r["machine"] == m), key=lambda r: r["rank"])):
            if r["role"] == "train":
                color, label = "#c0392b", f"S{r['pp']}\nd{r['dp']}t{r['tp']}"
            else:
                rep = r["replica"]
                palette = [i for i in range(20) if i not in (14, 15)]  # skip tab20's greys (idle is grey)
                color = "#dddddd" if rep is None else col.setdefault(rep, cmap(palette[(2 * rep + 1) % 18]))
                label = "idle" if rep is None else f"R{rep}"
            ax.add_patch(plt.Rectangle((x, -row), 0.92, 0.85, color=color))
            ax.text(x + 0.46, -row + 0.42, f"{label}\n#{r['rank']}", ha="center", va="center", fontsize=6)
        mtype = next(r["gpu_type"] for r in plan_json["ranks"] if r["machine"] == m)
        ax.text(-0.1, -row + 0.42, f"m{m} {mtype}", ha="right", va="center", fontsize=7)
    ax.set_xlim(-1.5, width)
    ax.set_ylim(-len(machines) + 0.8, 1)
    ax.axis("off")
    pr = plan_json["predicted"]
    ax.set_title(
        f"step {pr['step_s']:.1f} s, {pr['tokens_per_s']:.0f} tok/s, ${pr['dollars_per_hour']:.2f}/h", fontsize=9
    )
    ax.legend(
        handles=[Patch(color="#c0392b", label="train (stage, dp, tp)"), Patch(color=cmap(1), label="rollout replica")],
        loc="upper center",
        fontsize=7,
        ncol=2,
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def workload_args(ap: argparse.ArgumentParser) -> None:
    d = Workload()
    ap.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per RL step")
    ap.add_argument("--samples", type=int, default=d.samples_per_prompt, help="samples per prompt")
    ap.add_argument("--prompt-len", type=float, default=d.prompt_len)
    ap.add_argument("--gen-mean", type=float, default=d.gen_samples[0], help="mean generation length")
    ap.add_argument("--gen-quantiles", default="", help="e.g. 0.5:700,0.9:3000,0.99:8000")
    ap.add_argument("--eta", type=int, default=d.eta, help="staleness bound")
    ap.add_argument("--precision", default=d.precision, choices=sorted(specs.PRECISION_BYTES))
    ap.add_argument("--reward-s", type=float, default=d.reward_s, help="profiled reward seconds per step")
    ap.add_argument("--max-batch", type=int, default=d.max_batch, help="max concurrent sequences per replica")
    ap.add_argument("--microbatch-tokens", type=int, default=d.microbatch_tokens)
    ap.add_argument("--ppo-minibatches", type=int, default=d.ppo_minibatches)
    ap.add_argument(
        "--train-passes",
        type=float,
        default=d.train_passes,
        help="forward-pass equivalents per trained token: 4 (forward, backward, the proximal log-prob recompute), "
        "3 when the run skips the recompute (ppo_minibatches 1 reads pi_prox off the training forward)",
    )
    ap.add_argument(
        "--interrupt-mode",
        default="recompute",
        choices=("recompute", "keep"),
        help="the run's rollout.interrupt_mode: recompute re-prefills the running sequences at each weight update",
    )


def workload_from(a: argparse.Namespace) -> Workload:
    qs = {}
    for part in filter(None, a.gen_quantiles.split(",")):
        try:
            q, v = part.split(":")
            qs[float(q)] = float(v)
        except ValueError:
            raise PlanError(f"--gen-quantiles: '{part}' is not q:length") from None
    return Workload.from_quantiles(
        a.gen_mean,
        qs,
        prompts_per_step=a.prompts,
        samples_per_prompt=a.samples,
        prompt_len=a.prompt_len,
        eta=a.eta,
        precision=a.precision,
        reward_s=a.reward_s,
        max_batch=a.max_batch,
        microbatch_tokens=a.microbatch_tokens,
        ppo_minibatches=a.ppo_minibatches,
        train_passes=a.train_passes,
        kv_recompute=a.interrupt_mode == "recompute",
    )


def parse_layout(text: str | None) -> tuple[int, int, int] | None:
    if not text:
        return None
    try:
        dp, tp, pp = (int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"--train-layout must be dp,tp,pp (three integers), got {text!r}") from None
    if min(dp, tp, pp) < 1:
        raise PlanError(f"--train-layout degrees must be >= 1, got {text!r}")
    return dp, tp, pp


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["calibrate"]:
            return calibrate_main(argv[1:])
        if argv[:1] == ["profile"]:
            return profile_main(argv[1:])
        return plan_main(argv)
    except (PlanError, specs.SpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def plan_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="AReaL-Hex planner: trainer/rollout split and parallel plans.")
    ap.add_argument("--cluster", required=True, help="cluster YAML (exp/clusters/*.yaml) or its name")
    ap.add_argument("--model", required=True, help="HF config.json, its directory, or a name in exp/models/")
    ap.add_argument("--gpus", "--nproc", dest="nproc", type=int, default=None, help="resize a one-machine cluster")
    workload_args(ap)
    ap.add_argument("--efficiency", default=None, help="efficiency YAML from `schedule.py calibrate`")
    ap.add_argument(
        "--profile", action="append", default=[], help="device profile YAML from `schedule.py profile` (repeatable)"
    )
    ap.add_argument("--budget", type=float, default=None, help="max $/hour: best whole-machine sub-cluster")
    ap.add_argument("--min-tokens-per-s", type=float, default=None, help="cheapest sub-cluster reaching this")
    ap.add_argument("--train-layout", default=None, help="force the trainer layout dp,tp,pp")
    ap.add_argument("--rollout-tp", type=int, default=None, help="force TP degree K for every rollout replica")
    ap.add_argument("--weight-bucket-mb", type=float, default=64.0, help="the run's dist.weight_bucket_mb")
    ap.add_argument("--exhaustive", action="store_true", help="brute force the same space (small clusters)")
    ap.add_argument(
        "--topology-blind", action="store_true", help="place trainers largest machine first, ignoring links (baseline)"
    )
    ap.add_argument("--max-seconds", type=float, default=10.0, help="time limit of every MILP solve")
    ap.add_argument("--out", default=None, help="plan JSON path")
    ap.add_argument("--plot", nargs="?", const="", default=None, help="PNG path (default: next to --out)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    cluster = specs.load_cluster(a.cluster, a.nproc)
    if a.exhaustive and cluster.n_gpus > 16:
        raise PlanError(f"--exhaustive is for small clusters (<= 16 GPUs), this one has {cluster.n_gpus}")
    eff = Efficiency.load(a.efficiency)
    for path in a.profile:  # a profile sets its GPU type's efficiencies and decode overhead
        eff = profile_fit.apply_profile(eff, cluster, profile_fit.load_profile(path), path)
    result = plan(
        cluster,
        specs.load_model_spec(a.model),
        workload_from(a),
        eff,
        budget=a.budget,
        min_tokens_per_s=a.min_tokens_per_s,
        exhaustive=a.exhaustive,
        train_layout=parse_layout(a.train_layout),
        rollout_tp=a.rollout_tp,
        weight_bucket_mb=a.weight_bucket_mb,
        max_seconds=a.max_seconds,
        topology_aware=not a.topology_blind,
    )
    if not a.quiet:
        print(format_table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot is not None:
        path = a.plot or ((a.out[:-5] if a.out and a.out.endswith(".json") else (a.out or "plan")) + ".png")
        plot_plan(result, path)
        print(f"wrote {path}")
    return 0


def calibrate_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Fit efficiency constants to one measured plan (or profile the CPU).")
    ap.add_argument("--plan", help="plan JSON whose run was measured")
    ap.add_argument("--rollout-s", type=float)
    ap.add_argument("--train-s", type=float)
    ap.add_argument("--sync-s", type=float)
    ap.add_argument("--profile-cpu", action="store_true", help="numpy matmul/memcpy profile (< 2 s)")
    ap.add_argument("--out", required=True, help="efficiency YAML to write")
    a = ap.parse_args(argv)
    import yaml

    if a.profile_cpu:
        prof = calibration.profile_cpu()
        print(f"cpu profile: {prof['tflops'] * 1e3:.1f} GFLOP/s, {prof['hbm_tbps'] * 1e3:.1f} GB/s")
        eff = Efficiency(
            per_type={
                "cpu": specs.TypeEfficiency(
                    mfu_train=min(1.0, prof["tflops"] / 0.02 * 0.5),
                    mfu_infer=min(1.0, prof["tflops"] / 0.02 * 0.5),
                    hbm_eff=min(1.0, prof["hbm_tbps"] / 0.005),
                )
            }
        )
    else:
        if not a.plan:
            raise PlanError("calibrate needs --plan (and measured --rollout-s/--train-s/--sync-s) or --profile-cpu")
        with open(a.plan) as f:
            pj = json.load(f)
        meas = {k: v for k, v in (("rollout_s", a.rollout_s), ("train_s", a.train_s), ("sync_s", a.sync_s)) if v}
        if not meas:
            raise PlanError("calibrate: give at least one of --rollout-s, --train-s, --sync-s")
        p, counts = planner_from_plan(pj)
        eff = calibrate([(p, counts, meas)], p.eff)
    with open(a.out, "w") as f:
        yaml.safe_dump(eff.to_dict(), f, sort_keys=False)
    print(f"wrote {a.out}: {json.dumps(eff.to_dict())}")
    return 0


def profile_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description="Profile this machine's device (CUDA if present, else one CPU core) with torch and the runtime's "
        "own code, and write a device profile: the cost model's efficiencies of a cluster GPU type."
    )
    ap.add_argument("--cluster", default="exp/clusters/cpu.yaml", help="cluster YAML holding --gpu-type")
    ap.add_argument("--gpu-type", default=None, help="the type whose nominal numbers the fractions are of")
    ap.add_argument("--seconds", type=float, default=120.0, help="budget of the timed loops (total < 3 min)")
    ap.add_argument("--out", default=None, help="profile YAML (default exp/profiles/<gpu type>.yaml)")
    ap.add_argument(
        "--nominal",
        choices=("type", "measured"),
        default="type",
        help="fractions of --gpu-type's tflops / hbm_tbps, or of the fastest FLOP rate and bandwidth this device "
        "showed (GEMM / copy points or fits; for a device with no trusted peak, e.g. a CPU core; the planner "
        "rescales them to the cluster's numbers)",
    )
    ap.add_argument(
        "--co-load",
        type=int,
        default=0,
        metavar="N",
        help="(CPU) measure decode and prefill beside N peer processes, each a rollout replica decoding under the "
        "type's throttle: the other ranks a run puts on this host (a rank's steps cost more CPU beside them)",
    )
    ap.add_argument(
        "--co-load-trainers",
        type=int,
        default=0,
        metavar="K",
        help="(CPU) K of the --co-load peers train instead (Trainer steps of the CPU runs' shape under the type's "
        "throttle): a run's other ranks are trainers as well as rollout replicas",
    )
    ap.add_argument(
        "--refit",
        default=None,
        metavar="PROFILE",
        help="measure nothing: fit PROFILE's stored points again with this version's fit (profile_fit.finish_profile) "
        "and write the result to --out",
    )
    a = ap.parse_args(argv)
    if a.refit:
        return refit_profile(a.refit, a.out)
    cluster = specs.load_cluster(a.cluster)
    gpu_type = a.gpu_type or (next(iter(cluster.gpu_types)) if len(cluster.gpu_types) == 1 else None)
    if gpu_type not in cluster.gpu_types:
        raise specs.SpecError(
            f"--gpu-type {a.gpu_type!r}: give one of cluster {cluster.name}'s GPU types {sorted(cluster.gpu_types)}"
        )
    if a.seconds <= 0:
        raise PlanError(f"--seconds must be > 0, got {a.seconds}")
    if a.co_load < 0:
        raise PlanError(f"--co-load must be >= 0 peer processes, got {a.co_load}")
    if not 0 <= a.co_load_trainers <= a.co_load:
        raise PlanError(f"--co-load-trainers must be 0 to --co-load ({a.co_load}), got {a.co_load_trainers}")
    out = a.out or str(specs.ROOT / "exp" / "profiles" / f"{gpu_type}.yaml")
    from cpu_bench.emulation import Throttle
    from planner.device_profile import profile_device

    # an emulated type is profiled as its ranks run: every Generator step padded by its throttle
    emulation = cluster.speeds.emulated.get(gpu_type)
    throttle = None if emulation is None else Throttle(emulation, gpu_type)
    if throttle is not None:
        print(f"profiling emulated type {gpu_type} under its throttle ({asdict(emulation)})")
    # with co-load trainers: its decode step again beside each emulated type's trainers, which a plan may put
    # beside its rollout ranks (TypeEfficiency.decode_beside); its own type's first
    beside = None
    if throttle is not None and a.co_load_trainers:
        emulated = [gpu_type] + sorted(t for t in cluster.speeds.emulated if t != gpu_type)
        beside = {t: Throttle(cluster.speeds.emulated[t], t) for t in emulated}
    prof = profile_device(
        cluster.gpu(gpu_type),
        a.seconds,
        nominal=a.nominal,
        throttle=throttle,
        co_load=a.co_load,
        co_load_trainers=a.co_load_trainers,
        beside=beside,
    )
    doc = {"device": prof.pop("device"), "gpu_type": gpu_type, "cluster": a.cluster}
    if throttle is not None:
        doc["emulate"] = asdict(emulation)
        doc["throttle_slept_s"] = dict(throttle.slept_s)
    for key in ("efficiency", "sync", "measured", "nominal", "fractions", "dtype", "seconds", "co_load"):
        if key in prof:
            doc[key] = prof.pop(key)
    doc["points"] = prof  # the raw measurements the constants were fitted to
    return write_profile(doc, out)


def write_profile(doc: dict, out: str) -> int:
    import yaml

    profile_fit.profile_from_dict(doc, out)  # what the planner will read back
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        yaml.safe_dump(json.loads(json.dumps(doc)), f, sort_keys=False)
    print(f"wrote {out} ({doc['seconds']:.0f} s): {json.dumps(doc['efficiency'])}")
    return 0


def refit_profile(path: str, out: str | None) -> int:
    """`schedule.py profile --refit P --out Q`: P's stored points fitted again (a profile keeps them for this), so
    that a profile taken before a change of the fit is read as the current code would have read it."""
    import yaml

    if not out:
        raise specs.SpecError("--refit needs --out (the refitted profile; the measured one is kept as it is)")
    profile_fit.load_profile(path)  # a readable profile, or one clear error
    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc.get("points"), dict) or not doc["points"].get("decode"):
        raise specs.SpecError(f"{path}: no stored points to refit (schedule.py profile writes them under 'points')")
    nominal = doc["nominal"]
    gpu = specs.GPUType(
        str(nominal.get("gpu_type", doc["gpu_type"])), 0, float(nominal["tflops"]), float(nominal["hbm_tbps"]), 0, 0
    )
    fitted = profile_fit.finish_profile(
        {"device": doc["device"], **doc["points"]}, gpu, elapsed=doc.get("seconds", 0.0)
    )
    for key in ("efficiency", "sync", "measured", "fractions"):
        if key in fitted:
            doc[key] = fitted[key]
    doc["refitted_from"] = str(path)
    return write_profile(doc, out)


if __name__ == "__main__":
    sys.exit(main())
