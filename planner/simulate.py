"""Discrete-event simulator of the asynchronous RL pipeline for any plan JSON from schedule.py.

    python exp/simulate.py --plan plan.json --steps 20 --eta 4
    python exp/simulate.py --plan plan.json --eta-sweep 0,1,2,4,8,16
    python exp/simulate.py --plan plan.json --eta 4 --consume-order all --long-tail 1.0

Model (AReaL §4-5 on top of the planner's costs, no formula duplicated here: decode step times come from
cost_model.decode_round_s, training and sync times from the plan's predictions):
  - admission, deadlines and batches are the train head's own buffer.StalenessBuffer (units: GRPO groups of
    samples_per_prompt sequences; a group completes when its last sequence does), with its consume order:
    `deadline` (the default), `admission` (strict admission order) or `completion` (plain AReaL);
  - admitted groups go to the replica with the least work per slot; a replica runs continuous batching up
    to its memory-limited batch, the rest of its groups queue; one decode round of n running sequences takes
    round_s(n); a sequence of g tokens finishes after g rounds;
  - a batch is taken as soon as the buffer has one ready; a step takes train_s scaled by its tokens; no group
    is admitted during the step (the next version's weights do not exist yet);
  - after each step both sides pause for the weight sync -- the replicas until they hold the version, the trainer
    until its sends are done (cost_model.sync_times); running sequences are interrupted, their KV is recomputed
    with the new weights (prefill of the held context), then decoding continues;
  - staleness of a sample = trainer version at consumption - version at admission.
Because rounds advance every running sequence by one token, a replica keeps one "progress" clock and each
sequence its finishing progress, so an event costs O(replicas) and 20 steps of 10^4 requests run in seconds.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from buffer import StalenessBuffer
from planner import cost_model, specs


@dataclass
class Replica:
    batch: int
    round_s: list[float]  # round_s[n] for n running sequences (index 0 unused)
    prefill_s_per_token: float
    progress: float = 0.0  # decode rounds done so far
    paused_until: float = 0.0
    running: list = field(default_factory=list)  # heap of (finish progress, seq id)
    waiting: list = field(default_factory=list)  # admitted sequences waiting for a slot, FIFO
    busy_s: float = 0.0

    def rate(self) -> float:  # rounds per second with the current batch
        return 1.0 / self.round_s[len(self.running)] if self.running else 0.0

    def load(self) -> float:
        return (len(self.running) + len(self.waiting)) / self.batch


@dataclass
class Seq:
    admitted_version: int
    prompt: float
    gen: float
    group_id: int


def _inputs(plan: dict, workload: specs.Workload | dict | None, eta: int | None):
    inp = plan["inputs"]
    cluster = specs.cluster_from_dict(inp["cluster"], "plan.inputs.cluster")
    busy, contention = (plan.get("predicted", {}).get(k) for k in ("busy_devices", "decode_contention"))
    if busy or contention:  # a CPU host: what its pricing settled at for the plan (cpu_bench/host.HostSpeeds.settle)
        contention = {t: float(c) for t, c in contention.items()} if contention else None
        cluster = cluster.with_speeds(cluster.speeds.with_busy_devices(busy or {}, contention))
    model = specs.model_from_config(inp["model"])
    wl = workload if isinstance(workload, specs.Workload) else specs.Workload(**(workload or inp["workload"]))
    if eta is not None:
        wl = specs.Workload(**{**wl.to_dict(), "eta": eta})
    return cluster, model, wl, specs.Efficiency.from_dict(inp["efficiency"])


def build_replicas(
    plan: dict,
    cluster: specs.Cluster,
    model: specs.ModelSpec,
    wl: specs.Workload,
    eff: specs.Efficiency,
    decode_s_per_token: float | None = None,
    prefill_s_per_token: float | None = None,
) -> list[Replica]:
    """Per-replica round-time curves from the cost model; a measured decode time per generated token
    (replica time / tokens at its full batch) rescales each curve to match the measurement, and a measured
    prefill time per prompt/recomputed token replaces the cost model's."""
    out = []
    for rep in plan["rollout"]["replicas"]:
        gpu, te = cluster.gpu(rep["gpu_type"]), eff.of(rep["gpu_type"])
        link = gpu.intra_gbps
        # < 1 where CPU processes share cores or the type is emulated, as the planner prices it
        speed = cluster.speeds.decode_speed(rep["gpu_type"])
        curve = [0.0] + [
            cost_model.decode_round_s(model, gpu, te, rep["tp"], rep["pp"], n, wl.decode_context, wl.bytes, link, speed)
            for n in range(1, rep["batch"] + 1)
        ]
        if decode_s_per_token is not None:
            scale = decode_s_per_token * rep["batch"] / curve[rep["batch"]]
            curve = [c * scale for c in curve]
        # a replica prefills in the rollout role (its core share there)
        rate = rep["tp"] * rep["pp"] * gpu.tflops * 1e12 * te.mfu_infer
        rate *= cluster.speeds.type_speed(rep["gpu_type"], "compute", "rollout")
        prefill = prefill_s_per_token if prefill_s_per_token is not None else 2 * model.params / rate
        out.append(Replica(rep["batch"], curve, prefill))
    if not out:
        raise ValueError("plan has no rollout replicas")
    return out


