"""AReaL-Hex's planner results (Fig. 3, Table 4) next to our planner's, from device profiles alone.

    python exp/reproduce_paper.py                    # both profile sets, about 3 min on 2 loaded CPU cores
    python exp/reproduce_paper.py --profiles table1  # the default set only
    python exp/reproduce_paper.py --write-profiles   # derive exp/profiles/h{800,20}_table1.yaml from Table 1 again
    python exp/reproduce_paper.py --sensitivity      # add section 2b (the assumed fractions' plausible corners)

Every device constant comes from a device profile. Two sets, both with the paper's stated peaks, memory, NVLink,
links and prices (its setup section, reference paper.md §5):
- `table1`, the default (exp/profiles/h800_table1.yaml, h20_table1.yaml): the achieved fractions are the paper's
  own per-GPU characterisation, its Table 1 ($ per inference token and per training token on each GPU type). With
  each type's $/h that is tokens/s per GPU; `derive_table1` picks, per type, the fractions (hbm_eff and
  mfu_infer for rollout, then mfu_train) with which cost_model's per-GPU formulas give those tokens/s, by least
  squares in log space over the three models. Table 1 is an input of the paper, not one of its results.
- `assumed` (exp/profiles/h800_paper.yaml, h20_paper.yaml): fractions assumed from published numbers, the same for
  both types (sources in the YAML); physics only, no paper number behind them.
No Fig. 3, Fig. 4, Table 2 or Table 4 number is used by either; they are printed next to ours. The global constants
(link_eff, sync_latency_s, mem_frac) are specs.Efficiency's defaults, the ones every shipped plan uses.

1. Per GPU: Table 1's tokens/s, the Table-1 profile's (its residuals) and the assumed profile's.
1b. Table 1 alone (no cost model): each GPU at its Table 1 rate, the best split, for the paper's clusters.
2. Equal budget (~$126.7/h): the best homogeneous H800 plan (24 GPUs), homogeneous H20 plan (68 GPUs) and the
   heterogeneous plan (56 GPUs: 6 H800 + 50 H20), against Fig. 3 (tokens/s) and Fig. 4 / Table 2 (seconds);
   and the best heterogeneous sub-cluster within that budget when the mix is free.
2b. (--sensitivity) The Fig. 3 ratios at the corners of the assumed fractions' plausible ranges.
3. Table 4: the cheapest whole-machine sub-cluster of an H800/H20 pool matching the H800 throughput, and the
   paper's 32-GPU cluster (8 H800 + 24 H20) evaluated directly.
4. AReaL's eta sweep shape from the simulator (each set's 24xH800 plan).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "exp"))

import schedule  # noqa: E402
from plan import PlanError  # noqa: E402
from planner import cost_model, profile_fit, search, simulate, specs  # noqa: E402

MODELS = {
    "1.5B": "deepseek-r1-distill-qwen-1.5b",
    "7B": "deepseek-r1-distill-qwen-7b",
    "14B": "deepseek-r1-distill-qwen-14b",
}
PROFILE_SETS = {
    "table1": {
        "H800": ROOT / "exp" / "profiles" / "h800_table1.yaml",
        "H20": ROOT / "exp" / "profiles" / "h20_table1.yaml",
    },
    "assumed": {
        "H800": ROOT / "exp" / "profiles" / "h800_paper.yaml",
        "H20": ROOT / "exp" / "profiles" / "h20_paper.yaml",
    },
}
PROFILES = PROFILE_SETS["table1"]  # the default
SET_TITLES = {"table1": "Table-1 profile", "assumed": "assumed fractions"}

# The paper's per-GPU characterisation (reference paper.md §6.1), an input: ((rollout H800, H20), (train H800, H20))
# in the printed "$ per token". Taken literally that is 0.26 tokens/s per H800; by magnitude the unit is $ per 1K
# tokens (reference paper.md §6.1), the reading we use.
TABLE1 = {
    "1.5B": ((5.58e-3, 2.06e-3), (1.66e-3, 5.16e-3)),
    "7B": ((1.14e-2, 4.15e-3), (3.05e-3, 9.51e-3)),
    "14B": ((3.43e-2, 1.27e-2), (0.99e-2, 3.10e-2)),
}
TABLE1_TOKENS = 1000  # tokens per Table 1 "token"
TABLE1_TYPES = ("H800", "H20")
# The paper's results, for printing next to ours only (reference paper.md §6): Fig. 3 tokens/s, Fig. 4 seconds
# (read from its bars), Table 2 sync seconds, Table 4 tokens/s.
FIG3 = {"1.5B": (8980, 18400, 25100), "7B": (2830, 5980, 7820), "14B": (1420, 2160, 3250)}  # H20, H800, Hex
FIG4_H800 = {"1.5B": (144.9, 95.0), "7B": (405.4, 246.4), "14B": (1051.4, 457.5)}  # (rollout, train)
FIG4_H20 = {"1.5B": (333.9, 333.7), "7B": (603.0, 602.9), "14B": (1205.8, 1205.5)}
FIG4_HEX = {"1.5B": (107.0, 106.6), "7B": (252.1, 250.9), "14B": (740.6, 569.1)}
SYNC = {"1.5B": (4.75, 2.74, 10.06), "7B": (14.79, 7.46, 58.34), "14B": (26.00, 13.05, 112.93)}  # H800, H20, Hex
TABLE4 = {"1.5B": (1.84e4, 1.79e4), "7B": (5.98e3, 6.00e3), "14B": (2.16e3, 2.30e3)}  # H800 24, Hex 32 tokens/s
TABLE4_COST = (126.72, 86.64)  # $/h of the two

# The implied tokens per RL step are 2.3-2.8 M (throughput x step time, reference paper.md §6.4), far fewer than
# 512 x 16 sequences of R1-length outputs; we keep AReaL's 16 samples per prompt and a long-tailed length
# distribution (max 27,648 tokens, AReaL's cap) and pick 64 prompts so one step is ~2.6 M tokens. With eta >= 1
# the step size only sets how often the weight sync is paid, not the decode or train rates.
WORKLOAD = dict(
    prompts_per_step=64,
    samples_per_prompt=16,
    prompt_len=200,
    eta=8,
    max_batch=256,
    microbatch_tokens=16384,
    ppo_minibatches=4,
)
GEN_MEAN, GEN_Q = 2400.0, {0.5: 1200.0, 0.9: 5000.0, 0.99: 16000.0, 1.0: 27648.0}


def workload() -> specs.Workload:
    return specs.Workload.from_quantiles(GEN_MEAN, GEN_Q, **WORKLOAD)


# ----------------------------------------------------------------------------- devices from profiles


@dataclass(frozen=True)
class PaperDevice:
    """One GPU type as its profile gives it: the planner's efficiencies, the GPU type, its machines' links."""

    profile: profile_fit.DeviceProfile
    gpu: specs.GPUType
    inter_gbps: dict[str, float]  # other GPU type -> GB/s between a machine of this type and one of that
    source: str  # the profile's path


def load_paper_device(path: str | Path) -> PaperDevice:
    """The profile (checked by profile_fit.load_profile) plus its `hardware` and `links` keys."""
    prof = profile_fit.load_profile(path)
    with open(path) as f:
        doc = yaml.safe_load(f)
    try:
        hw, links = doc["hardware"], doc["links"]["inter_gbps"]
        gpu = specs.GPUType(
            prof.gpu_type,
            float(hw["hbm_gb"]),
            prof.tflops,
            prof.hbm_tbps,
            float(hw["dollars_per_hour"]),
            float(hw["intra_gbps"]),
        )
        inter = {str(k): float(v) for k, v in links.items()}
    except (KeyError, TypeError, ValueError) as e:
        need = "hardware.{hbm_gb, intra_gbps, dollars_per_hour} and links.inter_gbps"
        raise specs.SpecError(f"{path}: a paper profile needs {need} ({e!r})") from None
    return PaperDevice(prof, gpu, inter, str(path))


def paper_devices(paths: dict[str, Path] | None = None) -> dict[str, PaperDevice]:
    devices = {}
    for name, path in (paths or PROFILES).items():
        dev = load_paper_device(path)
        if dev.profile.gpu_type != name:
            raise specs.SpecError(f"{path}: gpu_type '{dev.profile.gpu_type}', expected '{name}'")
        devices[name] = dev
    return devices


def paper_cluster(name: str, devices: dict[str, PaperDevice]) -> specs.Cluster:
    """The shipped cluster `name`'s machines, with every GPU type's numbers and every link taken from the profiles
    (the YAML's own numbers are not read: they are the same paper figures, but the profiles are the source)."""
    shipped = specs.load_cluster(ROOT / "exp" / "clusters" / f"{name}.yaml")
    types = sorted(shipped.gpu_types)
    inter = {}
    for i, a in enumerate(types):
        for b in types[i:]:
            ab, ba = devices[a].inter_gbps[b], devices[b].inter_gbps[a]
            if ab != ba:
                raise specs.SpecError(f"profiles disagree on the {a}-{b} link: {ab} vs {ba} GB/s")
            inter[tuple(sorted((a, b)))] = ab
    return specs.Cluster(name, {t: devices[t].gpu for t in types}, list(shipped.machines), inter)


def paper_efficiency(cluster: specs.Cluster, devices: dict[str, PaperDevice]) -> specs.Efficiency:
    """cost_model's default global constants, and each of the cluster's GPU types from its profile."""
    eff = specs.Efficiency()
    for t in cluster.gpu_types:
        eff = profile_fit.apply_profile(eff, cluster, devices[t].profile, devices[t].source)
    return eff


def best(name: str, model: specs.ModelSpec, devices: dict[str, PaperDevice], **kw) -> dict:
    c = paper_cluster(name, devices)
    return schedule.plan(c, model, workload(), paper_efficiency(c, devices), **kw)


def describe(plan: dict) -> str:
    n = {}
    for r in plan["ranks"]:
        n[(r["gpu_type"], r["role"])] = n.get((r["gpu_type"], r["role"]), 0) + 1
    tr = plan["train"]
    return (
        ", ".join(f"{v} {t} {role}" for (t, role), v in sorted(n.items()))
        + f"; train dp{tr['dp']} tp{tr['tp']} pp{tr['pp']}"
    )


# ----------------------------------------------------------------------------- per GPU, and Table 1 as a profile


def table1_rates(size: str, gpu_type: str, dollars_per_hour: float) -> tuple[float, float]:
    """Table 1 as tokens/s per GPU: (rollout, train) = $/h / 3600 / ($ per token), the unit $ per 1K tokens."""
    i = TABLE1_TYPES.index(gpu_type)
    return tuple(dollars_per_hour / 3600 / (TABLE1[size][phase][i] / TABLE1_TOKENS) for phase in (0, 1))


def one_machine(dev: PaperDevice) -> specs.Cluster:
    t = dev.gpu.name
    return specs.Cluster(f"one_{t}", {t: dev.gpu}, [specs.Machine(0, t, 8)], {(t, t): dev.inter_gbps[t]})


def rollout_per_gpu(model: specs.ModelSpec, dev: PaperDevice, te: specs.TypeEfficiency) -> tuple[float, int]:
    """cost_model's generated tokens/s per GPU of one replica of the smallest TP that fits (pp 1) rolling out one
    step's batch (decode at its memory-limited batch plus prefill, cost_model.rollout_seconds), and that TP."""
    wl, eff = workload(), specs.Efficiency(per_type={dev.gpu.name: te})
    for tp in (1, 2, 4, 8):
        rc = cost_model.replica_cost(model, dev.gpu, tp, 1, wl, eff, dev.gpu.intra_gbps)
        if rc is not None:
            seconds = cost_model.rollout_seconds(
                model, wl, rc.tokens_per_s, rc.prefill_tflops, rc.tokens_per_s, rc.batch
            )
            return wl.batch * wl.gen_mean / seconds / tp, tp
    raise specs.SpecError(f"{model.name} does not fit on one {dev.gpu.name} machine")


def train_per_gpu(model: specs.ModelSpec, dev: PaperDevice, te: specs.TypeEfficiency) -> tuple[float, str]:
    """cost_model's training tokens/s per GPU of the planner's best training plan on one 8-GPU machine of the type
    (the smallest unit the paper's clusters have, and one every model's training fits in), and that plan's shape."""
    wl, eff = workload(), specs.Efficiency(per_type={dev.gpu.name: te})
    tr = search.Planner(one_machine(dev), model, wl, eff).train_plan((8,))
    if tr is None:
        raise specs.SpecError(f"{model.name} does not train on one {dev.gpu.name} machine")
    return wl.tokens_per_step / tr.seconds / 8, f"dp{tr.dp} tp{tr.tp} pp{tr.pp}"


def fit_log_lsq(residuals, n: int, lo: float = 1e-4, hi: float = 1.0) -> tuple[list[float], float]:
    """x in [lo, hi]^n minimising sum(residuals(x)^2): the best point of a grid (1/4 decade) in log10 x, then a
    compass search in log10 x down to steps of 1e-5 decade. Deterministic; the residuals need not be smooth (the
    decode roofline's max has kinks)."""
    a, b = math.log10(lo), math.log10(hi)

    def sse(lx: tuple[float, ...]) -> float:
        return sum(r * r for r in residuals([10**v for v in lx]))

    axis = [a + k * 0.25 for k in range(int(round((b - a) / 0.25)) + 1)]
    x = min(itertools.product(axis, repeat=n), key=sse)
    val, step = sse(x), 0.125
    while step > 1e-5:
        moved = False
        for i, d in itertools.product(range(n), (step, -step)):
            y = tuple(min(max(v + (d if j == i else 0.0), a), b) for j, v in enumerate(x))
            s = sse(y)
            if s < val:
                x, val, moved = y, s, True
        if not moved:
            step /= 2
    return [10**v for v in x], val


@dataclass(frozen=True)
class Table1Fit:
    """One GPU type's fractions from Table 1, and what cost_model gives per GPU with them."""

    gpu_type: str
    efficiency: specs.TypeEfficiency
    table1: dict[str, tuple[float, float]]  # size -> Table 1's (rollout, train) tokens/s per GPU
    ours: dict[str, tuple[float, float]]  # size -> cost_model's, with `efficiency`
    shapes: dict[str, tuple[str, str]]  # size -> (rollout replica, training plan on one machine)

    def residuals(self) -> dict[str, tuple[float, float]]:
        """ours / Table 1 - 1, per model: (rollout, train)."""
        return {s: (o[0] / self.table1[s][0] - 1, o[1] / self.table1[s][1] - 1) for s, o in self.ours.items()}


def per_gpu(dev: PaperDevice, te: specs.TypeEfficiency) -> dict[str, tuple[tuple[float, float], tuple[str, str]]]:
    out = {}
    for size, name in MODELS.items():
        model = specs.load_model_spec(name)
        (r, tp), (t, shape) = rollout_per_gpu(model, dev, te), train_per_gpu(model, dev, te)
        out[size] = ((r, t), (f"tp{tp}", shape))
    return out


def derive_table1(base: dict[str, PaperDevice]) -> dict[str, Table1Fit]:
    """Per GPU type, the fractions with which cost_model's per-GPU tokens/s (rollout_per_gpu, train_per_gpu)
    reproduce Table 1's, one set for all three models: hbm_eff and mfu_infer by least squares of
    log(ours / Table 1) of rollout, then mfu_train of training with those (the optimizer step reads hbm_eff).
    decode_overhead_s stays the base profile's. `base` gives the hardware (peaks, memory, NVLink, price); its
    fractions are not used."""
    models = {s: specs.load_model_spec(n) for s, n in MODELS.items()}
    fits = {}
    for t, dev in base.items():
        overhead = dev.profile.efficiency.decode_overhead_s
        target = {s: table1_rates(s, t, dev.gpu.dollars_per_hour) for s in MODELS}

        def rollout_res(x, dev=dev, target=target, overhead=overhead):
            te = specs.TypeEfficiency(mfu_train=1.0, mfu_infer=x[1], hbm_eff=x[0], decode_overhead_s=overhead)
            return [math.log(rollout_per_gpu(m, dev, te)[0] / target[s][0]) for s, m in models.items()]

        (hbm, mfu_infer), _ = fit_log_lsq(rollout_res, 2)

        def train_res(x, dev=dev, target=target, hbm=hbm, mfu_infer=mfu_infer, overhead=overhead):
            te = specs.TypeEfficiency(x[0], mfu_infer, hbm, overhead)
            return [math.log(train_per_gpu(m, dev, te)[0] / target[s][1]) for s, m in models.items()]

        (mfu_train,), _ = fit_log_lsq(train_res, 1)
        te = specs.TypeEfficiency(mfu_train, mfu_infer, hbm, overhead)
        got = per_gpu(dev, te)
        fits[t] = Table1Fit(t, te, target, {s: g[0] for s, g in got.items()}, {s: g[1] for s, g in got.items()})
    return fits


def sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits - 1}e}")


