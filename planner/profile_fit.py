"""The device profile (exp/profiles/*.yaml): its file, its checks, applying it to the planner's efficiencies, and
fitting the cost model's constants to the points `schedule.py profile` measured (planner/device_profile.py)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from planner.cost_model import LINK_LATENCY_S, StageSpec, decode_round_s, train_step_seconds
from planner.specs import Cluster, Efficiency, GPUType, SpecError, TypeEfficiency, Workload, model_from_config

# A device profile (exp/profiles/*.yaml, written by `schedule.py profile`) holds what one device achieved running
# torch and the runtime's own code, and the fractions of a cluster GPU type's nominal numbers those rates are: the
# TypeEfficiency of that type. A fraction must lie in (0, PROFILE_MAX_FRACTION] and an overhead in
# [0, PROFILE_MAX_OVERHEAD_S]: a device does not beat its own peak (the 20% slack is for turbo clocks and rounded-down
# nominal numbers), a negative fixed cost is a fit gone wrong, not a device, and so is a fixed cost of more than 10 s
# per decode or optimizer step (a second is already slow for host work). PROFILE_FRACTIONS and decode_overhead_s are
# required; the others are optional (an older profile, or a device where the profile did not measure them).
PROFILE_FRACTIONS = ("mfu_train", "mfu_infer", "hbm_eff")
PROFILE_OPTIONAL_FRACTIONS = ("mfu_decode",)
PROFILE_OVERHEADS = ("decode_overhead_s",)
PROFILE_OPTIONAL_DECODE_OVERHEADS = ("decode_multirow_s",)
PROFILE_OPTIONAL_OVERHEADS = ("train_overhead_s", "tp_overhead_s", "dp_overhead_s", "microbatch_overhead_s")
PROFILE_MAX_FRACTION = 1.2
PROFILE_MAX_OVERHEAD_S = 10.0
# tp_unsplit is a count of hidden-sized tensor passes per token, layer and training pass. A GPU's TP ranks replicate
# about 10-20 (each norm, residual add and dropout reads and writes one, forward and backward); a CPU core adds each
# op's host work, a few hundred at the tiny model's sizes. Past this a TP step's fit is noise or a broken step
PROFILE_MAX_TP_UNSPLIT = 2000.0
# decode_beside: a step's wall time beside one type's trainers over the CPU time the profile's decode fit prices it at,
# at the type's fraction. The throttle pads each step to its CPU time / fraction, so the wall is below that only
# where lighter neighbours leave the step less CPU work than the fit's points had (the bench: 0.91x alone, against
# the profile's mix) or the fit misses the step; under half of it, or past 4x (the rank got under a quarter of the
# core share it is emulated at), is an overloaded or noisy host
PROFILE_DECODE_BESIDE = (0.5, 4.0)
# the optimizer's bytes per parameter as train_step_seconds prices them (dp 1: fp32 master, grads, AdamW moments)
OPTIMIZER_BYTES_DP1 = 18 + 12


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = slope * x + intercept; returns (slope, intercept, r2). Needs two distinct xs."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"fit_line needs >= 2 (x, y) pairs, got {n}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 0:
        raise ValueError("fit_line needs at least two distinct x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    syy = sum((y - my) ** 2 for y in ys)
    sse = sum((y - slope * x - intercept) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, (1.0 - sse / syy) if syy > 0 else 1.0


def fit_rate(work: list[float], seconds: list[float], what: str) -> tuple[float, float, float]:
    """seconds = work / rate + overhead by least squares: (rate, overhead_s, r2). A slope <= 0 has no rate."""
    slope, intercept, r2 = fit_line(work, seconds)
    if slope <= 0:
        raise SpecError(
            f"profile: {what}: time does not grow with the work (slope {slope:.3g} s per unit); "
            "the machine was too noisy for this fit, run it again on a quieter one"
        )
    return 1.0 / slope, intercept, r2


def fit_rate_given_overhead(work: list[float], seconds: list[float], overhead: float, what: str) -> float:
    """The rate of seconds = work / rate + overhead with the overhead known, by least squares through it."""
    num = sum(w * (t - overhead) for w, t in zip(work, seconds))
    if not work or num <= 0:
        raise SpecError(
            f"profile: {what}: the steps are not longer than their fixed overhead ({overhead:.3g} s); "
            "the machine was too noisy for this fit, run it again on a quieter one"
        )
    return sum(w * w for w in work) / num


def fit_relative(rows: list[list[float]], ys: list[float]) -> list[float]:
    """x minimising sum(((row . x) - y) / y)^2 -- least squares on relative errors, so that points of a few ms and
    of a hundred weigh alike -- by the normal equations. Raises ValueError where the columns are linearly dependent."""
    n = len(rows[0])
    scaled = [[v / y for v in row] for row, y in zip(rows, ys)]
    norm = [max(abs(r[j]) for r in scaled) or 1.0 for j in range(n)]  # columns of bytes, FLOPs and 1 alike in size
    scaled = [[v / c for v, c in zip(r, norm)] for r in scaled]
    a = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] + [sum(r[i] for r in scaled)] for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda k: abs(a[k][col]))
        if abs(a[pivot][col]) <= 1e-9 * len(rows):
            raise ValueError("fit_relative: the columns are linearly dependent")
        a[col], a[pivot] = a[pivot], a[col]
        for k in range(n):
            if k != col:
                f = a[k][col] / a[col][col]
                a[k] = [u - f * v for u, v in zip(a[k], a[col])]
    return [a[i][n] / a[i][i] / norm[i] for i in range(n)]


def relative_rms(predicted: list[float], measured: list[float]) -> float:
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))


def _profile_number(d: dict, key: str, where: str, source: str) -> float:
    try:
        value = float(d[key])
    except (TypeError, ValueError):
        raise SpecError(f"{source}: {where}.{key} must be a number, got {d[key]!r}") from None
    if not math.isfinite(value):
        raise SpecError(f"{source}: {where}.{key} must be finite, got {value}")
    return value


def _check_overhead(value: float, key: str, where: str, source: str, what: str) -> None:
    if value < 0:
        raise SpecError(
            f"{source}: {where}.{key} = {value:.4g} s < 0 is not physically plausible ({what}); the fit was too "
            "noisy, profile again"
        )
    if value > PROFILE_MAX_OVERHEAD_S:
        raise SpecError(
            f"{source}: {where}.{key} = {value:.4g} s > {PROFILE_MAX_OVERHEAD_S:g} s is not physically plausible "
            f"({what}); the fit was too noisy, profile again"
        )


def check_profile_efficiency(eff: dict, source: str) -> TypeEfficiency:
    """The profile's TypeEfficiency, or one SpecError naming the first missing or implausible constant."""
    required = (*PROFILE_FRACTIONS, *PROFILE_OVERHEADS)
    if not isinstance(eff, dict):
        raise SpecError(f"{source}: 'efficiency' must be a mapping of {list(required)}")
    values = {}
    for key in required:
        if key not in eff:
            raise SpecError(f"{source}: missing 'efficiency.{key}'")
        values[key] = _profile_number(eff, key, "efficiency", source)
    for key in (*PROFILE_OPTIONAL_FRACTIONS, *PROFILE_OPTIONAL_OVERHEADS):
        if eff.get(key) is not None:
            values[key] = _profile_number(eff, key, "efficiency", source)
    for key in PROFILE_OPTIONAL_DECODE_OVERHEADS:
        if eff.get(key) is not None:
            values[key] = _profile_number(eff, key, "efficiency", source)
            _check_overhead(values[key], key, "efficiency", source, "a fixed cost per decode step")
    for key in (*PROFILE_FRACTIONS, *PROFILE_OPTIONAL_FRACTIONS):
        if key in values and not 0 < values[key] <= PROFILE_MAX_FRACTION:
            raise SpecError(
                f"{source}: efficiency.{key} = {values[key]:.4g} is not physically plausible: an achieved fraction "
                f"of the GPU type's nominal rate must lie in (0, {PROFILE_MAX_FRACTION}] (docs/planner.md, "
                "'Device profiles'); check the type's nominal tflops / hbm_tbps"
            )
    _check_overhead(
        values["decode_overhead_s"], "decode_overhead_s", "efficiency", source, "a fixed cost per decode step"
    )
    for key in PROFILE_OPTIONAL_OVERHEADS:
        if key in values:
            _check_overhead(values[key], key, "efficiency", source, "a fixed cost per optimizer step")
    if eff.get("tp_unsplit") is not None:
        values["tp_unsplit"] = _profile_number(eff, "tp_unsplit", "efficiency", source)
        if not 0 <= values["tp_unsplit"] <= PROFILE_MAX_TP_UNSPLIT:
            raise SpecError(
                f"{source}: efficiency.tp_unsplit = {values['tp_unsplit']:.4g} is not physically plausible: the "
                f"hidden-sized tensors a TP rank streams whole per token, layer and pass lie in "
                f"[0, {PROFILE_MAX_TP_UNSPLIT:g}] (docs/planner.md, 'Device profiles'); profile again"
            )
    beside = eff.get("decode_beside") or {}
    if not isinstance(beside, dict):
        raise SpecError(f"{source}: efficiency.decode_beside must map neighbour GPU types to numbers, got {beside!r}")
    values["decode_beside"] = {}
    for name in beside:
        factor = _profile_number(beside, name, "efficiency.decode_beside", source)
        lo, hi = PROFILE_DECODE_BESIDE
        if not lo <= factor <= hi:
            raise SpecError(
                f"{source}: efficiency.decode_beside.{name} = {factor:.4g} is not physically plausible: a decode "
                f"step's wall time over the CPU time its decode fit prices, at the type's fraction, lies in [{lo:g}, "
                f"{hi:g}] (docs/planner.md, 'Device profiles'); profile again on a quieter host"
            )
        values["decode_beside"][str(name)] = factor
    try:
        return TypeEfficiency(**values, decode_combine=eff.get("decode_combine", "max"))
    except SpecError as e:  # TypeEfficiency checks the form; say where it came from
        raise SpecError(f"{source}: efficiency.{e}") from None


