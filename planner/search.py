"""The planner's search (paper Algorithm 1) for one cluster: phase 1 plans the trainer and the rollout replicas of one
split of the GPUs, phase 2 searches the splits. Every time and memory number comes from planner/cost_model.py.

  Phase 1a  train_plan      enumerate DP x TP x PP (TP/DP groups of one GPU type, stages may differ in type),
                            layers per stage proportional to stage compute, then rebalanced for memory; fastest wins.
  Phase 1b  rollout_plan    a MILP (python-mip/CBC) over replica configs psi = (type, TP inside a machine; PP 1):
                            maximise sum_psi y_psi h_psi under per-machine TP packing. Eq. 2 (min makespan Theta with
                            x_psi * len / (y_psi h_psi) <= Theta) is bilinear in (Theta, y); with continuous x_psi the
                            optimum assigns work proportional to throughput, x_psi = B y_psi h_psi / sum y h, so
                            Theta* = B len / sum y h and minimising Theta == maximising sum y h: an integer knapsack.
  Phase 2   partition       GPUs grouped per machine in a networkx graph; Eq. 3 picks the trainer set that maximises
                            training-side link bandwidth + rollout-side HBM bandwidth at a compute share gamma;
                            gamma is bisected until C_T ~ C_I (Evaluation.train_side_s ~ rollout_side_s) (both directions, so training-bound workloads work too),
                            then phases alternate with local moves until the step time is stable for K rounds.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from functools import cache

import mip
import networkx as nx

from parallel import sync_layout
from plan import PlanError
from planner import cost_model
from planner.cost_model import ReplicaCost, StageSpec
from planner.specs import Cluster, Efficiency, ModelSpec, Workload

# ----------------------------------------------------------------------------- plan pieces


@dataclass
class TrainPlan:
    dp: int
    tp: int
    pp: int
    stages: list[tuple[str, int, list[int]]]  # (gpu_type, layers, gpu ids in tp-fastest order)
    seconds: float
    # per stage, the seconds its GPUs work in a step (the rest of it is 1F1B bubble); None: all of `seconds`
    stage_busy_s: list[float] | None = None


@dataclass(frozen=True)
class ReplicaConfig:
    gpu_type: str
    tp: int
    pp: int
    cost: ReplicaCost


@dataclass
class RolloutPlan:
    replicas: list[tuple[ReplicaConfig, list[int]]]  # config, gpu ids (stage-major, tp-fastest)
    tokens_per_s: float
    prefill_tflops: float
    seq_tokens_per_s: float  # decode speed of one sequence on the fastest replica


@dataclass
class SolverStats:
    seconds: float = 0.0
    iterations: int = 0
    evaluations: int = 0
    milp_solves: int = 0
    status: str = "optimal"
    history: list[float] = field(default_factory=list)


def powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


@dataclass
class Evaluation:
    train_counts: tuple[int, ...]  # train GPUs per machine (the first k of each machine)
    train: TrainPlan | None
    rollout: RolloutPlan | None
    train_s: float
    rollout_s: float
    sync_s: float
    step_s: float
    tokens_per_s: float
    # what the CPU host's pricing settled at for this split (cpu_bench/host.HostSpeeds.settle: busy_devices,
    # decode_contention); empty on GPUs
    host_pricing: dict = field(default_factory=dict)
    # the train side's part of sync_s: until its sends are done (cost_model.sync_times); sync_s is until every
    # replica holds the version. None: the same
    sync_send_s: float | None = None

    @property
    def train_sync_s(self) -> float:
        return self.sync_s if self.sync_send_s is None else self.sync_send_s

    @property
    def train_side_s(self) -> float:
        """The paper's C_T: what the train side takes per step (phase 2 balances it against rollout_side_s)."""
        return self.train_s

    @property
    def rollout_side_s(self) -> float:
        """The paper's C_I (inference): what the rollout side takes per step, its wait for the weights included."""
        return self.rollout_s + self.sync_s


# ----------------------------------------------------------------------------- the planner


def rollout_tp_problems(model: ModelSpec, tp: int) -> list[str]:
    """Why a rollout replica of TP degree tp cannot shard this model (empty if it can): like the trainer's tensor
    parallelism it splits whole attention heads, KV heads (never replicated), MLP rows and vocabulary rows."""
    counts = [
        ("attention heads", model.heads),
        ("KV heads", model.kv_heads),
        ("intermediate size", model.intermediate),
        ("vocab size", model.vocab),
    ]
    return [f"{what} ({n})" for what, n in counts if n % tp]


def check_rollout_tp(cluster: Cluster, model: ModelSpec, tp: int) -> None:
    """--rollout-tp K: K must shard the model and fit inside one machine of some GPU type (TP stays in a machine)."""
    if tp < 1:
        raise PlanError(f"--rollout-tp must be >= 1, got {tp}")
    bad = rollout_tp_problems(model, tp)
    if bad:
        raise PlanError(
            f"--rollout-tp {tp} does not divide the model {model.name}'s {', '.join(bad)}: a TP replica shards "
            "whole heads, MLP rows and vocabulary rows and does not replicate KV heads"
        )
    largest = {}
    for m in cluster.machines:
        largest[m.gpu_type] = max(largest.get(m.gpu_type, 0), m.gpus)
    if max(largest.values()) < tp:
        sizes = ", ".join(f"{t}: {n}" for t, n in sorted(largest.items()))
        raise PlanError(
            f"--rollout-tp {tp}: no machine has {tp} GPUs of one type for a TP-{tp} rollout replica "
            f"(largest machine per GPU type: {sizes})"
        )