def table1_profile_text(fit: Table1Fit, base: PaperDevice) -> str:
    """The YAML of the Table-1 profile of fit.gpu_type: the base profile's hardware, nominal and links, the fitted
    fractions (4 significant digits), a comment per number."""
    t, e = fit.gpu_type, fit.efficiency
    with open(base.source) as f:
        doc = yaml.safe_load(f)
    i = TABLE1_TYPES.index(t)
    price = base.gpu.dollars_per_hour
    res = fit.residuals()
    small = specs.load_model_spec(MODELS["1.5B"])
    rc = cost_model.replica_cost(
        small, base.gpu, 1, 1, workload(), specs.Efficiency(per_type={t: e}), base.gpu.intra_gbps
    )
    a = base.profile.efficiency

    def rows(phase: int) -> list[str]:
        return [
            f"  #   {s:>4}: ${TABLE1[s][phase][i]:.3g} per 1K tokens -> {fit.table1[s][phase]:6.1f} tokens/s per GPU;"
            f" ours {fit.ours[s][phase]:6.1f} ({res[s][phase]:+.1%}; {fit.shapes[s][phase]})"
            for s in MODELS
        ]

    base_rel = Path(base.source).resolve().relative_to(ROOT)
    lines = [
        f"# {t} as the AReaL-Hex paper itself characterises it: its Table 1 (reference paper.md §6.1), $ per inference",
        "# token and $ per training token on one GPU of each type. Written by `python exp/reproduce_paper.py",
        "# --write-profiles` (reproduce_paper.derive_table1); do not edit by hand. Not measured: we have no",
        f"# {t} to run `schedule.py profile` on. The format is the one `schedule.py --profile` reads; `hardware`",
        "# and `links` are extra keys it ignores, read by exp/reproduce_paper.py to build its clusters.",
        "#",
        "# The fractions are derived from Table 1 ($/token x $/h -> tokens/s per GPU) through cost_model's per-GPU",
        '# formulas; no Fig. 3/Table 4 number used. Table 1 prints "$ per token"; by magnitude it is $ per 1K tokens',
        f"# (reference paper.md §6.1), so tokens/s per GPU = ${price}/h / 3600 / ($ per 1K tokens / 1000). One set for",
        "# the three models (DeepSeek-R1-Distill-Qwen 1.5B / 7B / 14B), least squares of log(ours / Table 1), with",
        "# reproduce_paper.workload() (64 x 16 sequences, prompt 200, mean generation 2400):",
        "#   rollout: one replica of the smallest TP that fits (pp 1) rolls out one step (cost_model.replica_cost at its",
        "#   memory-limited batch, + cost_model.rollout_seconds' prefill); generated tokens/s per GPU; fits hbm_eff, mfu_infer.",
        "#   training: the planner's best plan on one 8-GPU machine (Planner.train_plan); tokens/s per GPU; fits",
        "#   mfu_train, with the rollout's hbm_eff (cost_model's optimizer step reads it).",
        f"# These are far below what an engine reaches on the device's own peaks ({base_rel} assumes",
        f"# hbm_eff {a.hbm_eff}, mfu_infer {a.mfu_infer}, mfu_train {a.mfu_train}): they hold every cost of the paper's",
        "# runs that cost_model does not model. load_profile's plausibility checks accept them.",
        f"device: {t} (AReaL-Hex Table 1 through cost_model's per-GPU formulas; not profiled)",
        f"gpu_type: {t}",
        f"cluster: {doc.get('cluster', '')}",
        "efficiency:",
        "  # Rollout, Table 1's $ per inference token (per model: Table 1, tokens/s per GPU, ours with these fractions).",
        "  # mfu_infer is weakly determined: it only sets where the compute roof bends the fit (docs/planner.md).",
        *rows(0),
        f"  hbm_eff: {sig(e.hbm_eff)}",
        f"  mfu_infer: {sig(e.mfu_infer)}",
        "  # Training, Table 1's $ per training token:",
        *rows(1),
        f"  mfu_train: {sig(e.mfu_train)}",
        f"  # Not fitted: {base_rel}'s assumption; a 1.5B decode step takes {rc.round_s:.3f} s at these",
        f"  # fractions, so it is {e.decode_overhead_s / rc.round_s:.2%} of one.",
        f"  decode_overhead_s: {e.decode_overhead_s}",
        f"# nominal, hardware and links: the paper's setup (reference paper.md §5), as in {base_rel}.",
        yaml.safe_dump({k: doc[k] for k in ("nominal", "hardware", "links")}, sort_keys=False, width=120).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def write_table1_profiles() -> dict[str, Table1Fit]:
    base = paper_devices(PROFILE_SETS["assumed"])
    fits = derive_table1(base)
    for t, fit in fits.items():
        path = PROFILE_SETS["table1"][t]
        path.write_text(table1_profile_text(fit, base[t]))
        profile_fit.load_profile(path)  # passes the checks --profile runs
        print(f"wrote {path.relative_to(ROOT)}")
    return fits


# ----------------------------------------------------------------------------- 1. per GPU


def print_per_gpu(sets: dict[str, dict[str, PaperDevice]], fits: dict[str, Table1Fit]) -> None:
    print("== 1. per GPU: Table 1 ($ per 1K tokens -> tokens/s per GPU) and cost_model's per-GPU tokens/s ==")
    print("Table-1 profile: per type, least squares of log(ours / Table 1) over the 3 models (derive_table1):")
    for t, fit in fits.items():
        e = fit.efficiency
        print(f"  {t}: hbm_eff {e.hbm_eff:.4g}, mfu_infer {e.mfu_infer:.4g}, mfu_train {e.mfu_train:.4g}", end="")
        print(f" (decode_overhead_s {e.decode_overhead_s} not fitted)")
    have = {s: {t: per_gpu(d, d.profile.efficiency) for t, d in devs.items()} for s, devs in sets.items()}
    head = "  ".join(f"{SET_TITLES[s]:>22}" for s in sets)
    print(f"{'model':>5} {'type':>4}  {'phase':>7} {'Table 1':>8}  {head}  shape ({SET_TITLES[next(iter(sets))]})")
    for size in MODELS:
        for t in TABLE1_TYPES:
            for phase, what in enumerate(("rollout", "train")):
                ref = fits[t].table1[size][phase]
                cells = []
                for s in sets:
                    got = have[s][t][size][0][phase]
                    cells.append(f"{got:>12.1f} ({got / ref - 1:+7.1%})")
                shape = have[next(iter(sets))][t][size][1][phase]
                print(
                    f"{size:>5} {t:>4}  {what:>7} {ref:>8.1f}  " + "  ".join(f"{c:>22}" for c in cells) + f"  {shape}"
                )
    worst = max(abs(r) for fit in fits.values() for rr in fit.residuals().values() for r in rr)
    print(f"(the fit's largest residual: {worst:.1%}; the profiles' YAML rounds the fractions to 4 digits)")
    print("H20 / H800 per GPU, " + ", ".join(SET_TITLES[s] for s in sets) + " (Table 1):")
    for size in MODELS:
        cells = []
        for phase, what in enumerate(("rollout", "train")):
            ref = fits["H20"].table1[size][phase] / fits["H800"].table1[size][phase]
            ours = ", ".join(f"{have[s]['H20'][size][0][phase] / have[s]['H800'][size][0][phase]:.3f}" for s in sets)
            cells.append(f"{what} {ours} ({ref:.3f})")
        print(f"{size:>5}  " + "   ".join(cells))
    for t in TABLE1_TYPES:
        for size in MODELS:
            for phase in (0, 1):
                loaded = have.get("table1", {}).get(t, {}).get(size)
                if loaded and abs(loaded[0][phase] / fits[t].ours[size][phase] - 1) > 1e-3:
                    print(f"WARNING: {PROFILE_SETS['table1'][t]} is not the derivation's; run --write-profiles")
                    return


# ----------------------------------------------------------------------------- 1b. Table 1 alone


def table1_alone(counts: dict[str, int], prices: dict[str, float]) -> dict[str, tuple[float, dict[str, int]]]:
    """Per model: the best tokens/s of a cluster with counts[type] GPUs when each GPU rolls out or trains at Table 1's
    rate (every integer split; a step's tokens are prompt + generation, its rollout generates the generation part;
    no sync, memory limits or links), and the rollout GPUs per type of that split."""
    wl = workload()
    gen_share = wl.gen_mean / (wl.prompt_len + wl.gen_mean)
    out = {}
    for size in MODELS:
        rates = {t: table1_rates(size, t, prices[t]) for t in counts}
        top = (0.0, {})
        for split in itertools.product(*(range(n + 1) for n in counts.values())):
            roll = dict(zip(counts, split))
            gen = sum(roll[t] * rates[t][0] for t in counts) / gen_share
            train = sum((counts[t] - roll[t]) * rates[t][1] for t in counts)
            if min(gen, train) > top[0]:
                top = (min(gen, train), roll)
        out[size] = top
    return out


def print_table1_alone(devices: dict[str, PaperDevice]) -> None:
    print(
        "\n== 1b. Table 1 alone, no cost model: each GPU at its Table 1 rate, the best split (no sync, memory, links) =="
    )
    clusters = {"H20 (68)": {"H20": 68}, "H800 (24)": {"H800": 24}, "Hex (6+50)": {"H800": 6, "H20": 50}}
    prices = {t: d.gpu.dollars_per_hour for t, d in devices.items()}
    got = {k: table1_alone(c, prices) for k, c in clusters.items()}
    h32 = table1_alone({"H800": 8, "H20": 24}, prices)
    for size in MODELS:
        t = {k: got[k][size][0] for k in clusters}
        cells = "   ".join(f"{k} {t[k]:.0f} ({p})" for k, p in zip(clusters, FIG3[size]))
        split = ", ".join(f"{n} {ty}" for ty, n in got["Hex (6+50)"][size][1].items())
        print(f"-- {size}: tokens/s (Fig. 3)   {cells}")
        print(
            f"   Hex/H800 {t['Hex (6+50)'] / t['H800 (24)']:.2f}x (paper {FIG3[size][2] / FIG3[size][1]:.2f}x)   "
            f"Hex/H20 {t['Hex (6+50)'] / t['H20 (68)']:.2f}x (paper {FIG3[size][2] / FIG3[size][0]:.2f}x)   "
            f"Hex rolls out on {split}   8 H800 + 24 H20 {h32[size][0]:.0f} = {h32[size][0] / t['H800 (24)']:.2f}x "
            f"H800 (Table 4 {TABLE4[size][1] / TABLE4[size][0]:.2f}x)"
        )


# ----------------------------------------------------------------------------- 2, 3. the planner


def fig3_plans(devices: dict[str, PaperDevice]) -> dict[str, dict[str, dict]]:
    out = {}
    for size, name in MODELS.items():
        model = specs.load_model_spec(name)
        out[size] = {
            "H20": best("h20_equal_budget", model, devices),
            "H800": best("h800_24", model, devices),
            "Hex": best("hetero_56", model, devices),
            # the paper fixes 56 GPUs; with the mix free, the planner's best whole-machine sub-cluster of the pool
            "free": best("hetero_pool", model, devices, budget=TABLE4_COST[0]),
        }
    return out


def table4_plans(devices: dict[str, PaperDevice], fig3: dict) -> dict[str, tuple[dict | str, dict]]:
    out = {}
    for size, name in MODELS.items():
        model = specs.load_model_spec(name)
        target = fig3[size]["H800"]["predicted"]["tokens_per_s"]
        try:
            cheap = best("hetero_pool", model, devices, min_tokens_per_s=target)
        except PlanError as e:
            cheap = f"none ({e})"
        out[size] = (cheap, best("hetero_32", model, devices))
    return out


def tput(plan: dict) -> float:
    return plan["predicted"]["tokens_per_s"]


def print_fig3(runs: dict[str, dict]) -> None:
    print("\n== 2. Fig. 3, equal budget (~$126.7/h): tokens/s, ours next to the paper ==")
    names = list(runs)
    print(f"{'model':>5} {'':>9} {'paper':>8}  " + "  ".join(f"{SET_TITLES[s]:>18}" for s in names))
    for size in MODELS:
        f_h20, f_h800, f_hex = FIG3[size]
        rows = {
            "H20": (f"{f_h20}", lambda p: f"{tput(p['H20']):.0f}"),
            "H800": (f"{f_h800}", lambda p: f"{tput(p['H800']):.0f}"),
            "Hex": (f"{f_hex}", lambda p: f"{tput(p['Hex']):.0f}"),
            "Hex/H800": (f"{f_hex / f_h800:.2f}x", lambda p: f"{tput(p['Hex']) / tput(p['H800']):.2f}x"),
            "Hex/H20": (f"{f_hex / f_h20:.2f}x", lambda p: f"{tput(p['Hex']) / tput(p['H20']):.2f}x"),
        }
        for k, (paper, ours) in rows.items():
            cells = "  ".join(f"{ours(runs[s]['fig3'][size]):>18}" for s in names)
            print(f"{size if k == 'H20' else '':>5} {k:>9} {paper:>8}  {cells}")
    for s in names:
        print(f"\n-- {SET_TITLES[s]}: each plan, seconds per step ours (paper Fig. 4 / Table 2)")
        for size in MODELS:
            plans = runs[s]["fig3"][size]
            for k, fig in (("H20", FIG4_H20), ("H800", FIG4_H800), ("Hex", FIG4_HEX)):
                pr = plans[k]["predicted"]
                sync_paper = SYNC[size][{"H800": 0, "H20": 1, "Hex": 2}[k]]
                print(
                    f"{size if k == 'H20' else '':>5} {k:>4}: rollout {pr['rollout_s']:7.1f} ({fig[size][0]:7.1f})  "
                    f"train {pr['train_s']:7.1f} ({fig[size][1]:7.1f})  sync {pr['sync_s']:6.2f} ({sync_paper:6.2f})"
                    f"  ${pr['dollars_per_hour']:.2f}/h  [{describe(plans[k])}]"
                )
            free = plans["free"]
            print(
                f"{'':>5} mix free (best sub-cluster of 3 H800 + 6 H20 machines within ${TABLE4_COST[0]:.2f}/h): "
                f"{tput(free):.0f} tok/s = {tput(free) / tput(plans['H800']):.2f}x H800, "
                f"{tput(free) / tput(plans['H20']):.2f}x H20, ${free['predicted']['dollars_per_hour']:.2f}/h "
                f"[{describe(free)}]"
            )


def print_table4(runs: dict[str, dict]) -> None:
    print("\n== 3. Table 4: the cheapest sub-cluster of the pool at our own 24xH800 throughput ==")
    for size in MODELS:
        p800, p32 = TABLE4[size]
        print(f"-- {size}: paper: 24 H800 {p800:.0f} tok/s at ${TABLE4_COST[0]:.2f}/h; ", end="")
        print(f"8 H800 + 24 H20 {p32:.0f} tok/s = {p32 / p800:.2f}x at ${TABLE4_COST[1]:.2f}/h")
        for s, r in runs.items():
            cheap, h32 = r["table4"][size]
            target = tput(r["fig3"][size]["H800"])
            if isinstance(cheap, str):
                ours = cheap
            else:
                ours = (
                    f"${cheap['predicted']['dollars_per_hour']:.2f}/h ({cheap['world_size']} GPUs: {describe(cheap)})"
                )
            print(f"   {SET_TITLES[s]}: 24 H800 {target:.0f} tok/s; cheapest matching it {ours}")
            print(
                f"   {'':>{len(SET_TITLES[s])}}  8 H800 + 24 H20 (${TABLE4_COST[1]:.2f}/h): {tput(h32):.0f} tok/s "
                f"= {tput(h32) / target:.2f}x H800  [{describe(h32)}]"
            )


# ----------------------------------------------------------------------------- 2b, 4


def with_fractions(devices: dict[str, PaperDevice], **fractions: float) -> dict[str, PaperDevice]:
    """The same devices with these achieved fractions, for both types alike (a what-if, not a fit)."""
    return {
        t: replace(d, profile=replace(d.profile, efficiency=replace(d.profile.efficiency, **fractions)))
        for t, d in devices.items()
    }


# The corners of the plausible ranges the assumed profiles' comments cite: decode at 50-70% of HBM, training at
# 35-50% MFU.
SENSITIVITY = [dict(hbm_eff=h, mfu_train=m) for h in (0.5, 0.7) for m in (0.35, 0.5)]


def sensitivity(devices: dict[str, PaperDevice]) -> None:
    print("\n== 2b. Fig. 3 ratios across the assumed fractions' plausible ranges (both types alike) ==")
    print(f"{'hbm_eff':>7} {'mfu_train':>9}   " + "   ".join(f"{s + ' Hex/H800, Hex/H20':>24}" for s in MODELS))
    for fractions in SENSITIVITY:
        devs = with_fractions(devices, **fractions)
        cells = []
        for name in MODELS.values():
            model = specs.load_model_spec(name)
            t = {c: tput(best(c, model, devs)) for c in ("h800_24", "h20_equal_budget", "hetero_56")}
            cells.append(f"{t['hetero_56'] / t['h800_24']:.2f}x, {t['hetero_56'] / t['h20_equal_budget']:.2f}x")
        print(f"{fractions['hbm_eff']:>7} {fractions['mfu_train']:>9}   " + "   ".join(f"{c:>24}" for c in cells))
    print("paper: " + "   ".join(f"{s} {h / b:.2f}x, {h / a:.2f}x" for s, (a, b, h) in FIG3.items()))


def eta_sweep(h800_plan: dict, title: str) -> None:
    rep = h800_plan["rollout"]["replicas"][0]
    wl = workload()
    print(f"\n== 4. eta sweep (simulator, 30 steps, 1.5B on the 24xH800 plan, {title}) ==")
    print(
        f"(its replicas: batch {rep['batch']}, decode round {rep['round_s']:.4f} s, so a {wl.gen_max:.0f}-token sequence "
        f"decodes in {wl.gen_max * rep['round_s'] / 3600:.2f} h; planned step {h800_plan['predicted']['step_s']:.0f} s, "
        f"{tput(h800_plan):.0f} tokens/s)"
    )
    print(
        f"{'eta':>4} {'tokens/s':>10} {'step s':>8} {'stale mean':>10} {'trainer idle':>12}   "
        "AReaL Fig. 5c (k tok/s): 128.7, 269.3, 356.6, 356.6, 371.7, 382.4"
    )
    for eta in (0, 1, 2, 4, 8, 16):
        r = simulate.simulate(h800_plan, steps=30, eta=eta, warmup=5)
        print(
            f"{eta:>4} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.1f} {r['staleness']['mean']:>10.2f} "
            f"{r['trainer_idle_frac']:>12.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", choices=["both", *PROFILE_SETS], default="both")
    ap.add_argument("--write-profiles", action="store_true", help="derive the Table-1 profiles and write them")
    ap.add_argument("--sensitivity", action="store_true", help="section 2b for the assumed fractions")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.write_profiles:
        write_table1_profiles()
    names = list(PROFILE_SETS) if args.profiles == "both" else [args.profiles]
    sets = {s: paper_devices(PROFILE_SETS[s]) for s in names}
    for s, devices in sets.items():
        for t, d in devices.items():
            e = d.profile.efficiency
            print(
                f"{SET_TITLES[s]:>17} {t:>4}: {d.gpu.tflops:g} TFLOP/s, {d.gpu.hbm_tbps:g} TB/s, {d.gpu.hbm_gb:g} GB, "
                f"${d.gpu.dollars_per_hour}/h; mfu_train {e.mfu_train:.4g}, mfu_infer {e.mfu_infer:.4g}, "
                f"hbm_eff {e.hbm_eff:.4g}, decode_overhead_s {e.decode_overhead_s}  "
                f"({Path(d.source).relative_to(ROOT)})"
            )
    g = specs.Efficiency()
    print(f"global (cost_model defaults): link_eff {g.link_eff}, sync_latency_s {g.sync_latency_s}, ", end="")
    print(f"mem_frac {g.mem_frac}\n")
    fits = derive_table1(paper_devices(PROFILE_SETS["assumed"]))
    print_per_gpu(sets, fits)
    print_table1_alone(next(iter(sets.values())))
    runs = {}
    for s, devices in sets.items():
        fig3 = fig3_plans(devices)
        runs[s] = {"fig3": fig3, "table4": table4_plans(devices, fig3)}
    print_fig3(runs)
    if args.sensitivity and "assumed" in sets:
        sensitivity(sets["assumed"])
    print_table4(runs)
    for s in names:
        eta_sweep(runs[s]["fig3"]["1.5B"]["H800"], SET_TITLES[s])
    print(f"\n(done in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