def check_profile_sync(sync, source: str) -> tuple[float, float]:
    """(link_gbps, sync_latency_s) of a profile's `sync` section, or one SpecError naming the implausible one."""
    if not isinstance(sync, dict) or any(k not in sync for k in ("link_gbps", "sync_latency_s")):
        raise SpecError(f"{source}: 'sync' must be a mapping of link_gbps and sync_latency_s (schedule.py profile)")
    gbps = _profile_number(sync, "link_gbps", "sync", source)
    latency = _profile_number(sync, "sync_latency_s", "sync", source)
    if gbps <= 0:
        raise SpecError(f"{source}: sync.link_gbps = {gbps:.4g} GB/s is not physically plausible (must be > 0)")
    _check_overhead(latency, "sync_latency_s", "sync", source, "the fixed cost of one weight-sync transfer")
    return gbps, latency


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner reads from a device profile: the GPU type it is for, that type's efficiencies, and the
    nominal numbers those fractions are of (the achieved rates are fraction x nominal); optionally the weight-sync
    link its machine achieved (link_gbps: one hop of a bucket between two processes, sync_latency_s: a tiny one)."""

    gpu_type: str
    efficiency: TypeEfficiency
    tflops: float
    hbm_tbps: float
    link_gbps: float | None = None
    sync_latency_s: float | None = None
    # measured under the throttle of an emulated type (`schedule.py profile --gpu-type <emulated type>`): what that
    # type's pieces of work cost this machine after the throttle's pauses, so it applies to that type alone
    emulated: bool = False


def profile_from_dict(d: dict, source: str = "<profile>") -> DeviceProfile:
    """The DeviceProfile of a device profile's structure, checked: one SpecError names what is missing or wrong."""
    if not isinstance(d, dict):
        raise SpecError(f"{source}: a device profile is a mapping (schedule.py profile writes one)")
    for key in ("device", "gpu_type", "efficiency", "nominal"):
        if key not in d:
            raise SpecError(f"{source}: missing '{key}' (schedule.py profile writes it)")
    te = check_profile_efficiency(d["efficiency"], source)
    nominal = d["nominal"] if isinstance(d["nominal"], dict) else {}
    try:
        tflops, tbps = float(nominal["tflops"]), float(nominal["hbm_tbps"])
    except (KeyError, TypeError, ValueError):
        raise SpecError(f"{source}: 'nominal' needs numeric tflops and hbm_tbps (the fractions are of them)") from None
    if not (tflops > 0 and tbps > 0):
        raise SpecError(f"{source}: nominal tflops and hbm_tbps must be > 0")
    gbps = latency = None
    if d.get("sync") is not None:
        gbps, latency = check_profile_sync(d["sync"], source)
    emulated = d.get("emulate") is not None
    if emulated and not isinstance(d["emulate"], dict):
        raise SpecError(f"{source}: 'emulate' must be the mapping of fractions the profile was measured under")
    return DeviceProfile(str(d["gpu_type"]), te, tflops, tbps, gbps, latency, emulated)