class Planner:
    """Holds the cluster, model, workload and caches; phase 1 plans one split, the rest evaluates and searches
    splits."""

    def __init__(
        self,
        cluster: Cluster,
        model: ModelSpec,
        wl: Workload,
        eff: Efficiency | None = None,
        max_seconds: float = 10.0,
        forced_layout: tuple[int, int, int] | None = None,
        rollout_tp: int | None = None,
        weight_bucket_mb: float = 64.0,
    ) -> None:
        if rollout_tp is not None:
            check_rollout_tp(cluster, model, rollout_tp)
        self.cluster, self.model, self.wl = cluster, model, wl
        self.eff = eff or Efficiency()
        self.max_seconds = max_seconds
        self.forced_layout = forced_layout
        self.rollout_tp = rollout_tp
        self.weight_bucket_mb = weight_bucket_mb  # dist.weight_bucket_mb of the run: the sync schedule's bucket
        self._sync_cache: dict[tuple, list[sync_layout.SyncBucket]] = {}
        self.stats = SolverStats()
        # global GPU ids in cluster order; machine m owns ids first[m] .. first[m] + gpus - 1
        self.first, n = [], 0
        for m in cluster.machines:
            self.first.append(n)
            n += m.gpus
        self.gpu_machine = [m.index for m in cluster.machines for _ in range(m.gpus)]
        self.types = sorted({m.gpu_type for m in cluster.machines})
        self._rollout_cache: dict[tuple, tuple[float, list]] = {}
        self._configs_cache: dict[str, list[ReplicaConfig]] = {}
        self._split_cache: dict[tuple, list[int] | None] = {}
        self._eval_cache: dict[tuple[int, ...], Evaluation] = {}
        self._orders = self.machine_orders()

    # ------------------------------------------------------------------ Phase 1a: training plan
    def train_plan(self, train_counts: tuple[int, ...]) -> TrainPlan | None:
        per_type: dict[str, list[int]] = {}
        for m, k in zip(self.cluster.machines, train_counts):
            per_type.setdefault(m.gpu_type, []).extend(range(self.first[m.index], self.first[m.index] + k))
        per_type = {t: ids for t, ids in per_type.items() if ids}
        total = sum(len(ids) for ids in per_type.values())
        if total == 0:
            return None
        g = math.gcd(*[len(ids) for ids in per_type.values()])
        best: TrainPlan | None = None
        for group in (d for d in range(1, g + 1) if g % d == 0):  # group = dp * tp GPUs of one stage
            pp = total // group
            if pp > self.model.layers:
                continue
            for tp in (t for t in range(1, group + 1) if group % t == 0 and self.tp_ok(t)):
                dp = group // tp
                if self.forced_layout and (dp, tp, pp) != self.forced_layout:
                    continue
                for order in itertools.permutations(sorted(per_type)):
                    plan = self._layout(per_type, order, dp, tp, pp)
                    if plan and (best is None or plan.seconds < best.seconds):
                        best = plan
        return best

    def tp_ok(self, tp: int) -> bool:
        """TP must split the attention heads and the KV heads evenly: the runtime shards both and never replicates KV
        heads (model_family.check_tp_divides refuses a tp above num_key_value_heads)."""
        return self.model.heads % tp == 0 and self.model.kv_heads % tp == 0

    def _layout(
        self, per_type: dict[str, list[int]], order: tuple[str, ...], dp: int, tp: int, pp: int
    ) -> TrainPlan | None:
        ids = [i for t in order for i in per_type[t]]
        group = dp * tp
        blocks = [ids[k * group : (k + 1) * group] for k in range(pp)]
        types = [self.cluster.machines[self.gpu_machine[b[0]]].gpu_type for b in blocks]
        gm = self.gpu_machine
        specs = []
        for k, b in enumerate(blocks):
            tp_groups = [b[j * tp : (j + 1) * tp] for j in range(dp)]
            dp_groups = [b[j::tp] for j in range(tp)]
            tp_bw = min(self.cluster.group_gbps({gm[i] for i in grp}) for grp in tp_groups)
            dp_bw = min(self.cluster.group_gbps({gm[i] for i in grp}) for grp in dp_groups)
            nxt = min(self.cluster.link_gbps(gm[a], gm[c]) for a, c in zip(b, blocks[k + 1])) if k + 1 < pp else 0.0
            specs.append((types[k], tuple(sorted({gm[i] for i in b})), tp_bw, dp_bw, nxt))
        # CPU cores shared, emulated types (Cluster.speeds)
        speeds = [min(self.cluster.speeds.speed(m, "compute", "train") for m in ms) for _, ms, *_ in specs]
        key = (tuple(types), dp, tp, pp)
        if key not in self._split_cache:
            self._split_cache[key] = self._split_layers(types, dp, tp, pp)
        layers = self._split_cache[key]
        if layers is None:
            return None
        stages = [StageSpec(t, l, ms, a, b, c, v) for (t, ms, a, b, c), l, v in zip(specs, layers, speeds)]
        secs, busy = cost_model.train_step_times(self.model, stages, dp, tp, self.cluster.gpu_types, self.wl, self.eff)
        return TrainPlan(dp, tp, pp, [(t, l, b) for t, l, b in zip(types, layers, blocks)], secs, busy)

    def _split_layers(self, types: list[str], dp: int, tp: int, pp: int) -> list[int] | None:
        """Layers per stage proportional to stage compute (the LM head counts on the last stage), then
        moved off stages that exceed memory, then greedily off the slowest stage while that helps."""
        L, mdl = self.model.layers, self.model
        speed = [
            self.cluster.gpu(t).tflops
            * self.eff.of(t).mfu_train
            * self.cluster.speeds.type_speed(t, "compute", "train")
            for t in types
        ]
        f_layer = mdl.layer_flops_per_token(self.wl.decode_context)
        f_head = 2 * mdl.head_params
        head = [0.0] * (pp - 1) + [f_head]
        target = (L * f_layer + f_head) / sum(speed)
        ideal = [max(1.0, (target * s - h) / f_layer) for s, h in zip(speed, head)]
        layers = [max(1, int(x)) for x in ideal]
        while sum(layers) > L:
            k = max((i for i in range(pp) if layers[i] > 1), key=lambda i: layers[i] - ideal[i], default=None)
            if k is None:
                return None
            layers[k] -= 1
        while sum(layers) < L:
            layers[min(range(pp), key=lambda i: layers[i] - ideal[i])] += 1

        def mem_ok(k: int, lk: int) -> bool:
            need, budget = self.stage_memory(types, k, lk, dp, tp, pp)
            return need <= budget

        def time_of(k: int, lk: int) -> float:
            return (lk * f_layer + head[k]) / speed[k]

        for _ in range(L * pp):  # memory rebalance
            over = [k for k in range(pp) if not mem_ok(k, layers[k])]
            if not over:
                break
            k = over[0]
            dst = [j for j in range(pp) if j != k and mem_ok(j, layers[j] + 1)]
            if layers[k] <= 1 or not dst:
                return None
            layers[k] -= 1
            layers[min(dst, key=lambda j: time_of(j, layers[j] + 1))] += 1
        if any(not mem_ok(k, layers[k]) for k in range(pp)):
            return None
        for _ in range(L):  # balance: shave the slowest stage
            slow = max(range(pp), key=lambda k: time_of(k, layers[k]))
            if layers[slow] <= 1:
                break
            cands = [
                j
                for j in range(pp)
                if j != slow and mem_ok(j, layers[j] + 1) and time_of(j, layers[j] + 1) < time_of(slow, layers[slow])
            ]
            if not cands:
                break
            layers[slow] -= 1
            layers[min(cands, key=lambda j: time_of(j, layers[j] + 1))] += 1
        return layers

    # ------------------------------------------------------------------ memory: the runtime's numbers
    def memory_budget(self, gpu_type: str) -> float:
        """Bytes a rank may allocate: mem_frac of its HBM (the rest is headroom for what no tensor accounts for:
        CUDA context, NCCL buffers, allocator fragmentation)."""
        return self.cluster.gpu(gpu_type).hbm_gb * 1e9 * self.eff.mem_frac

    def stage_memory(self, types: list[str], k: int, lk: int, dp: int, tp: int, pp: int) -> tuple[float, float]:
        """(bytes a GPU of stage k needs, bytes it may use): cost_model.train_memory_parts' total, the trainer's peak as
        exp/estimate_memory.py measures it on the runtime's own code."""
        need = cost_model.train_memory_parts(self.model, lk, k == pp - 1, k == 0, dp, tp, k, pp, self.wl)["peak_bytes"]
        return need, self.memory_budget(types[k])

    def _closest_fit(self, layouts: list[tuple[list[str], int, int, int]]) -> tuple | None:
        """Among (stage types, dp, tp, pp) layouts, the one whose worst stage overshoots its budget least, its layers
        spread to even out the overshoot: (ratio, layout, layers, worst stage)."""
        best = None
        L = self.model.layers
        for types, dp, tp, pp in layouts:
            if pp > L:
                continue
            layers = cost_model.layer_counts(L, pp)

            def ratio(k: int, lk: int, types=types, dp=dp, tp=tp, pp=pp) -> float:
                need, budget = self.stage_memory(types, k, lk, dp, tp, pp)
                return need / budget

            for _ in range(L * pp):  # move a layer from the most to the least loaded stage while that helps
                worst = max(range(pp), key=lambda k: ratio(k, layers[k]))
                light = min(range(pp), key=lambda k: ratio(k, layers[k] + 1))
                if layers[worst] <= 1 or ratio(light, layers[light] + 1) >= ratio(worst, layers[worst]):
                    break
                layers[worst] -= 1
                layers[light] += 1
            worst = max(range(pp), key=lambda k: ratio(k, layers[k]))
            cand = (ratio(worst, layers[worst]), (types, dp, tp, pp), layers, worst)
            best = cand if best is None or cand[0] < best[0] else best
        return best

    def memory_error(self, what: str, layouts: list[tuple[list[str], int, int, int]]) -> str | None:
        """One line naming the rank that does not fit and its bytes, for the closest of `layouts` (None if one fits
        or there is none)."""
        best = self._closest_fit(layouts)
        if best is None or best[0] <= 1.0:
            return None
        _, (types, dp, tp, pp), layers, k = best
        parts = cost_model.train_memory_parts(self.model, layers[k], k == pp - 1, k == 0, dp, tp, k, pp, self.wl)
        start = sum(layers[:k])
        kinds = ", ".join(
            f"{name} {parts[name] / 1e9:.1f}" for name in ("weights", "grads", "optimizer", "activations", "logits")
        )
        gpu = self.cluster.gpu(types[k])
        first = k * dp * tp  # train ranks are stage-major, and in a plan the trainers come first
        return (
            f"memory: {what}: train layout dp {dp} x tp {tp} x pp {pp} does not fit even with layers spread by memory "
            f"({'+'.join(map(str, layers))}): rank {first} (stage {k}: layers {start}-{start + layers[k] - 1} on "
            f"{types[k]}, dp 0, tp 0; every rank of the stage alike) needs {parts['peak_bytes'] / 1e9:.1f} GB ({kinds}) > "
            f"{self.memory_budget(types[k]) / 1e9:.1f} GB ({self.eff.mem_frac:g} x {gpu.hbm_gb:g} GB HBM)"
        )

    def rollout_memory_error(self) -> str:
        """Why no rollout replica fits, naming the smallest replica's bytes against its budget."""
        lines = []
        for t in self.types:
            max_tp = max(m.gpus for m in self.cluster.machines if m.gpu_type == t)
            tps = [self.rollout_tp] if self.rollout_tp else powers_of_two(max_tp)
            tps = [tp for tp in tps if tp <= max_tp and not rollout_tp_problems(self.model, tp)] or [1]
            tp = max(tps)
            parts = cost_model.replica_memory_parts(self.model, tp, 0.0, 0, self.wl, self.weight_bucket_mb * 2**20)
            lines.append(
                f"a TP-{tp} replica on {t} needs {parts['peak_bytes'] / 1e9:.1f} GB per GPU before any KV cache "
                f"(the whole model while it loads, {parts['weights'] / 1e9:.1f} GB of weights once sliced) > "
                f"{self.memory_budget(t) / 1e9:.1f} GB"
            )
        return "; ".join(lines)

    # ------------------------------------------------------------------ Phase 1b: rollout plan
    def replica_configs(self, gpu_type: str) -> list[ReplicaConfig]:
        """Psi for one GPU type: TP inside one machine (powers of two, or exactly --rollout-tp), PP = 1. The
        runtime runs TP replicas only (stage-wise decode across machines is not built), and shards like the
        trainer's tensor parallelism without replicating KV heads (`rollout_tp_problems`)."""
        if gpu_type not in self._configs_cache:
            gpu = self.cluster.gpu(gpu_type)
            max_tp = max(m.gpus for m in self.cluster.machines if m.gpu_type == gpu_type)
            tps = powers_of_two(max_tp) if self.rollout_tp is None else [self.rollout_tp]
            out = []
            for tp in tps:
                if tp > max_tp or rollout_tp_problems(self.model, tp):
                    continue
                bucket = self.weight_bucket_mb * 2**20  # the weight-sync buffers count against memory
                # < 1 only where CPU processes share cores or the type is emulated
                decode = self.cluster.speeds.decode_speed(gpu_type)
                prefill = self.cluster.speeds.type_speed(gpu_type, "compute", "rollout")
                cost = cost_model.replica_cost(
                    self.model, gpu, tp, 1, self.wl, self.eff, gpu.intra_gbps, bucket, decode, prefill
                )
                if cost:
                    out.append(ReplicaConfig(gpu_type, tp, 1, cost))
            self._configs_cache[gpu_type] = out
        return self._configs_cache[gpu_type]

    def _type_rollout_milp(self, gpu_type: str, free: tuple[int, ...]) -> tuple[float, dict]:
        """Max sum y_psi h_psi for one GPU type, `free` = rollout GPUs per machine (sorted). Returns
        (tokens/s, {"y": {config index: count}, "patterns": [(machine slot, [tp sizes])]})."""
        configs = self.replica_configs(gpu_type)
        tps = sorted({c.tp for c in configs})
        if not configs or sum(free) == 0:
            return 0.0, {"y": {}, "patterns": []}
        classes = sorted(set(free))
        patterns = {r: _tp_patterns(r, tuple(tps)) for r in classes}
        model = mip.Model(sense=mip.MAXIMIZE, solver_name=mip.CBC)
        model.verbose = 0
        y = [model.add_var(var_type=mip.INTEGER, lb=0) for _ in configs]
        w = {(r, j): model.add_var(var_type=mip.INTEGER, lb=0) for r in classes for j in range(len(patterns[r]))}
        for r in classes:
            model += mip.xsum(w[r, j] for j in range(len(patterns[r]))) == free.count(r)
        for tp in tps:
            supply = mip.xsum(w[r, j] * patterns[r][j].count(tp) for r in classes for j in range(len(patterns[r])))
            model += mip.xsum(c.pp * y[i] for i, c in enumerate(configs) if c.tp == tp) <= supply
        model.objective = mip.xsum(c.cost.tokens_per_s * y[i] for i, c in enumerate(configs))
        status = model.optimize(max_seconds=self.max_seconds)
        self.stats.milp_solves += 1
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            raise PlanError(f"rollout MILP for {gpu_type} ended with status {status.name}")
        if status != mip.OptimizationStatus.OPTIMAL:
            self.stats.status = "feasible (time limit)"
        counts = {i: int(round(v.x)) for i, v in enumerate(y) if v.x and v.x > 0.5}
        slots = []
        for r in classes:
            for j, pat in enumerate(patterns[r]):
                slots += [(r, pat)] * int(round(w[r, j].x or 0))
        return sum(configs[i].cost.tokens_per_s * n for i, n in counts.items()), {"y": counts, "patterns": slots}

    def _type_rollout_brute(self, gpu_type: str, free: tuple[int, ...]) -> tuple[float, dict]:
        """--exhaustive: enumerate every multiset of replicas, keep the best one that packs into machines."""
        configs = self.replica_configs(gpu_type)
        best: tuple[float, dict] = (0.0, {"y": {}})

        def packs(need: dict[int, int]) -> bool:
            groups = sorted((tp for tp, n in need.items() for _ in range(n)), reverse=True)
            return _pack(tuple(groups), tuple(sorted(free, reverse=True)))

        def rec(i: int, left: int, y: dict[int, int], value: float) -> None:
            nonlocal best
            if i == len(configs):
                need: dict[int, int] = {}
                for j, n in y.items():
                    need[configs[j].tp] = need.get(configs[j].tp, 0) + configs[j].pp * n
                if value > best[0] and packs(need):
                    best = (value, {"y": dict(y)})
                return
            c = configs[i]
            for n in range(left // (c.tp * c.pp) + 1):
                if n:
                    y[i] = n
                rec(i + 1, left - n * c.tp * c.pp, y, value + n * c.cost.tokens_per_s)
            y.pop(i, None)

        rec(0, sum(free), {}, 0.0)
        return best

    def rollout_plan(self, train_counts: tuple[int, ...], exhaustive: bool = False) -> RolloutPlan | None:
        free_by_type: dict[str, list[tuple[int, int]]] = {}
        for m, k in zip(self.cluster.machines, train_counts):
            if m.gpus - k > 0:
                free_by_type.setdefault(m.gpu_type, []).append((m.gpus - k, m.index))
        replicas: list[tuple[ReplicaConfig, list[int]]] = []
        for t, free in free_by_type.items():
            key = (t, tuple(sorted(r for r, _ in free)), exhaustive)
            if key not in self._rollout_cache:
                solve = self._type_rollout_brute if exhaustive else self._type_rollout_milp
                self._rollout_cache[key] = solve(t, key[1])
            value, sol = self._rollout_cache[key]
            if value > 0:
                replicas += self._place_replicas(t, free, sol, train_counts)
        if not replicas:
            return None
        total = sum(c.cost.tokens_per_s for c, _ in replicas)
        prefill = sum(c.cost.prefill_tflops for c, _ in replicas)
        seq = max(1.0 / c.cost.round_s for c, _ in replicas)
        return RolloutPlan(replicas, total, prefill, seq)

    def _place_replicas(
        self, gpu_type: str, free: list[tuple[int, int]], sol: dict, train_counts: tuple[int, ...]
    ) -> list[tuple[ReplicaConfig, list[int]]]:
        """Turn replica counts into concrete GPUs: cut each machine's rollout GPUs into TP groups
        (largest first, contiguous local ids), then give each replica pp groups of its TP size."""
        configs = self.replica_configs(gpu_type)
        demand = sorted(((configs[i], n) for i, n in sol["y"].items()), key=lambda cn: -cn[0].tp)
        need = {}
        for c, n in demand:
            need[c.tp] = need.get(c.tp, 0) + c.pp * n
        groups: dict[int, list[list[int]]] = {tp: [] for tp in need}
        machines = sorted(free, key=lambda rm: (-rm[0], rm[1]))
        cursor = {m: self.first[m] + train_counts[m] for _, m in machines}
        left = {m: r for r, m in machines}
        for tp in sorted(need, reverse=True):  # first-fit decreasing (exact for powers of 2)
            for _, m in machines:
                while len(groups[tp]) < need[tp] and left[m] >= tp:
                    groups[tp].append(list(range(cursor[m], cursor[m] + tp)))
                    cursor[m] += tp
                    left[m] -= tp
            if len(groups[tp]) < need[tp]:
                raise PlanError(f"internal: could not place {need[tp]} TP-{tp} groups on {gpu_type} machines")
        out = []
        for c, n in demand:
            for _ in range(n):
                ids = [i for _ in range(c.pp) for i in groups[c.tp].pop(0)]
                out.append((c, ids))
        return out

    # ------------------------------------------------------------------ weight sync, as the runtime runs it
    def sync_buckets(self, train: TrainPlan) -> list[sync_layout.SyncBucket]:
        """The buckets parallel/weight_sync.py sends for this training plan (sync_layout.sync_buckets, one function)."""
        ranges, start = [], 0
        for _, layers, _ in train.stages:
            ranges.append((start, start + layers))
            start += layers
        key = tuple(ranges)
        if key not in self._sync_cache:
            table = sync_layout.hf_param_table(self.model)
            self._sync_cache[key] = sync_layout.sync_buckets(
                table, ranges, self.wl.bytes, int(self.weight_bucket_mb * 2**20)
            )
        return self._sync_cache[key]

    def rollout_machines(self, rollout) -> dict[int, int]:
        """Rollout machine -> its number of replicas (each machine gets one copy; its relay forwards the rest)."""
        out: dict[int, int] = {}
        for _, ids in rollout.replicas:
            m = self.gpu_machine[ids[0]]
            out[m] = out.get(m, 0) + 1
        return out

    def owner_machines(self, train: TrainPlan) -> list[list[int]]:
        """[stage][dp] -> the machine of that DP replica's owner of the stage (its tp 0 GPU)."""
        return [[self.gpu_machine[ids[d * train.tp]] for d in range(train.dp)] for _, _, ids in train.stages]

    # ------------------------------------------------------------------ evaluate one partition
    def evaluate(self, train_counts: tuple[int, ...], exhaustive: bool = False) -> Evaluation:
        """The step of one split (train GPUs per machine), priced at the cluster's device speeds once they settle
        for this split (Cluster.speeds.settle: at once on GPUs)."""
        key = train_counts + ((1,) if exhaustive else ())
        if key in self._eval_cache:
            return self._eval_cache[key]
        self.stats.evaluations += 1
        ev = self.cluster.speeds.settle(self, train_counts, exhaustive)
        self._eval_cache[key] = ev
        return ev

    def priced_at(self, speeds) -> Planner:
        """This planner with its devices at `speeds` (same cluster, model, workload, efficiencies and options),
        with fresh caches."""
        pricer = Planner(
            self.cluster.with_speeds(speeds),
            self.model,
            self.wl,
            self.eff,
            self.max_seconds,
            self.forced_layout,
            self.rollout_tp,
            self.weight_bucket_mb,
        )
        pricer.stats = self.stats  # its MILP solves are this planner's
        return pricer

    def price(self, train_counts: tuple[int, ...], exhaustive: bool) -> Evaluation:
        """The step of one split at the device speeds this planner's cluster has now."""
        train = self.train_plan(train_counts)
        rollout = self.rollout_plan(train_counts, exhaustive)
        inf = math.inf
        train_s = train.seconds if train else inf
        rollout_s = inf
        if rollout:
            rollout_s = cost_model.rollout_seconds(
                self.model,
                self.wl,
                rollout.tokens_per_s,
                rollout.prefill_tflops,
                rollout.seq_tokens_per_s,
                sum(c.cost.batch for c, _ in rollout.replicas),
                train_s,
            )
        sync_s = sync_send_s = inf
        if train and rollout:
            machines = self.rollout_machines(rollout)
            owners = self.owner_machines(train)
            # the train side's owners send, the rollout ranks receive: the slower end sets the hop
            speed = min(
                [self.cluster.speeds.speed(m, "link", "rollout") for m in machines]
                + [self.cluster.speeds.speed(m, "link", "train") for stage in owners for m in stage]
            )
            sync_send_s, sync_s = cost_model.sync_times(
                self.sync_buckets(train), machines, owners, self.cluster.link_gbps, self.eff, speed
            )
        step = (
            cost_model.step_seconds(rollout_s, train_s, sync_s, self.wl, sync_send_s) if math.isfinite(sync_s) else inf
        )
        ev = Evaluation(
            train_counts,
            train,
            rollout,
            train_s,
            rollout_s,
            sync_s,
            step,
            self.wl.tokens_per_step / step if math.isfinite(step) else 0.0,
            sync_send_s=sync_send_s,
        )
        return ev

    # ------------------------------------------------------------------ Phase 2: graph partition
    def graph(self) -> nx.Graph:
        """Machines as nodes (GPU count, compute c, HBM bandwidth m, HBM size M); links as edges (beta)."""
        g = nx.Graph()
        for m in self.cluster.machines:
            gpu = self.cluster.gpu(m.gpu_type)
            g.add_node(m.index, gpus=m.gpus, c=gpu.tflops, m=gpu.hbm_tbps, M=gpu.hbm_gb, beta_intra=gpu.intra_gbps)
        for a, b in itertools.combinations(range(len(self.cluster.machines)), 2):
            g.add_edge(a, b, beta=self.cluster.link_gbps(a, b))
        return g

    def largest_first_order(self) -> tuple[int, ...]:
        """The order in which trainers fill machines when links are ignored (--topology-blind, and the first of
        machine_orders): largest machines first, then by index."""
        return tuple(m.index for m in sorted(self.cluster.machines, key=lambda m: (-m.gpus, m.index)))

    def machine_orders(self) -> list[tuple[int, ...]]:
        """Orders in which trainers fill machines (`place_trainers`). Filling along an order puts the trainers on a prefix
        of it, so an order whose prefixes are well-connected groups keeps the trainer side's DP/TP/PP links fast
        and leaves the slow links to the weight-sync cut. Besides the blind order, two graph partitions of the link
        graph (machines as nodes, GB/s between them as edge weights) give such orders, each also reversed:
          - recursive Kernighan-Lin bisection (min-weight cut: the slowest links, e.g. between racks or regions,
            are cut first, so each side of every cut is contiguous in the order);
          - Louvain communities (modularity on the same weights): each community contiguous, largest first.
        The cost model picks among the placements (`best_placement`). With uniform links every order is
        equivalent, so only the blind one is used."""
        blind = self.largest_first_order()
        if len(self.cluster.machines) < 3:
            return [blind]
        g = self.graph()
        if len({d["beta"] for _, _, d in g.edges(data=True)}) <= 1:
            return [blind]
        rank_in_blind = {m: i for i, m in enumerate(blind)}

        def bisect(nodes: list[int]) -> list[int]:
            if len(nodes) <= 2:
                return sorted(nodes, key=rank_in_blind.get)
            a, b = nx.algorithms.community.kernighan_lin_bisection(g.subgraph(nodes), weight="beta", seed=0)
            # the side with more GPUs (then the blind order's first machine) leads
            a, b = sorted(
                (sorted(a), sorted(b)), key=lambda side: (-self.gpus_on(side), min(map(rank_in_blind.get, side)))
            )
            return bisect(a) + bisect(b)

        kl = tuple(bisect(list(g.nodes)))
        communities = nx.community.louvain_communities(g, weight="beta", seed=0)
        communities = sorted(communities, key=lambda c: (-self.gpus_on(c), min(map(rank_in_blind.get, c))))
        louvain = tuple(m for c in communities for m in sorted(c, key=rank_in_blind.get))
        orders = [blind]
        for order in (kl, kl[::-1], louvain, louvain[::-1]):
            if order not in orders:
                orders.append(order)
        return orders

    def gpus_on(self, machines) -> int:
        return sum(self.cluster.machines[m].gpus for m in machines)

    def per_type(self, counts: tuple[int, ...]) -> dict[str, int]:
        return {t: sum(k for m, k in zip(self.cluster.machines, counts) if m.gpu_type == t) for t in self.types}

    def place_trainers(self, per_type: dict[str, int], order: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """A split by type placed on machines: per-type trainer counts -> per-machine counts, filling machines along
        `order` (default: largest first), which keeps TP/DP groups inside machines and leaves whole machines to
        rollout."""
        counts = [0] * len(self.cluster.machines)
        for t, n in per_type.items():
            for i in order or self.largest_first_order():
                if self.cluster.machines[i].gpu_type == t:
                    counts[i] = min(n, self.cluster.machines[i].gpus)
                    n -= counts[i]
        return tuple(counts)

    def best_placement(self, per_type: dict[str, int]) -> Evaluation:
        """The per-type split placed along each machine order; the cost model's fastest wins (ties: the first)."""
        best = None
        for order in self._orders:
            ev = self.evaluate(self.canonical(self.place_trainers(per_type, order)))
            if best is None or ev.step_s < best.step_s * (1 - 1e-9):
                best = ev
        return best

    def partition_candidates(self, g: nx.Graph) -> list[tuple[float, float, dict[str, int]]]:
        """(compute share of D_T, Eq. 3 objective, per-type trainer counts) for every candidate split."""
        n_type = {t: sum(m.gpus for m in self.cluster.machines if m.gpu_type == t) for t in self.types}
        c_total = sum(d["gpus"] * d["c"] for _, d in g.nodes(data=True))
        m_total = sum(d["gpus"] * d["m"] for _, d in g.nodes(data=True))
        beta_total = sum(d["gpus"] * (d["gpus"] - 1) / 2 * d["beta_intra"] for _, d in g.nodes(data=True)) + sum(
            g.nodes[a]["gpus"] * g.nodes[b]["gpus"] * e["beta"] for a, b, e in g.edges(data=True)
        )
        # per-GPU grid; whole machines on huge clusters. A split needs some DP*TP group size dividing every
        # type's trainer count with at most `layers` stages, i.e. total / gcd <= layers.
        steps = {
            t: 1 if n <= 96 else max(m.gpus for m in self.cluster.machines if m.gpu_type == t)
            for t, n in n_type.items()
        }
        grids = [sorted(set(range(0, n_type[t] + 1, steps[t])) | {n_type[t]}) for t in self.types]
        out = []
        for combo in itertools.product(*grids):
            nonzero = [x for x in combo if x]
            if nonzero and sum(nonzero) // math.gcd(*nonzero) > self.model.layers:
                continue
            per_type = dict(zip(self.types, combo))
            best = None
            for order in self._orders:  # Eq. 3 over where the trainers sit, too: the best-connected placement
                k = self.place_trainers(per_type, order)
                share = sum(k[i] * g.nodes[i]["c"] for i in g.nodes) / c_total
                beta_t = sum(k[i] * (k[i] - 1) / 2 * g.nodes[i]["beta_intra"] for i in g.nodes) + sum(
                    k[a] * k[b] * e["beta"] for a, b, e in g.edges(data=True) if k[a] and k[b]
                )
                m_i = sum((g.nodes[i]["gpus"] - k[i]) * g.nodes[i]["m"] for i in g.nodes)
                objective = beta_t / max(beta_total, 1e-12) + m_i / m_total
                if best is None or objective > best[1] + 1e-12:
                    best = (share, objective, k)
            out.append(best)
        return out

    def graph_partition(self, cands: list, gamma: float, band: float) -> tuple[int, ...]:
        """Eq. 3: max beta-share(D_T) + m-share(D_I) s.t. gamma - band <= c-share(D_T) <= gamma + band."""
        inside = [c for c in cands if abs(c[0] - gamma) <= band]
        if not inside:
            nearest = min(abs(c[0] - gamma) for c in cands)
            inside = [c for c in cands if abs(c[0] - gamma) <= nearest + 1e-12]
        return max(inside, key=lambda c: (c[1], -abs(c[0] - gamma)))[2]

    def solve(self, K: int = 6, max_iterations: int = 60) -> Evaluation:
        """Algorithm 1: bisect gamma on C_T vs C_I with Eq. 3 partitions, then alternate local moves."""
        t0 = time.perf_counter()
        if self.cluster.n_gpus < 2:
            raise PlanError(
                f"role left empty: {self.cluster.n_gpus} GPU cannot hold both a trainer and a rollout replica"
            )
        if self.forced_layout:
            return self._solve_forced(t0)
        g = self.graph()
        cands = self.partition_candidates(g)
        c_total = sum(d["gpus"] * d["c"] for _, d in g.nodes(data=True))
        band = 0.5 * min(d["c"] for _, d in g.nodes(data=True)) / c_total
        best: Evaluation | None = None
        q, r, gamma = 0.0, 1.0, 1.0
        stable = 0
        seen_gamma = set()
        for it in range(max_iterations):
            self.stats.iterations = it + 1
            counts = self.graph_partition(cands, gamma, band)
            ev = self.evaluate(self.canonical(counts))
            per_type = self.per_type(counts)
            if len(self._orders) > 1:  # the same split placed along the other orders, if the cost model prefers one
                ev = min((ev, self.best_placement(per_type)), key=lambda e: e.step_s)
            improved = best is None or ev.step_s < best.step_s * (1 - 1e-9)
            best = ev if improved else best
            self.stats.history.append(best.step_s)
            stable = 0 if improved else stable + 1
            if ev.train_side_s < ev.rollout_side_s:
                r = gamma  # training is faster: give it less compute
            else:
                q = gamma
            gamma = (q + r) / 2
            key = round(gamma, 6)
            if stable >= K or key in seen_gamma or r - q < band / 4:
                break
            seen_gamma.add(key)
        # alternate phases from the best few partitions the bisection visited (multi-start local search)
        starts = sorted((e for e in self._eval_cache.values() if math.isfinite(e.step_s)), key=lambda e: e.step_s)[:3]
        for ev in starts:
            cand = self._refine(ev, g)
            best = cand if cand.step_s < best.step_s else best
        if best is None or not math.isfinite(best.step_s):
            self._explain_infeasible()
        self.stats.seconds = time.perf_counter() - t0
        return best

    def _solve_forced(self, t0: float) -> Evaluation:
        """--train-layout dp,tp,pp fixes |D_T|: try every per-type split of that many trainer GPUs."""
        need = math.prod(self.forced_layout)
        n_type = [sum(m.gpus for m in self.cluster.machines if m.gpu_type == t) for t in self.types]
        best = None
        for combo in itertools.product(*[range(n + 1) for n in n_type]):
            if sum(combo) == need:
                ev = self.best_placement(dict(zip(self.types, combo)))
                best = ev if best is None or ev.step_s < best.step_s else best
        self.stats.iterations, self.stats.seconds = self.stats.evaluations, time.perf_counter() - t0
        if best is None or not math.isfinite(best.step_s):
            self._explain_infeasible()
        return best

    def canonical(self, counts: tuple[int, ...]) -> tuple[int, ...]:
        """The one split that stands for every split equal to `counts` up to swapping interchangeable machines:
        machines of one kind (type, size) are interchangeable unless links are given per machine pair, so the
        trainer counts are sorted inside each kind and symmetric splits share one evaluation (the cache's key)."""
        if self.cluster.machine_gbps:
            return counts
        out = list(counts)
        for kind in machine_kinds(self.cluster):
            for i, v in zip(kind, sorted((counts[i] for i in kind), reverse=True)):
                out[i] = v
        return tuple(out)

    def _refine(self, best: Evaluation, g: nx.Graph) -> Evaluation:
        """Alternate phases with local moves around the incumbent, re-running Phase 1 on each neighbour:
        (a) per-type trainer counts, each type moved by 0, +-1, +-2, +-3, +-4 or +-8 GPUs at once;
        (b) on clusters with <= 24 machines, one GPU on one machine (or from one machine to another).
        Stops when no move improves the step time."""
        n_type = {t: sum(m.gpus for m in self.cluster.machines if m.gpu_type == t) for t in self.types}
        steps = [sorted({0} | {s * x for x in (1, 2, 3, 4, 8) if x <= n_type[t] for s in (-1, 1)}) for t in self.types]
        dirs = [d for d in itertools.product(*steps) if any(d)]
        current = self.per_type(best.train_counts)
        for _ in range(100):
            improved = False
            for d in dirs:
                cand = {t: current[t] + x for t, x in zip(self.types, d)}
                if any(v < 0 or v > n_type[t] for t, v in cand.items()):
                    continue
                ev = self.best_placement(cand)
                if ev.step_s < best.step_s * (1 - 1e-9):
                    best, current, improved = ev, cand, True
            self.stats.history.append(best.step_s)
            if not improved:
                break
        if len(self.cluster.machines) > 24:
            return best
        sizes = [m.gpus for m in self.cluster.machines]
        for _ in range(100):
            improved = False
            base = list(best.train_counts)
            moves = [(a, b) for a in range(len(sizes)) for b in range(-1, len(sizes)) if a != b]
            for a, b in moves + [(-1, b) for b in range(len(sizes))]:
                cand = list(base)
                if a >= 0:
                    cand[a] -= 1
                if b >= 0:
                    cand[b] += 1
                if any(v < 0 or v > n for v, n in zip(cand, sizes)):
                    continue
                ev = self.evaluate(self.canonical(tuple(cand)))
                if ev.step_s < best.step_s * (1 - 1e-9):
                    best, improved = ev, True
            self.stats.history.append(best.step_s)
            if not improved:
                break
        return best

    def _layouts_on(self, n_type: dict[str, int], forced: tuple[int, int, int] | None) -> list:
        """(stage types, dp, tp, pp) the trainer could take on these GPU counts (one type per stage, every order)."""
        out = []
        total = sum(n_type.values())
        g = math.gcd(*n_type.values()) if n_type else 0
        for group in (d for d in range(1, g + 1) if g % d == 0):
            pp = total // group
            for tp in (t for t in range(1, group + 1) if group % t == 0 and self.tp_ok(t)):
                if forced and (group // tp, tp, pp) != forced:
                    continue
                for order in itertools.permutations(sorted(n_type)):
                    types = [t for t in order for _ in range(n_type[t] // group)]
                    out.append((types, group // tp, tp, pp))
        return out

    def _explain_infeasible(self) -> None:
        m = self.model
        n_all = {t: sum(x.gpus for x in self.cluster.machines if x.gpu_type == t) for t in self.types}
        if self.forced_layout:
            need = math.prod(self.forced_layout)
            layouts = [
                layout
                for combo in itertools.product(*[range(n + 1) for n in n_all.values()])
                if sum(combo) == need and sum(combo) < self.cluster.n_gpus
                for layout in self._layouts_on({t: c for t, c in zip(n_all, combo) if c}, self.forced_layout)
            ]
            error = self.memory_error(f"--train-layout {','.join(map(str, self.forced_layout))}", layouts)
            if error:
                raise PlanError(error)
            raise PlanError(
                f"--train-layout {','.join(map(str, self.forced_layout))} leaves no valid plan (needs "
                f"dp*tp*pp trainer GPUs of one type per stage, tp dividing {m.heads} heads, memory, and "
                f">= 1 rollout GPU among {self.cluster.n_gpus})"
            )
        fits_train = fits_roll = False
        for t in self.types:
            if self.replica_configs(t):
                fits_roll = True
            ev = self.evaluate(self.place_trainers({t: n_all[t]}))
            fits_train |= ev.train is not None
        if not fits_roll:
            raise PlanError(
                f"memory: model {m.name} ({m.params / 1e9:.2f}B params) fits no rollout replica "
                f"({'TP ' + str(self.rollout_tp) if self.rollout_tp else 'TP'} inside one machine, PP 1) "
                f"on GPU types {self.types}: {self.rollout_memory_error()}"
            )
        if not fits_train:
            spare = 0 if len(self.types) > 1 else 1  # one GPU is left to rollout
            layouts = [
                x for t in self.types for c in range(1, n_all[t] + 1 - spare) for x in self._layouts_on({t: c}, None)
            ]
            error = self.memory_error(f"model {m.name} on this cluster", layouts)
            raise PlanError(
                error or f"memory: model {m.name} does not fit any DP x TP x PP training layout on this cluster"
            )
        forced = (
            f" (--rollout-tp {self.rollout_tp}: every rollout replica takes {self.rollout_tp} GPUs of one machine)"
            if self.rollout_tp
            else ""
        )
        raise PlanError(
            f"role left empty: no split gives both a feasible trainer set and a feasible rollout set{forced}"
        )

    # ------------------------------------------------------------------ --exhaustive
    def exhaustive(self) -> Evaluation:
        """Brute force over the same space: every per-machine trainer count, every replica multiset."""
        t0 = time.perf_counter()
        best = None
        # symmetric partitions (same counts permuted among interchangeable machines) are evaluated once
        for counts in sorted(
            {self.canonical(c) for c in itertools.product(*[range(m.gpus + 1) for m in self.cluster.machines])}
        ):
            ev = self.evaluate(counts, exhaustive=True)
            if best is None or ev.step_s < best.step_s:
                best = ev
            self.stats.iterations += 1
        if best is None or not math.isfinite(best.step_s):
            self._explain_infeasible()
        self.stats.seconds = time.perf_counter() - t0
        self.stats.status = "exhaustive"
        return best


def machine_kinds(cluster: Cluster) -> list[list[int]]:
    """The cluster's machines grouped by (GPU type, GPU count): interchangeable for the search."""
    kinds: dict[tuple[str, int], list[int]] = {}
    for m in cluster.machines:
        kinds.setdefault((m.gpu_type, m.gpus), []).append(m.index)
    return list(kinds.values())


@cache
def _tp_patterns(r: int, tps: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every multiset of TP group sizes (from tps) that fits in r GPUs of one machine."""
    out = []

    def rec(left: int, i: int, acc: tuple[int, ...]) -> None:
        out.append(acc)
        for j in range(i, len(tps)):
            if tps[j] <= left:
                rec(left - tps[j], j, acc + (tps[j],))

    rec(r, 0, ())
    return out


@cache
def _pack(groups: tuple[int, ...], bins: tuple[int, ...]) -> bool:
    """Can these TP groups (sizes, descending) be placed into machines with `bins` free GPUs?"""
    if not groups:
        return True
    g, rest = groups[0], groups[1:]
    tried = set()
    for i, b in enumerate(bins):
        if b >= g and b not in tried:
            tried.add(b)
            nb = tuple(sorted(bins[:i] + (b - g,) + bins[i + 1 :], reverse=True))
            if _pack(rest, nb):
                return True
    return False
