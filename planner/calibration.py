"""Efficiency constants from measurements that are not a device profile: `schedule.py calibrate` fits them to one
measured run of a plan (calibrate), and `schedule.py calibrate --profile-cpu` to a numpy matmul / memcpy (profile_cpu).
"""

from __future__ import annotations

import math

from planner import specs
from planner.search import Planner
from planner.specs import Efficiency


def profile_cpu(seconds: float = 1.5) -> dict[str, float]:
    """Measure one process's matmul FLOP/s and memcpy bandwidth with numpy (< `seconds` in total)."""
    import time

    import numpy as np

    n = 256
    a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        a @ b
        reps += 1
    tflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    src = np.ones(8 * 1024 * 1024, dtype=np.float32)
    dst = np.empty_like(src)
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds / 2:
        np.copyto(dst, src)
        reps += 1
    tbps = 2 * src.nbytes * reps / (time.perf_counter() - t0) / 1e12
    return {"tflops": tflops, "hbm_tbps": tbps}


def calibrate(points: list[tuple[Planner, tuple[int, ...], dict]], base: Efficiency | None = None) -> Efficiency:
    """Fit per-type mfu_train / hbm_eff / mfu_infer and the sync link_eff / latency to measured timings.
    points: (planner, per-machine trainer counts, {"rollout_s", "train_s", "sync_s"} measured, any subset); a
    measured sync_s is the train side's (a run's weight_sync_s: until its sends are done), fitted to train_sync_s.
    Phase 1 is re-run on the fixed partition for every trial so layouts follow the constants."""
    eff = Efficiency.from_dict((base or Efficiency()).to_dict())
    types = sorted({t for p, _, _ in points for t in p.types})
    for t in types:
        eff.per_type.setdefault(t, specs.TypeEfficiency(**vars(eff.of(t))))

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
        for _ in range(rounds):  # coordinate descent, golden section in log space
            for f in fields:

                def at(x: float, field: str = f) -> float:
                    for t in types:
                        setattr(eff.per_type[t], field, math.exp(x))
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
    sync = [
        (p, type(p)(p.cluster, p.model, p.wl, eff, p.max_seconds).evaluate(c).train_sync_s, m["sync_s"])
        for p, c, m in points
        if "sync_s" in m
    ]
    if sync:
        # predicted sync = latency + GB / (link_eff * bw): recover bw per point, then least squares on (latency, 1/eff)
        xs = [(s - eff.sync_latency_s) * eff.link_eff for _, s, _ in sync]  # = bytes / link bandwidth
        ys = [meas for _, _, meas in sync]
        if len(sync) >= 2 and max(xs) > min(xs):
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            eff.link_eff, eff.sync_latency_s = 1 / max(slope, 1e-6), max(0.0, my - slope * mx)
        else:  # one point: keep latency <= half the measurement
            eff.sync_latency_s = min(eff.sync_latency_s, 0.5 * ys[0])
            eff.link_eff = xs[0] / (ys[0] - eff.sync_latency_s)
        eff.link_eff = min(max(eff.link_eff, 1e-3), 1.0)  # a fraction of nominal bandwidth
    eff.per_type["*"] = specs.TypeEfficiency(**vars(eff.per_type[types[0]]))
    return eff