def load_profile(path: str | os.PathLike) -> DeviceProfile:
    p = Path(path)
    if not p.exists():
        raise SpecError(f"device profile not found: {path}")
    with open(p) as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise SpecError(f"{path}: not YAML ({e})") from None
    return profile_from_dict(d, str(p))


def apply_profile(eff: Efficiency, cluster: Cluster, prof: DeviceProfile, source: str) -> Efficiency:
    """eff with prof.gpu_type's constants replaced by the profile's. The type must be one of the cluster's, or the
    cluster must emulate device types (emulation.py): those are fractions of the machine that ran the profile, so a
    profile of another type of this machine (exp/profiles/cpu.yaml) applies to each of them (the cluster's HostSpeeds then
    prices the fractions); a profile of an emulated type itself (`schedule.py profile --gpu-type <it>`, measured
    under its throttle, normalised to the machine) applies to it alone -- give it after the machine's, whose
    training constants it keeps (its own training ran unthrottled: a second reading of the same machine). Where the
    cluster gives a type other nominal numbers than the profile's, the fractions are rescaled so that the achieved rates
    (fraction x nominal) stay the measured ones. A profile with a `sync` section also sets the weight-sync
    constants, which are the cluster's (Efficiency.link_eff, sync_latency_s): link_eff = the measured GB/s over the
    type's intra_gbps, so that the achieved bandwidth of a bucket hop is the measured one."""
    emulated = [name for name in cluster.gpu_types if name in cluster.speeds.emulated]
    if prof.emulated and prof.gpu_type not in emulated:
        raise SpecError(
            f"{source}: a profile measured under the throttle of emulated type '{prof.gpu_type}' applies to that "
            f"type only, and cluster {cluster.name} has no such emulated type (its emulated types: {emulated})"
        )
    targets = [prof.gpu_type] if prof.gpu_type in cluster.gpu_types else sorted(emulated)
    if not targets:
        raise SpecError(
            f"{source}: gpu_type '{prof.gpu_type}' is not a GPU type of cluster {cluster.name} "
            f"{sorted(cluster.gpu_types)}"
        )
    te = prof.efficiency
    out = Efficiency.from_dict(eff.to_dict())
    for name in targets:
        g = cluster.gpu_types[name]
        flops, bw = prof.tflops / g.tflops, prof.hbm_tbps / g.hbm_tbps
        typed = TypeEfficiency(
            mfu_train=te.mfu_train * flops,
            mfu_infer=te.mfu_infer * flops,
            hbm_eff=te.hbm_eff * bw,
            decode_overhead_s=te.decode_overhead_s,
            decode_multirow_s=te.decode_multirow_s,
            train_overhead_s=te.train_overhead_s,
            mfu_decode=None if te.mfu_decode is None else te.mfu_decode * flops,
            decode_combine=te.decode_combine,
            tp_unsplit=te.tp_unsplit,
            tp_overhead_s=te.tp_overhead_s,
            dp_overhead_s=te.dp_overhead_s,
            microbatch_overhead_s=te.microbatch_overhead_s,
            decode_beside=dict(te.decode_beside),
        )
        if prof.emulated and name in eff.per_type:
            # a type profile's training is unthrottled, another reading of this machine's: the machine profile's
            # stays, one measurement for every type, so their training costs keep the ratio of their fractions
            # (a TP step's unsplit work is measured there too, at the decode bandwidth it was fitted with)
            prior = eff.per_type[name]
            typed = replace(
                typed,
                mfu_train=prior.mfu_train,
                train_overhead_s=prior.train_overhead_s,
                tp_unsplit=prior.tp_unsplit * typed.hbm_eff / prior.hbm_eff,
                tp_overhead_s=prior.tp_overhead_s,
                dp_overhead_s=prior.dp_overhead_s,
                microbatch_overhead_s=prior.microbatch_overhead_s,
            )
        out.per_type[name] = typed
    if prof.link_gbps is not None:
        out.link_eff = prof.link_gbps / cluster.gpu_types[targets[0]].intra_gbps
        out.sync_latency_s = prof.sync_latency_s
    return out


