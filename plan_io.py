"""The planner's outputs and inputs from measurements: plan JSON (the rank map train.py reads), the printed
table, the PNG picture of who does what, and `calibrate`, which fits the cost model's efficiency constants to
measured step timings. Kept apart from schedule.py, which is the planner's algorithm and its CLI.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import cost_model as cm
from cost_model import Efficiency

if TYPE_CHECKING:   # no runtime import: schedule.py imports this module
    from schedule import Evaluation, Planner

# ----------------------------------------------------------------------------- plan JSON, table, picture

def to_plan_json(p: Planner, ev: Evaluation) -> dict:
    c = p.cluster
    # global rank order: machines holding stage 0 first ... rollout-only machines last; in a machine, trainers first
    train_ids = [i for _, _, ids in ev.train.stages for i in ids]
    stage_of = {i: k for k, (_, _, ids) in enumerate(ev.train.stages) for i in ids}
    first_stage = {}
    for i in train_ids:
        first_stage.setdefault(p.gpu_machine[i], stage_of[i])
    machine_order = sorted(range(len(c.machines)), key=lambda m: (first_stage.get(m, 10 ** 9), m))
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
        stages_json.append({"pp": k, "gpu_type": t, "layers": [layer_start, layer_start + layers],
                            "ranks": sorted(rank_of[i] for i in ids)})
        for j, i in enumerate(ids):
            ranks[rank_of[i]] = {"rank": rank_of[i], "gpu_type": t, "machine": p.gpu_machine[i], "role": "train",
                                 "dp": j // tr.tp, "tp": j % tr.tp, "pp": k, "layers": [layer_start, layer_start + layers]}
        layer_start += layers
    for gid, r in rank_of.items():
        if ranks[r] is None:
            m = p.gpu_machine[gid]
            ranks[r] = {"rank": r, "gpu_type": c.machines[m].gpu_type, "machine": m, "role": "rollout",
                        "replica": replica_of.get(gid)}
            if gid not in replica_of:
                ranks[r]["idle"] = True        # no replica config fits the leftover GPUs
    total = ev.rollout.tokens_per_s
    replicas = [{"id": n, "gpu_type": cfg.gpu_type, "tp": cfg.tp, "pp": cfg.pp, "ranks": [rank_of[i] for i in ids],
                 "share": cfg.cost.tokens_per_s / total, "batch": cfg.cost.batch,
                 "tokens_per_s": cfg.cost.tokens_per_s, "round_s": cfg.cost.round_s}
                for n, (cfg, ids) in enumerate(ev.rollout.replicas)]
    dollars = c.dollars_per_hour()
    pred = {"rollout_s": ev.rollout_s, "train_s": ev.train_s, "sync_s": ev.sync_s, "reward_s": p.wl.reward_s,
            "step_s": ev.step_s, "tokens_per_s": ev.tokens_per_s, "dollars_per_hour": dollars,
            "tokens_per_dollar": ev.tokens_per_s * 3600 / dollars if dollars > 0 else None}
    return {"world_size": len(order), "ranks": ranks,
            "rollout": {"replicas": replicas, "tokens_per_s": total},
            "train": {"dp": tr.dp, "tp": tr.tp, "pp": tr.pp, "stages": stages_json,
                      "tokens_per_s": cm.train_tokens_per_s(p.wl, ev.train_s)},
            "predicted": pred,
            "solver": {"seconds": p.stats.seconds, "iterations": p.stats.iterations, "status": p.stats.status,
                       "evaluations": p.stats.evaluations, "milp_solves": p.stats.milp_solves},
            "inputs": {"cluster": c.to_dict(), "model": p.model.to_config(), "workload": p.wl.to_dict(),
                       "efficiency": p.eff.to_dict()}}


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
    lines += [f"train: dp {tr['dp']} tp {tr['tp']} pp {tr['pp']}; rollout: {len(plan_json['rollout']['replicas'])} replicas",
              f"predicted: rollout {pr['rollout_s']:.2f} s | train {pr['train_s']:.2f} s | sync {pr['sync_s']:.2f} s | "
              f"reward {pr['reward_s']:.2f} s | step {pr['step_s']:.2f} s",
              f"           {pr['tokens_per_s']:.1f} tokens/s | ${pr['dollars_per_hour']:.2f}/h | "
              + (f"{tpd:.0f} tokens/$" if tpd is not None else "free"),
              f"solver: {plan_json['solver']['seconds']:.2f} s, {plan_json['solver']['iterations']} iterations, "
              f"{plan_json['solver']['status']}"]
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
                palette = [i for i in range(20) if i not in (14, 15)]      # skip tab20's greys (idle is grey)
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
    ax.set_title(f"step {pr['step_s']:.1f} s, {pr['tokens_per_s']:.0f} tok/s, ${pr['dollars_per_hour']:.2f}/h", fontsize=9)
    ax.legend(handles=[Patch(color="#c0392b", label="train (stage, dp, tp)"), Patch(color=cmap(1), label="rollout replica")],
              loc="upper center", fontsize=7, ncol=2, bbox_to_anchor=(0.5, 0.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- calibration

def calibrate(points: list[tuple[Planner, tuple[int, ...], dict]], base: Efficiency | None = None) -> Efficiency:
    """Fit per-type mfu_train / hbm_eff / mfu_infer and the sync link_eff / latency to measured timings.
    points: (planner, per-machine trainer counts, {"rollout_s", "train_s", "sync_s"} measured, any subset).
    Phase 1 is re-run on the fixed partition for every trial so layouts follow the constants."""
    eff = Efficiency.from_dict((base or Efficiency()).to_dict())
    types = sorted({t for p, _, _ in points for t in p.types})
    for t in types:
        eff.per_type.setdefault(t, cm.TypeEfficiency(**vars(eff.of(t))))

    def predict(key: str) -> list[tuple[float, float]]:
        out = []
        for p, counts, meas in points:
            if key in meas:
                q = type(p)(p.cluster, p.model, p.wl, eff, p.max_seconds)
                out.append((getattr(q.evaluate(counts), key), meas[key]))
        return out

    def loss(key: str) -> float:
        return sum(math.log(a / b) ** 2 if math.isfinite(a) else 1e9 for a, b in predict(key))

    def fit(key: str, fields: list[str], rounds: int) -> None:
        for _ in range(rounds):                              # coordinate descent, golden section in log space
            for f in fields:
                def at(x: float) -> float:
                    for t in types:
                        setattr(eff.per_type[t], f, math.exp(x))
                    return loss(key)
                lo, hi, phi = math.log(0.01), math.log(1.0), (math.sqrt(5) - 1) / 2
                m1, m2 = hi - phi * (hi - lo), lo + phi * (hi - lo)
                f1, f2 = at(m1), at(m2)
                for _ in range(24):
                    if f1 <= f2:
                        hi, m2, f2 = m2, m1, f1
                        m1 = hi - phi * (hi - lo)
                        f1 = at(m1)
                    else:
                        lo, m1, f1 = m1, m2, f2
                        m2 = lo + phi * (hi - lo)
                        f2 = at(m2)
                at((lo + hi) / 2)

    fit("train_s", ["mfu_train"], 1)
    fit("rollout_s", ["hbm_eff"], 1)
    # mfu_infer is only fitted if the data can see it: decode that is memory-bound everywhere leaves it at its prior
    prior, base_loss = eff.per_type[types[0]].mfu_infer, loss("rollout_s")
    for t in types:
        eff.per_type[t].mfu_infer = prior / 2
    sensitive = abs(loss("rollout_s") - base_loss) > 0.01 * max(base_loss, 1e-3)
    for t in types:
        eff.per_type[t].mfu_infer = prior
    if sensitive:
        fit("rollout_s", ["mfu_infer", "hbm_eff"], 2)
    sync = [(p, type(p)(p.cluster, p.model, p.wl, eff, p.max_seconds).evaluate(c).sync_s, m["sync_s"])
            for p, c, m in points if "sync_s" in m]
    if sync:
        # predicted sync = latency + GB / (link_eff * bw): recover bw per point, then least squares on (latency, 1/eff)
        xs = [(s - eff.sync_latency_s) * eff.link_eff for _, s, _ in sync]   # = bytes / link bandwidth
        ys = [meas for _, _, meas in sync]
        if len(sync) >= 2 and max(xs) > min(xs):
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            eff.link_eff, eff.sync_latency_s = 1 / max(slope, 1e-6), max(0.0, my - slope * mx)
        else:                                                # one point: keep latency <= half the measurement
            eff.sync_latency_s = min(eff.sync_latency_s, 0.5 * ys[0])
            eff.link_eff = xs[0] / (ys[0] - eff.sync_latency_s)
        eff.link_eff = min(max(eff.link_eff, 1e-3), 1.0)     # a fraction of nominal bandwidth
    eff.per_type["*"] = cm.TypeEfficiency(**vars(eff.per_type[types[0]]))
    return eff
