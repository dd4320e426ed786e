"""Discrete-event simulator of the asynchronous RL pipeline for any plan JSON from schedule.py.

    python exp/simulate.py --plan plan.json --steps 20 --eta 4
    python exp/simulate.py --plan plan.json --eta-sweep 0,1,2,4,8,16

Model (AReaL §4-5 on top of the planner's costs, no formula duplicated here: decode step times come from
cost_model.decode_round_s, training and sync times from the plan's predictions):
  - each rollout replica runs continuous batching up to its memory-limited batch; one decode round of n
    running sequences takes round_s(n); a sequence of g tokens finishes after g rounds;
  - admission control: a new request is admitted only while floor((N_r - 1) / B) <= v + eta
    (N_r = requests admitted so far including the new one, v = trainer version, B = sequences per step);
    admitted requests go to the replica with the most free batch slots relative to its size;
  - the trainer consumes the B finished samples admitted earliest; a step takes train_s scaled by its tokens;
  - after each step both sides pause for the weight sync; running sequences are interrupted, their KV is
    recomputed with the new weights (prefill of the held context), then decoding continues;
  - staleness of a sample = trainer version at consumption - version at admission.
Because rounds advance every running sequence by one token, a replica keeps one "progress" clock and each
sequence its finishing progress, so an event costs O(replicas) and 20 steps of 10^4 requests run in a second.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cost_model as cm  # noqa: E402


@dataclass
class Replica:
    batch: int
    round_s: list[float]                 # round_s[n] for n running sequences (index 0 unused)
    prefill_s_per_token: float
    progress: float = 0.0                # decode rounds done so far
    paused_until: float = 0.0
    running: list = field(default_factory=list)   # heap of (finish progress, seq id)
    busy_s: float = 0.0

    def rate(self) -> float:             # rounds per second with the current batch
        return 1.0 / self.round_s[len(self.running)] if self.running else 0.0


@dataclass
class Seq:
    admitted_version: int
    prompt: float
    gen: float


def _inputs(plan: dict, workload: cm.Workload | dict | None, eta: int | None):
    inp = plan["inputs"]
    cluster = cm.cluster_from_dict(inp["cluster"], "plan.inputs.cluster")
    model = cm.model_from_config(inp["model"])
    wl = workload if isinstance(workload, cm.Workload) else cm.Workload(**(workload or inp["workload"]))
    if eta is not None:
        wl = cm.Workload(**{**wl.to_dict(), "eta": eta})
    return cluster, model, wl, cm.Efficiency.from_dict(inp["efficiency"])


def build_replicas(plan: dict, cluster: cm.Cluster, model: cm.ModelSpec, wl: cm.Workload, eff: cm.Efficiency,
                   decode_s_per_token: float | None = None,
                   prefill_s_per_token: float | None = None) -> list[Replica]:
    """Per-replica round-time curves from the cost model; a measured decode time per generated token
    (replica time / tokens at its full batch) rescales each curve to match the measurement, and a measured
    prefill time per prompt/recomputed token replaces the cost model's."""
    out = []
    for rep in plan["rollout"]["replicas"]:
        gpu, te = cluster.gpu(rep["gpu_type"]), eff.of(rep["gpu_type"])
        link = gpu.intra_gbps
        curve = [0.0] + [cm.decode_round_s(model, gpu, te, rep["tp"], rep["pp"], n, wl.decode_context, wl.bytes, link)
                         for n in range(1, rep["batch"] + 1)]
        if decode_s_per_token is not None:
            scale = decode_s_per_token * rep["batch"] / curve[rep["batch"]]
            curve = [c * scale for c in curve]
        prefill = prefill_s_per_token if prefill_s_per_token is not None else \
            2 * model.params / (rep["tp"] * rep["pp"] * gpu.tflops * 1e12 * te.mfu_infer)
        out.append(Replica(rep["batch"], curve, prefill))
    if not out:
        raise ValueError("plan has no rollout replicas")
    return out