def tp_unsplit_fit(
    tp_steps: dict | None,
    train_rate: float,
    optimizer_s: float,
    train_overhead_s: float,
    bw: float,
    microbatch_overhead_s: float = 0.0,
) -> tuple[float, float] | None:
    """(tp_unsplit, tp_overhead_s) from a profile's TP steps (device_profile._profile_train_parallel): what each step took
    beyond what train_step_seconds charges a TP rank without them -- the fitted FLOP rate's FLOPs / tp, the optimizer
    over 1/tp of the parameters, the fixed seconds per optimizer step and per micro-batch, the all-reduces over the
    type's intra link --
    is e = optimizer_steps * tp_overhead_s + tp_unsplit * x, x = (1 - 1/tp) of the step's hidden-sized tensor
    passes at the fitted decode bandwidth `bw` (B/s): least squares over the steps, both terms >= 0 (one step: all
    of it per token). So the cost model gives back the measured steps. None without TP steps."""
    if not tp_steps or not tp_steps.get("points"):
        return None
    tp, layers, hidden = tp_steps["tp"], tp_steps["layers"], tp_steps["hidden"]
    passes, nbytes, opt_steps = tp_steps["passes"], tp_steps["bytes"], tp_steps["optimizer_steps"]
    xs, es = [], []
    for p in tp_steps["points"]:
        tokens = p["tokens"]
        microbatches = opt_steps * math.ceil(tokens / opt_steps / tp_steps["micro_batch_tokens"])
        ring = 2 * (tp - 1) / tp * tokens * hidden * nbytes / (tp_steps["intra_gbps"] * 1e9)
        all_reduce = 2 * passes * layers * (microbatches * LINK_LATENCY_S + ring)
        charged = p["flops"] / (tp * train_rate) + opt_steps * (optimizer_s / tp + train_overhead_s) + all_reduce
        charged += microbatches * microbatch_overhead_s
        xs.append((1 - 1 / tp) * passes * tokens * layers * hidden * nbytes / bw)
        es.append(p["step_s"] - charged)
    unsplit, fixed = (fit_line(xs, es)[:2]) if len(set(xs)) > 1 else (0.0, -1.0)
    if unsplit < 0:  # no growth with the tokens: all of it per optimizer step
        unsplit, fixed = 0.0, max(0.0, sum(es) / len(es))
    elif fixed < 0:  # all of it per token, through the origin
        unsplit, fixed = max(0.0, sum(e * x for e, x in zip(es, xs)) / sum(x * x for x in xs)), 0.0
    return unsplit, fixed / opt_steps