def simulate(
    plan: dict,
    workload: specs.Workload | dict | None = None,
    steps: int = 20,
    eta: int | None = None,
    seed: int = 0,
    decode_s_per_token: float | None = None,
    train_s_per_token: float | None = None,
    sync_s: float | None = None,
    warmup: int = 2,
    prefill_s_per_token: float | None = None,
    consume_order: str = "deadline",
    sync_send_s: float | None = None,
) -> dict:
    """Run `steps` trainer steps; report mean step time, tokens/s, idle fractions and staleness. The weight sync
    pauses the replicas until they hold the version (sync_s) and the trainer until its sends are done (sync_send_s;
    default: the plan's, or sync_s where only that is given)."""
    if steps < warmup + 1:
        raise ValueError(f"steps must exceed warmup ({warmup}), got {steps}")
    cluster, model, wl, eff = _inputs(plan, workload, eta)
    rng = random.Random(seed)
    replicas = build_replicas(plan, cluster, model, wl, eff, decode_s_per_token, prefill_s_per_token)
    mean_tokens = wl.prompt_len + wl.gen_mean
    train_per_token = (
        train_s_per_token if train_s_per_token is not None else plan["predicted"]["train_s"] / (wl.batch * mean_tokens)
    )
    sync = plan["predicted"]["sync_s"] if sync_s is None else sync_s
    if sync_send_s is None:
        sync_send_s = plan["predicted"].get("sync_send_s", sync) if sync_s is None else sync

    # the train head's own buffer: admission, deadlines and batches exactly as in a run (units: groups)
    buf = StalenessBuffer(wl.prompts_per_step, wl.eta, consume_order=consume_order)
    buf.weights_sent(0)
    seqs: list[Seq] = []
    unfinished: dict[int, int] = {}  # group -> its sequences still generating
    group_seqs: dict[int, list[int]] = {}
    now = 0.0
    train_end = None  # time the running train step ends
    train_busy = 0.0
    trainer_ready_at = 0.0
    step_times, step_tokens, staleness = [], [], []

    def start(rep: Replica, sid: int) -> None:
        heapq.heappush(rep.running, (rep.progress + seqs[sid].gen, sid))

    def admit() -> None:
        # as the head grants: everything the bound allows, to the least-loaded replica; what finds no free
        # slot queues there (a rollout rank's own queue)
        while buf.capacity() > 0:
            rep = min(replicas, key=lambda r: (r.load(), -r.batch))
            ticket = buf.admit(prompt_id=0, rank=replicas.index(rep))  # prompts differ only in length draws
            unfinished[ticket.group_id] = wl.samples_per_prompt
            group_seqs[ticket.group_id] = list(range(len(seqs), len(seqs) + wl.samples_per_prompt))
            # the samples of a group share their prompt's K/V: the generator prefills it once
            rep.paused_until = max(rep.paused_until, now) + wl.prompt_len * rep.prefill_s_per_token
            for _ in range(wl.samples_per_prompt):
                seqs.append(Seq(buf.version, wl.prompt_len, float(rng.choice(wl.gen_samples)), ticket.group_id))
                if len(rep.running) < rep.batch:
                    start(rep, len(seqs) - 1)
                else:
                    rep.waiting.append(len(seqs) - 1)

    admit()
    while len(step_times) < steps:
        # next event: a sequence finishing on some replica, or the train step ending
        nxt, who = train_end if train_end is not None else float("inf"), None
        for r in replicas:
            if r.running:
                start_t = max(now, r.paused_until)
                t = start_t + (r.running[0][0] - r.progress) * r.round_s[len(r.running)]
                if t < nxt:
                    nxt, who = t, r
        if nxt == float("inf"):
            raise RuntimeError("simulation stalled: no running sequence and no train step (check eta / batch)")
        for r in replicas:  # advance every replica to `nxt`
            start_t = max(now, r.paused_until)
            if r.running and nxt > start_t:
                r.progress += (nxt - start_t) * r.rate()
                r.busy_s += nxt - start_t
        now = nxt
        changed = False  # ready() changes only with completions / steps
        if who is not None:
            while who.running and who.running[0][0] <= who.progress + 1e-9:
                sid = heapq.heappop(who.running)[1]
                g = seqs[sid].group_id
                unfinished[g] -= 1
                if unfinished[g] == 0:
                    del unfinished[g]
                    buf.complete(g, group_seqs.pop(g))
                    changed = True
                if who.waiting:
                    start(who, who.waiting.pop(0))
        elif train_end is not None and now >= train_end:
            train_end = None
            step_times.append(now)
            for r in replicas:  # weight sync: pause, interrupt, recompute KV
                held = sum(seqs[sid].prompt + seqs[sid].gen - (fin - r.progress) for fin, sid in r.running)
                r.paused_until = max(r.paused_until, now) + sync + held * r.prefill_s_per_token
            trainer_ready_at = now + sync_send_s
            buf.weights_sent(buf.version)  # the pause above is the transfer
            changed = True
        if train_end is None and changed and buf.ready():
            v = buf.version
            batch = [sid for _, sids in buf.take() for sid in sids]
            tokens = sum(seqs[s].prompt + seqs[s].gen for s in batch)
            staleness += [v - seqs[s].admitted_version for s in batch]
            start_t = max(now, trainer_ready_at)
            train_end = start_t + tokens * train_per_token
            train_busy += train_end - start_t
            step_tokens.append(tokens)
        admit()

    if train_end is not None:  # don't count a step still running at the end
        train_busy -= max(0.0, train_end - now)
    t0, t1 = step_times[warmup - 1], step_times[-1]
    span = t1 - t0
    hist: dict[int, int] = {}
    for s in staleness:
        hist[s] = hist.get(s, 0) + 1
    total_replica_s = len(replicas) * now
    return {
        "steps": steps,
        "eta": wl.eta,
        "consume_order": consume_order,
        "step_s": span / (steps - warmup),
        "tokens_per_s": sum(step_tokens[warmup:steps]) / span,
        "rollout_idle_frac": 1 - sum(r.busy_s for r in replicas) / total_replica_s,
        "trainer_idle_frac": 1 - train_busy / now,
        "staleness": {
            "mean": sum(staleness) / len(staleness),
            "max": max(staleness),
            "hist": {str(k): v for k, v in sorted(hist.items())},
        },
        "predicted_step_s": plan["predicted"]["step_s"],
        "sim_seconds": now,
    }