def simulate(plan: dict, workload: cm.Workload | dict | None = None, steps: int = 20, eta: int | None = None,
             seed: int = 0, decode_s_per_token: float | None = None, train_s_per_token: float | None = None,
             sync_s: float | None = None, warmup: int = 2, prefill_s_per_token: float | None = None) -> dict:
    """Run `steps` trainer steps; report mean step time, tokens/s, idle fractions and staleness."""
    if steps < warmup + 1:
        raise ValueError(f"steps must exceed warmup ({warmup}), got {steps}")
    cluster, model, wl, eff = _inputs(plan, workload, eta)
    rng = random.Random(seed)
    replicas = build_replicas(plan, cluster, model, wl, eff, decode_s_per_token, prefill_s_per_token)
    B = wl.batch
    mean_tokens = wl.prompt_len + wl.gen_mean
    train_per_token = train_s_per_token if train_s_per_token is not None else \
        plan["predicted"]["train_s"] / (B * mean_tokens)
    sync = plan["predicted"]["sync_s"] if sync_s is None else sync_s

    seqs: list[Seq] = []
    finished: list[int] = []             # seq ids, FIFO = oldest first
    admitted = version = 0
    now = 0.0
    train_end = None                     # time the running train step ends
    train_busy = 0.0
    trainer_ready_at = 0.0
    step_times, step_tokens, staleness = [], [], []

    def admit() -> None:
        nonlocal admitted
        while (admitted) // B <= version + wl.eta:          # floor((N_r - 1) / B) <= v + eta, N_r = admitted + 1
            free = [r for r in replicas if len(r.running) < r.batch]
            if not free:
                return
            rep = min(free, key=lambda r: (len(r.running) / r.batch, -r.batch))
            sid = len(seqs)
            seqs.append(Seq(version, wl.prompt_len, float(rng.choice(wl.gen_samples))))
            heapq.heappush(rep.running, (rep.progress + seqs[sid].gen, sid))
            # the samples of a group share their prompt's K/V: the generator prefills it once
            if admitted % wl.samples_per_prompt == 0:
                rep.paused_until = max(rep.paused_until, now) + seqs[sid].prompt * rep.prefill_s_per_token
            admitted += 1

    admit()
    while len(step_times) < steps:
        # next event: a sequence finishing on some replica, or the train step ending
        nxt, who = train_end if train_end is not None else float("inf"), None
        for r in replicas:
            if r.running:
                start = max(now, r.paused_until)
                t = start + (r.running[0][0] - r.progress) * r.round_s[len(r.running)]
                if t < nxt:
                    nxt, who = t, r
        if nxt == float("inf"):
            raise RuntimeError("simulation stalled: no running sequence and no train step (check eta / batch)")
        for r in replicas:                                    # advance every replica to `nxt`
            start = max(now, r.paused_until)
            if r.running and nxt > start:
                r.progress += (nxt - start) * r.rate()
                r.busy_s += nxt - start
        now = nxt
        if who is not None:
            while who.running and who.running[0][0] <= who.progress + 1e-9:
                finished.append(heapq.heappop(who.running)[1])
        elif train_end is not None and now >= train_end:
            train_end = None
            version += 1
            step_times.append(now)
            for r in replicas:                                # weight sync: pause, interrupt, recompute KV
                held = sum(seqs[sid].prompt + seqs[sid].gen - (fin - r.progress) for fin, sid in r.running)
                r.paused_until = max(r.paused_until, now) + sync + held * r.prefill_s_per_token
            trainer_ready_at = now + sync
        if train_end is None and len(finished) >= B:
            finished.sort()                                   # prefer the oldest admitted samples
            batch, finished[:] = finished[:B], finished[B:]
            tokens = sum(seqs[s].prompt + seqs[s].gen for s in batch)
            staleness += [version - seqs[s].admitted_version for s in batch]
            start = max(now, trainer_ready_at)
            train_end = start + tokens * train_per_token
            train_busy += train_end - start
            step_tokens.append(tokens)
        admit()

    if train_end is not None:                                 # don't count a step still running at the end
        train_busy -= max(0.0, train_end - now)
    t0, t1 = step_times[warmup - 1], step_times[-1]
    span = t1 - t0
    hist: dict[int, int] = {}
    for s in staleness:
        hist[s] = hist.get(s, 0) + 1
    total_replica_s = len(replicas) * now
    return {"steps": steps, "eta": wl.eta, "step_s": span / (steps - warmup),
            "tokens_per_s": sum(step_tokens[warmup:steps]) / span,
            "rollout_idle_frac": 1 - sum(r.busy_s for r in replicas) / total_replica_s,
            "trainer_idle_frac": 1 - train_busy / now,
            "staleness": {"mean": sum(staleness) / len(staleness), "max": max(staleness),
                          "hist": {str(k): v for k, v in sorted(hist.items())}},
            "predicted_step_s": plan["predicted"]["step_s"], "sim_seconds": now}


def predict_from_measured(plan: dict, decode_s_per_token: float, train_s_per_token: float,
                          sync_s: float | None = None, steps: int = 12, eta: int | None = None,
                          workload: cm.Workload | dict | None = None, seed: int = 0) -> dict:
    """Validation hook: a short profile of a run gives seconds per generated token of one replica at full
    batch and trainer seconds per token; predict that run's step time and tokens/s."""
    res = simulate(plan, workload, steps=steps, eta=eta, seed=seed, decode_s_per_token=decode_s_per_token,
                   train_s_per_token=train_s_per_token, sync_s=sync_s)
    return {"step_s": res["step_s"], "tokens_per_s": res["tokens_per_s"], "simulation": res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Simulate the asynchronous RL pipeline of a plan JSON.")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eta", type=int, default=None)
    ap.add_argument("--eta-sweep", default="", help="comma-separated eta values, e.g. 0,1,2,4,8,16")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        with open(a.plan) as f:
            plan = json.load(f)
        etas = [int(x) for x in a.eta_sweep.split(",")] if a.eta_sweep else [a.eta]
        print(f"{'eta':>4} {'step s':>9} {'tokens/s':>10} {'roll idle':>9} {'train idle':>10} {'stale mean':>10} {'max':>4}")
        for eta in etas:
            r = simulate(plan, steps=a.steps, eta=eta, seed=a.seed)
            print(f"{r['eta']:>4} {r['step_s']:>9.2f} {r['tokens_per_s']:>10.1f} {r['rollout_idle_frac']:>9.2f} "
                  f"{r['trainer_idle_frac']:>10.2f} {r['staleness']['mean']:>10.2f} {r['staleness']['max']:>4}")
        print(f"planner's predicted step: {plan['predicted']['step_s']:.2f} s")
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