def dp_overhead_fit(dp_steps: dict | None, gpu: GPUType, te: TypeEfficiency) -> float | None:
    """dp_overhead_s from a profile's DP steps (device_profile._profile_train_parallel at dp > 1): the mean over the
    steps of what each took beyond what train_step_seconds charges a DP rank for it with the profile's other
    constants `te` (1/dp of the FLOPs, the optimizer, the fixed seconds per optimizer step, the gradient all-reduce
    over the type's intra link), per optimizer step and >= 0 (DP steps no slower than that: nothing to add). So the
    cost model gives back the measured steps on average. None without DP steps."""
    if not dp_steps or not dp_steps.get("points"):
        return None
    model = model_from_config(dp_steps["model_config"], "profiled")
    dp, opt_steps = int(dp_steps["dp"]), int(dp_steps["optimizer_steps"])
    stage = StageSpec(gpu.name, model.layers, (0,), gpu.intra_gbps, float(dp_steps["intra_gbps"]), 0.0)
    eff = Efficiency(per_type={gpu.name: replace(te, dp_overhead_s=0.0)})
    extra = []
    for p in dp_steps["points"]:
        wl = Workload(
            prompts_per_step=int(p["trajectories"]),
            samples_per_prompt=1,
            prompt_len=float(p["prompt"]),
            gen_samples=[float(p["response"])],
            precision="fp32",
            ppo_minibatches=opt_steps,
            microbatch_tokens=int(dp_steps["micro_batch_tokens"]),
            train_passes=float(dp_steps["passes"]),
        )
        extra.append(p["step_s"] - train_step_seconds(model, [stage], dp, 1, {gpu.name: gpu}, wl, eff))
    return max(0.0, sum(extra) / len(extra)) / opt_steps