def predict_from_measured(
    plan: dict,
    decode_s_per_token: float,
    train_s_per_token: float,
    sync_s: float | None = None,
    steps: int = 12,
    eta: int | None = None,
    workload: specs.Workload | dict | None = None,
    seed: int = 0,
) -> dict:
    """Validation hook: a short profile of a run gives seconds per generated token of one replica at full
    batch and trainer seconds per token; predict that run's step time and tokens/s."""
    res = simulate(
        plan,
        workload,
        steps=steps,
        eta=eta,
        seed=seed,
        decode_s_per_token=decode_s_per_token,
        train_s_per_token=train_s_per_token,
        sync_s=sync_s,
    )
    return {"step_s": res["step_s"], "tokens_per_s": res["tokens_per_s"], "simulation": res}


def long_tail_workload(plan: dict, sigma: float, n: int = 256) -> specs.Workload:
    """The plan's workload with lognormal output lengths of the same mean (n quantiles, capped at 20x mean)."""
    if sigma <= 0:
        raise ValueError(f"--long-tail sigma must be > 0, got {sigma}")
    wl = specs.Workload(**plan["inputs"]["workload"])
    z = statistics.NormalDist()
    raw = [math.exp(sigma * z.inv_cdf((i + 0.5) / n)) for i in range(n)]
    scale = wl.gen_mean / (sum(raw) / n)
    lengths = [max(1.0, min(20 * wl.gen_mean, x * scale)) for x in raw]
    return specs.Workload(**{**wl.to_dict(), "gen_samples": lengths})