def finish_profile(out: dict, gpu: GPUType, log=print, elapsed: float = 0.0, measured_nominal: bool = False) -> dict:
    """Fit the measured points (device_profile.profile_device's structure) and add `measured`, `nominal`, `fractions`,
    `efficiency` (the TypeEfficiency of `gpu` the planner reads) and, when the link was measured, `sync`; then check
    them (check_profile_efficiency, check_profile_sync).
      decode    the points memory-bound by the raw GEMM / copy rates: step = bytes / bandwidth + overhead (hbm_eff,
                decode_overhead_s); the points compute-bound by those rates: step = FLOPs / rate + that overhead
                (mfu_decode; absent without two such points). With those, also step = bytes / bandwidth +
                FLOPs / rate + overhead over every point (relative least squares): where that fits the points better
                -- reads and arithmetic serialised, as on a CPU core -- its constants and decode_combine "sum" are
                the profile's
      prefill   step = FLOPs / rate + c (mfu_infer)
      train     step = FLOPs / rate + c (mfu_train). A point is one Trainer.train_step of `optimizer_steps` optimizer
                steps (its PPO minibatches), so c / optimizer_steps is what one optimizer step costs besides the FLOPs;
                train_overhead_s is that less what train_step_seconds already charges for the optimizer of the
                profiled model (its `params` at OPTIMIZER_BYTES_DP1 bytes each over the decode bandwidth) and less
                one micro-batch's fixed part: the line goes through the points of one micro-batch per minibatch, and
                a point packed into more (`microbatches`) gives microbatch_overhead_s, what each extra one cost
      train_tp  (optional) train points as tensor-parallel steps: tp_unsplit, tp_overhead_s (tp_unsplit_fit)
      train_dp  (optional) train points as data-parallel steps: dp_overhead_s (dp_overhead_fit)
      link      one weight-sync bucket hop between two processes, as a train rank waits for it (fill a buffer,
                checksum it, send; the receiver takes it): hop = bytes / bandwidth (sync.link_gbps); a tiny hop is
                the fixed cost (sync.sync_latency_s)
    `measured_nominal` (a device with no spec sheet, e.g. a CPU core): the nominal numbers are the fastest FLOP rate
    and bandwidth the profile saw, over the GEMM / copy points and the fitted rates alike. A fit's marginal rate can
    outrun the GEMM shapes (a CPU core's small, cache-resident matmuls run faster than large ones, and the host's
    speed drifts between points), and only the fractions change with the nominal: the rates the planner uses do not."""
    gemm_rate, copy_rate = out["gemm_tflops"] * 1e12, out["copy_tbps"] * 1e12
    for p in out["decode"]:  # memory-bound by the raw rates: the bandwidth fit uses only those points
        p["memory_bound"] = bool(p["flops"] / gemm_rate < 0.5 * p["bytes"] / copy_rate)
        p["compute_bound"] = bool(p["flops"] / gemm_rate > p["bytes"] / copy_rate)
    use = [p for p in out["decode"] if p["memory_bound"]]
    if len({p["bytes"] for p in use}) < 2:
        use = [p for p in out["decode"] if not p["compute_bound"]] or out["decode"]
    bw, overhead, r2_decode = fit_rate([p["bytes"] for p in use], [p["step_s"] for p in use], "decode")
    compute = [p for p in out["decode"] if p["compute_bound"]]
    decode_rate = None
    if len(compute) >= 2:
        decode_rate = fit_rate_given_overhead(
            [p["flops"] for p in compute], [p["step_s"] for p in compute], overhead, "decode (compute-bound steps)"
        )
    # the two ways a decode step's reads and arithmetic combine (TypeEfficiency.decode_combine), each fitted to every
    # decode point, the points spanning one row to a full batch: the one with the smaller relative error is the device's
    combine, steps, multirow_s = "max", [p["step_s"] for p in out["decode"]], 0.0
    rms = {}
    if decode_rate is not None:
        rms["max"] = relative_rms(
            [overhead + max(p["bytes"] / bw, p["flops"] / decode_rate) for p in out["decode"]], steps
        )

        # the serialised form, with a fixed part a step of more rows costs besides (decode_multirow_s: a core's GEMM
        # path against its one-row matrix-vector path) where the points have both kinds of step and it comes out
        # >= 0; else without it
        def multirow(p: dict) -> float:
            return float(p["batch"] > 1)

        def sum_fit(features):
            try:
                x = fit_relative([[f(p) for f in features] for p in out["decode"]], steps)
            except ValueError:
                return None
            return x if min(x) >= 0 and x[0] > 0 and x[1] > 0 else None

        base = (lambda p: p["bytes"], lambda p: p["flops"], lambda p: 1.0)
        both = len({multirow(p) for p in out["decode"]}) == 2
        fit = (sum_fit((*base, multirow)) if both else None) or sum_fit(base)
        if fit is not None:
            per_byte, per_flop, c, *rest = fit
            extra = rest[0] if rest else 0.0
            rms["sum"] = relative_rms(
                [c + p["bytes"] * per_byte + p["flops"] * per_flop + extra * multirow(p) for p in out["decode"]],
                steps,
            )
            if rms["sum"] < rms["max"]:
                combine, bw, overhead, decode_rate, multirow_s = "sum", 1.0 / per_byte, c, 1.0 / per_flop, extra
    prefill_rate, prefill_c, r2_prefill = fit_rate(
        [p["flops"] for p in out["prefill"]], [p["step_s"] for p in out["prefill"]], "prefill"
    )
    # the line through the steps of one micro-batch per minibatch; the same FLOPs packed finer (`microbatches` > 1)
    # cost each extra micro-batch's fixed part: microbatch_overhead_s
    train = [p for p in out["train"] if p.get("microbatches", 1) == 1]
    split = [p for p in out["train"] if p.get("microbatches", 1) > 1]
    train_rate, train_c, r2_train = fit_rate([p["flops"] for p in train], [p["step_s"] for p in train], "train")
    opt_steps = train[0].get("optimizer_steps", 1)
    # the parameters the cost model's optimizer term charges (a profile before this key: all of them)
    key = "optimizer_params" if "optimizer_params" in train[0] else "params"
    params = train[0].get(key, 0)
    if any(p.get("optimizer_steps", 1) != opt_steps or p.get(key, 0) != params for p in train):
        raise SpecError("profile: the train points must share one model and one number of optimizer steps")
    optimizer_s = params * OPTIMIZER_BYTES_DP1 / bw  # what train_step_seconds charges per optimizer step (dp 1)
    # what one optimizer step costs beyond that. A negative intercept is a noisy fit (refused below); an intercept
    # smaller than the optimizer term means that term already covers the whole fixed cost (a fused optimizer
    # streams fewer bytes than OPTIMIZER_BYTES_DP1): nothing to add
    microbatch_overhead = None
    if split:
        extra = [
            (p["step_s"] - p["flops"] / train_rate - train_c) / (opt_steps * (p["microbatches"] - 1)) for p in split
        ]
        microbatch_overhead = max(0.0, sum(extra) / len(extra))
    # the intercept holds one micro-batch's fixed part per optimizer step; the cost model charges that per micro-batch
    train_overhead = train_c / opt_steps - optimizer_s - (microbatch_overhead or 0.0)
    if train_c >= 0:
        train_overhead = max(0.0, train_overhead)
    tp_fit = tp_unsplit_fit(
        out.get("train_tp"), train_rate, optimizer_s, train_overhead, bw, microbatch_overhead or 0.0
    )
    if measured_nominal:
        rates = {"the GEMM points": gemm_rate, "the prefill fit": prefill_rate, "the train fit": train_rate}
        rates |= {} if decode_rate is None else {"the decode fit": decode_rate}
        streams = {"the copy points": copy_rate, "the decode fit": bw}
        fastest, fastest_stream = max(rates, key=rates.get), max(streams, key=streams.get)
        gpu = replace(gpu, tflops=rates[fastest] / 1e12, hbm_tbps=streams[fastest_stream] / 1e12)
        if (fastest, fastest_stream) != ("the GEMM points", "the copy points"):
            log(f"nominal: the fastest rates measured: FLOP/s from {fastest}, bandwidth from {fastest_stream}")
    peak, hbm = gpu.tflops * 1e12, gpu.hbm_tbps * 1e12
    out["measured"] = {
        "gemm_tflops": out["gemm_tflops"],
        "copy_tbps": out["copy_tbps"],
        "decode_tbps": bw / 1e12,
        "decode_overhead_s": overhead,
        "decode_multirow_s": multirow_s,
        "decode_fit_points": len(out["decode"]) if combine == "sum" else len(use),
        "decode_r2": r2_decode,
        **({} if decode_rate is None else {"decode_tflops": decode_rate / 1e12, "decode_compute_points": len(compute)}),
        "decode_combine": combine,
        **{f"decode_rel_rms_{k}": v for k, v in rms.items()},
        "prefill_tflops": prefill_rate / 1e12,
        "prefill_overhead_s": prefill_c,
        "prefill_r2": r2_prefill,
        "train_tflops": train_rate / 1e12,
        "train_overhead_s": train_c,
        "train_r2": r2_train,
        "train_optimizer_steps": opt_steps,
        "train_model_optimizer_s": optimizer_s,
        **({} if tp_fit is None else {"train_tp_unsplit": tp_fit[0], "train_tp_overhead_s": tp_fit[1]}),
    }
    out["nominal"] = {"gpu_type": gpu.name, "tflops": gpu.tflops, "hbm_tbps": gpu.hbm_tbps}
    out["fractions"] = {"gemm": gemm_rate / peak, "copy": copy_rate / hbm}  # of the nominal peaks (diagnostic)
    out["efficiency"] = {
        "mfu_train": train_rate / peak,
        "mfu_infer": prefill_rate / peak,
        "hbm_eff": bw / hbm,
        "decode_overhead_s": overhead,
        **({} if not multirow_s else {"decode_multirow_s": multirow_s}),
        "train_overhead_s": train_overhead,
        **({} if decode_rate is None else {"mfu_decode": decode_rate / peak}),
        **({} if combine == "max" else {"decode_combine": combine}),
        **({} if tp_fit is None else {"tp_unsplit": tp_fit[0], "tp_overhead_s": tp_fit[1]}),
        **({} if microbatch_overhead is None else {"microbatch_overhead_s": microbatch_overhead}),
    }
    if microbatch_overhead is not None:
        out["measured"]["train_microbatch_overhead_s"] = microbatch_overhead
    beside = decode_beside_fit(out.get("decode_beside"), gpu, TypeEfficiency(**out["efficiency"]))
    if beside:
        out["efficiency"]["decode_beside"] = beside
    dp_fit = dp_overhead_fit(out.get("train_dp"), gpu, TypeEfficiency(**out["efficiency"]))
    if dp_fit is not None:
        out["measured"]["train_dp_overhead_s"] = out["efficiency"]["dp_overhead_s"] = dp_fit
    link = out.get("link")
    if link:
        link_rate, link_c, r2_link = fit_rate(
            [p["bytes"] for p in link["points"]], [p["hop_s"] for p in link["points"]], "link"
        )
        out["measured"].update(
            link_gbps=link_rate / 1e9, link_latency_s=link["latency_s"], link_intercept_s=link_c, link_r2=r2_link
        )
        out["sync"] = {"link_gbps": link_rate / 1e9, "sync_latency_s": link["latency_s"]}
    out["seconds"] = elapsed
    m, e = out["measured"], out["efficiency"]
    fits = ", ".join(f"{k} {v:.1%}" for k, v in rms.items())
    if combine == "sum":
        log(
            f"decode:  bytes / {m['decode_tbps'] * 1e3:.2f} GB/s + FLOPs / {decode_rate / 1e9:.2f} GFLOP/s + "
            f"{m['decode_overhead_s'] * 1e3:.3f} ms/step + {multirow_s * 1e3:.3f} ms for more than one row (reads and "
            "arithmetic serialised: least squares over all "
            f"{len(out['decode'])} points; relative rms {fits})"
        )
    else:
        log(
            f"decode:  {m['decode_tbps'] * 1e3:9.2f} GB/s + {m['decode_overhead_s'] * 1e3:.3f} ms/step "
            f"(least squares over {len(use)} memory-bound points, r2 {r2_decode:.3f})"
        )
        if decode_rate is not None:
            log(
                f"decode:  {decode_rate / 1e9:9.2f} GFLOP/s on {len(compute)} compute-bound points (+ the same "
                f"overhead; relative rms {fits})"
            )
    log(f"prefill: {m['prefill_tflops'] * 1e3:9.2f} GFLOP/s + {prefill_c * 1e3:.2f} ms (r2 {r2_prefill:.3f})")
    log(
        f"train:   {m['train_tflops'] * 1e3:9.2f} GFLOP/s + {train_c * 1e3:.2f} ms/step of {opt_steps} optimizer "
        f"step(s) (r2 {r2_train:.3f}): {e['train_overhead_s'] * 1e3:.2f} ms per optimizer step besides the "
        f"{optimizer_s * 1e3:.2f} ms the cost model's optimizer term charges"
    )
    if tp_fit is not None:
        log(
            f"train:   a tp {out['train_tp']['tp']} rank streams {tp_fit[0]:.1f} hidden-sized tensors per token, layer "
            f"and pass that TP does not divide (tp_unsplit) and spends {tp_fit[1] * 1e3:.2f} ms more per optimizer "
            "step (tp_overhead_s)"
        )
    if microbatch_overhead is not None:
        log(
            f"train:   {microbatch_overhead * 1e3:.2f} ms per micro-batch besides its FLOPs (microbatch_overhead_s: the "
            f"step packed into {split[0]['microbatches']} micro-batches per minibatch instead of 1)"
        )
    if beside:
        log(
            "decode:  a replica's step beside each type's trainers, its wall over the fit's CPU price at the fraction "
            "(decode_beside): " + ", ".join(f"{k} {v:.3f}" for k, v in beside.items())
        )
    if dp_fit is not None:
        log(
            f"train:   a dp {out['train_dp']['dp']} rank spends {dp_fit * 1e3:.2f} ms more per optimizer step than "
            "1/dp of the step and the gradient all-reduce (dp_overhead_s)"
        )
    if link:
        log(
            f"link:    {m['link_gbps']:9.3f} GB/s per bucket hop + {m['link_latency_s'] * 1e3:.3f} ms for a tiny one "
            f"(r2 {m['link_r2']:.3f})"
        )
    log(
        f"{gpu.name} ({gpu.tflops:g} TFLOP/s, {gpu.hbm_tbps:g} TB/s nominal): mfu_train {e['mfu_train']:.3f}, "
        f"mfu_infer {e['mfu_infer']:.3f}, hbm_eff {e['hbm_eff']:.3f}, decode_overhead_s {e['decode_overhead_s']:.3g}, "
        f"train_overhead_s {e['train_overhead_s']:.3g}"
        + ("" if decode_rate is None else f", mfu_decode {e['mfu_decode']:.3f}")
        + f" (gemm {out['fractions']['gemm']:.3f}, copy {out['fractions']['copy']:.3f} of nominal)"
    )
    where = f"profile of {out['device']} as {gpu.name}"
    check_profile_efficiency(e, where)
    if "sync" in out:
        check_profile_sync(out["sync"], where)
    return out


def decode_beside_fit(measured: dict | None, gpu: GPUType, te: TypeEfficiency) -> dict[str, float]:
    """TypeEfficiency.decode_beside from a profile's `decode_beside` points (cpu_bench/co_load.decode_beside): for each
    neighbour type, the step's measured wall seconds over what the profile's own decode constants `te` price that
    step's CPU work at (decode_round_s of its model, batch and context on `gpu`) at the type's bandwidth fraction.
    So the fit gives how a step's cost moves with the model, batch and context, and these points, each timed over
    several of its neighbours' steps, give its level beside each type's trainers. {} without the points."""
    if not measured or not measured.get("points"):
        return {}
    spec = model_from_config(measured["model_config"])
    cpu_s = decode_round_s(
        spec, gpu, te, 1, 1, measured["batch"], measured["context"], measured["bytes"], gpu.intra_gbps
    )
    return {name: p["wall_s"] / (cpu_s / measured["fraction"]) for name, p in measured["points"].items()}
